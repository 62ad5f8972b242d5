"""One convention for every command: the exit-code table, ``--json`` (errors included),
verdict names, ``--version``, and the version shown wherever the plugin speaks.

``check`` and ``diagnose`` run here as an operator runs them (``python -m
vllm_mmcache_fix ...`` in a subprocess), in this Python, which has no vLLM.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import vllm_mmcache_fix
from harness.paths import REPO_ROOT
from vllm_mmcache_fix.tools import exits
from vllm_mmcache_fix.tools.check import Verdict as CheckVerdict
from vllm_mmcache_fix.tools.diagnose import Classification
from vllm_mmcache_fix.tools.source_patch import Verdict as PatchVerdict
from vllm_mmcache_fix.tools.status import Verdict as StatusVerdict

VERSION = vllm_mmcache_fix.__version__
ENVELOPE = {"schema_version", "tool_version", "command", "verdict", "exit_code"}


def cli(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None):
    full = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("VLLM_", "MMCACHE_FIX_", "MMCACHE_HARNESS_"))
    }
    full["PYTHONPATH"] = str(REPO_ROOT)
    full.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "vllm_mmcache_fix", *args],
        capture_output=True,
        text=True,
        env=full,
        timeout=120,
        cwd=str(cwd or REPO_ROOT),
        check=False,
    )


def as_json(done: subprocess.CompletedProcess[str]) -> dict:
    data = json.loads(done.stdout)
    assert ENVELOPE <= set(data), data
    assert data["schema_version"] == exits.JSON_SCHEMA_VERSION
    assert data["tool_version"] == VERSION
    assert data["exit_code"] == done.returncode == exits.exit_code(data["verdict"]), data
    return data


# --------------------------------------------------------------------------- the table


def test_every_command_prints_verdicts_of_the_one_vocabulary() -> None:
    assert CheckVerdict is PatchVerdict is StatusVerdict is Classification is exits.Verdict
    for verdict in exits.Verdict:
        assert re.fullmatch(r"[a-z][a-z0-9_]*", verdict.value), verdict
        assert str(verdict) == f"{verdict}" == verdict.value
        assert exits.VERDICTS[verdict.value] is verdict.code
        assert exits.exit_code(verdict.value) == verdict.code.code
        if verdict is not exits.Verdict.USAGE:
            assert verdict.code is not exits.USAGE, verdict
    assert list(exits.VERDICTS) == [v.value for v in exits.Verdict]
    # every exit code but usage's is some verdict's
    assert {v.code for v in exits.Verdict} == set(exits.CODES)


def test_each_exit_code_means_one_thing() -> None:
    codes = [c.code for c in exits.CODES]
    assert codes == sorted(set(codes)) and codes[:3] == [0, 1, 2]
    assert len({c.name for c in exits.CODES}) == len(exits.CODES)
    for verdict, code in exits.VERDICTS.items():
        assert code in exits.CODES
        if code is not exits.OK:
            # a failing code is named after the one verdict that gives it
            assert [v for v, c in exits.VERDICTS.items() if c is code and v != "unpatched"] == [
                code.name
            ] or verdict == "unpatched", verdict
    # "no vLLM" is no longer argparse's 2, and means the same in check and patch.
    assert exits.exit_code("no_vllm") not in (exits.USAGE.code, exits.ERROR.code)


def test_version() -> None:
    done = cli("--version")
    assert done.returncode == 0
    assert done.stdout.strip() == f"vllm-mmcache-fix {VERSION}"


@pytest.mark.parametrize(
    "args",
    [
        ["diagnose", "--json"],
        ["check", "--json", "--bogus"],
        ["patch", "bogus-action", "--json"],
        ["status", "--json"],
    ],
)
def test_usage_errors_are_exit_2_and_json_when_asked(args: list[str]) -> None:
    done = cli(*args)
    assert done.returncode == 2, done.stderr
    data = as_json(done)
    assert data["verdict"] == "usage" and data["error"]
    assert data["command"] == args[0]


def test_usage_error_without_json_is_argparse_text() -> None:
    done = cli("diagnose")
    assert done.returncode == 2
    assert done.stdout == "" and "required: --pid" in done.stderr


# --------------------------------------------------------------------------- check


def test_check_without_vllm() -> None:
    done = cli("check", "--json", cwd=Path("/"))
    data = as_json(done)
    assert data["verdict"] == "no_vllm" and done.returncode == exits.NO_VLLM.code
    assert data["command"] == "check"
    assert data["remedy"]
    text = cli("check", cwd=Path("/"))
    assert text.returncode == exits.NO_VLLM.code
    assert re.match(rf"vllm-mmcache-fix +{re.escape(VERSION)} ", text.stdout), text.stdout
    assert text.stdout.splitlines()[-1].startswith("verdict: no_vllm (exit 5)")


def test_check_reports_and_flags_every_setting() -> None:
    bad = {
        "MMCACHE_FIX_HEALTH_TIMEOUT": "30s",
        "MMCACHE_FIX_STALL_SECONDS": "-3",
        "MMCACHE_FIX_DRIFT": "maybe",
        "MMCACHE_FIX_MODE": "ON",  # case does not matter: valid
        "MMCACHE_FIX_STALL_SECOND": "3",  # a typo
    }
    data = as_json(cli("check", "--json", env=bad, cwd=Path("/")))
    rows = {row["name"]: row for row in data["settings"]}
    from vllm_mmcache_fix import plugin
    from vllm_mmcache_fix.core.settings import DEFAULT_HEALTH_TIMEOUT

    assert [s.name for s in plugin.settings()] == [
        r["name"] for r in data["settings"] if r["known"]
    ]
    assert rows["MMCACHE_FIX_HEALTH_TIMEOUT"]["effective"] == DEFAULT_HEALTH_TIMEOUT
    assert rows["MMCACHE_FIX_HEALTH_TIMEOUT"]["raw"] == "30s"
    for name in ("MMCACHE_FIX_HEALTH_TIMEOUT", "MMCACHE_FIX_STALL_SECONDS", "MMCACHE_FIX_DRIFT"):
        assert rows[name]["problem"] and name in rows[name]["problem"], rows[name]
        assert any(name in p for p in data["problems"]), data["problems"]
    assert rows["MMCACHE_FIX_MODE"]["problem"] is None
    assert rows["MMCACHE_FIX_MODE"]["effective"] == "on"
    assert rows["MMCACHE_FIX_STALL_SECOND"]["known"] is False
    assert "not a setting" in rows["MMCACHE_FIX_STALL_SECOND"]["problem"]
    assert rows["MMCACHE_FIX_FAIL_AT"]["problem"] is None
    injected = as_json(cli("check", "--json", env={"MMCACHE_FIX_FAIL_AT": "*"}, cwd=Path("/")))
    assert any("fail on purpose" in p for p in injected["problems"])


BROKEN_VLLM = """\
raise ImportError(
    "libcudart.so.12: cannot open shared object file: No such file or directory"
)
"""


def _broken_vllm(tmp_path: Path) -> Path:
    """A vLLM whose import fails the way a half-installed image's does."""
    site = tmp_path / "site"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text(BROKEN_VLLM)
    info = site / "vllm-0.32.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0\n")
    return site


