"""The README is for operators first, and every fact in it that code also states is the
code's: the exit codes, the settings, the metric names, the pinned version, the
Dockerfile. The commands themselves run in tests/installed/test_guide.py (and the
``find-pid``, ``status-url`` and ``confirm-logs`` blocks on real servers in tests/e2e)."""

from __future__ import annotations

import re

import vllm_mmcache_fix
from harness.paths import REPO_ROOT
from harness.readme import README, guide_blocks
from vllm_mmcache_fix import plugin, vllm_layout
from vllm_mmcache_fix.core.settings import DEFAULT_HEALTH_TIMEOUT
from vllm_mmcache_fix.metrics import names
from vllm_mmcache_fix.tools import exits

TEXT = README.read_text()
VERSION = vllm_mmcache_fix.__version__


def _section(title: str) -> str:
    start = TEXT.index(f"\n## {title}\n")
    end = TEXT.find("\n## ", start + 1)
    return TEXT[start : end if end > 0 else None]


def test_guide_has_every_step() -> None:
    assert set(guide_blocks()) == {
        "find-pid",
        "build-wheel",
        "install-offline",
        "dockerfile-gpu",
        "gate",
        "confirm-logs",
        "status-url",
        "plugins-filter",
        "k8s-probes",
        "alert-rules",
        "source-patch",
    }


def test_the_first_screen_lets_on_call_act() -> None:
    first = "\n".join(TEXT.splitlines()[:25])
    for needed in ("diagnose --pid", "restart", "--mm-processor-cache-gb 0", "/health"):
        assert needed in first, needed
    titles = re.findall(r"^## (.+)$", TEXT, re.M)
    assert titles[:4] == ["Am I affected?", "A server is frozen right now", "Install", "Verify"]
    assert titles[-1] == "Development"
    runbook = _section("A server is frozen right now")
    for needed in ("SYS_PTRACE", "needs no vLLM", "PID 1", "Keep", "py-spy"):
        assert needed in runbook, needed


def test_the_exit_code_table_is_the_code_table() -> None:
    block = re.search(r"<!-- exit-codes:begin -->\n(.*?)\n<!-- exit-codes:end -->", TEXT, re.S)
    assert block is not None
    assert block.group(1) == exits.markdown_table()


def test_every_setting_is_in_the_settings_table() -> None:
    table = _section("Settings")
    for spec in plugin.settings():
        row = re.search(rf"^\| `{spec.name}` \| `?([^|`]*)`? \|", table, re.M)
        assert row is not None, spec.name
        assert row.group(1).strip() == (spec.default or "unset"), spec.name


def test_metric_names_are_the_plugins() -> None:
    known = {spec.name for spec in names.METRICS} | {names.ENGINE_LAST_ANSWER_AGE}
    known.add(vllm_layout.ENGINE_PING_METHOD)  # the utility call, not a metric
    suffixes = ("_count", "_sum", "_bucket", "_created")
    for path in (README, REPO_ROOT / "docs" / "design.md"):
        for found in set(re.findall(r"\bmmcache_fix_[a-z_]+", path.read_text())):
            base = next((found[: -len(s)] for s in suffixes if found.endswith(s)), found)
            assert found in known or base in known, (path.name, found)


def test_the_version_and_the_dockerfiles() -> None:
    # The wheel just built is the one in wheels/ (its version carries the commit); the
    # published command names the release the development version leads to.
    pin = "--find-links /tmp/wheels vllm-mmcache-fix \\\n"
    assert guide_blocks()["install-offline"][1].strip().endswith("wheels/ vllm-mmcache-fix")
    release = VERSION.split(".dev")[0]
    assert f"Once it is published: `pip install vllm-mmcache-fix=={release}`" in README.read_text()
    lang, body = guide_blocks()["dockerfile-gpu"]
    assert lang == "dockerfile"
    assert body == (REPO_ROOT / "examples" / "Dockerfile.gpu").read_text()
    for name in ("Dockerfile.gpu", "Dockerfile.ascend"):
        text = (REPO_ROOT / "examples" / name).read_text()
        assert pin in text and "vllm-mmcache-fix check" in text, name


def test_the_probes_do_not_wait_for_the_engine_timeout() -> None:
    """/health answers at once with the plugin: the probes keep Kubernetes' default 1 s
    timeout, and the section states the engine timeout's real default."""
    probes = guide_blocks()["k8s-probes"][1]
    timeouts = [int(t) for t in re.findall(r"timeoutSeconds: (\d+)", probes)]
    assert timeouts and all(t == 1 for t in timeouts) and 1 < DEFAULT_HEALTH_TIMEOUT
    assert f"`MMCACHE_FIX_HEALTH_TIMEOUT` seconds ({DEFAULT_HEALTH_TIMEOUT:g})" in _section(
        "Kubernetes probes"
    )


def test_relative_links_point_at_files() -> None:
    """docs/development.md is the contributor guide beside this one; every other link must
    name a file of this repository."""
    missing = []
    for path in (README, REPO_ROOT / "docs" / "design.md", REPO_ROOT / "docs" / "evidence.md"):
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", path.read_text()):
            if not (path.parent / target).exists():
                missing.append(str((path.parent / target).resolve().relative_to(REPO_ROOT)))
    assert set(missing) <= {"docs/development.md"}, missing


def test_development_keeps_the_test_command() -> None:
    development = _section("Development")
    assert "scripts/run-tests" in development
    assert "docs/development.md" in development