def test_check_when_vllm_does_not_import(tmp_path: Path) -> None:
    site = _broken_vllm(tmp_path)
    env = {"PYTHONPATH": f"{REPO_ROOT}{os.pathsep}{site}"}
    done = cli("check", "--json", env=env, cwd=Path("/"))
    assert done.returncode == exits.VLLM_IMPORT_FAILED.code, done.stdout + done.stderr
    data = as_json(done)
    assert data["verdict"] == "vllm_import_failed"
    assert data["vllm_import_error"] == (
        "ImportError: libcudart.so.12: cannot open shared object file: No such file or directory"
    )
    assert data["vllm_version"] == "0.32.0"
    assert any("libcudart" in line for line in data["vllm_import_traceback"])
    assert data["settings"] and data["remedy"]
    text = cli("check", env=env, cwd=Path("/"))
    assert text.returncode == exits.VLLM_IMPORT_FAILED.code
    assert "libcudart.so.12" in text.stdout
    assert "Traceback" not in text.stderr  # reported, not crashed
    assert text.stdout.splitlines()[-1].startswith("verdict: vllm_import_failed (exit 6)")


def test_an_unexpected_failure_is_still_one_json_answer(tmp_path: Path) -> None:
    """A bug in the tool itself: exit 1 and a JSON object, not a traceback on stdout."""
    site = tmp_path / "site"
    (site / "sitecustomize.py").parent.mkdir(parents=True)
    # metadata.distributions() raising stands for any bug inside the check.
    (site / "sitecustomize.py").write_text(
        "import importlib.metadata as m\n"
        "def boom(*a, **k):\n    raise RuntimeError('metadata broken')\n"
        "m.distributions = boom\n"
    )
    env = {"PYTHONPATH": f"{site}{os.pathsep}{REPO_ROOT}"}
    done = cli("check", "--json", env=env, cwd=Path("/"))
    data = as_json(done)
    assert data["verdict"] == "error" and done.returncode == 1
    assert "metadata broken" in data["error"]


# --------------------------------------------------------------------------- diagnose


def test_diagnose_errors_are_json_too() -> None:
    from harness.children import dead_pid

    pid = dead_pid()
    if pid is None:
        pytest.skip("PID reused at once")
    done = cli("diagnose", "--pid", str(pid), "--json")
    data = as_json(done)
    assert data["verdict"] == "error" and f"no process with PID {pid}" in data["error"]


def test_diagnose_leaves_itself_out() -> None:
    """Asked about its own parent (as ``diagnose --pid 1`` inside a container is), the
    diagnosis does not list itself among the server's processes."""
    done = cli("diagnose", "--pid", str(os.getpid()), "--interval", "0.3", "--no-py-spy", "--json")
    data = as_json(done)
    pids = [p["pid"] for p in data["processes"]]
    assert pids[0] == os.getpid()
    assert len(data["left_out"]) == 1, data["left_out"]
    assert data["left_out"][0] not in pids
    cmdlines = " ".join(p["cmdline"] for p in data["processes"])
    assert "vllm_mmcache_fix diagnose" not in cmdlines
    assert any("left out" in note for note in data["notes"])


def test_diagnose_text_has_a_legend() -> None:
    done = cli("diagnose", "--pid", str(os.getpid()), "--interval", "0.3", "--no-py-spy")
    assert done.returncode == 0, done.stderr
    first = done.stdout.splitlines()[0]
    assert first in (f"PID {os.getpid()}: idle", f"PID {os.getpid()}: active"), first
    legend = done.stdout[done.stdout.index("Legend:") :]
    for term in ("SPIN", "BLOCKED", "runnable", "vol", "nonvol", "states", "R running"):
        assert term in legend, term
