"""``vllm-mmcache-fix check`` on real installed vLLM builds.

Without vLLM: ``tests/unit/test_check_without_vllm.py``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from harness.paths import REPO_ROOT as REPO
from harness.venvs import check_report as _check
from harness.venvs import e2e_versions, install_plugin, python, uninstall_plugin

VERSIONS = e2e_versions()


def _ghost_touch(version: str) -> bool:
    return tuple(int(p) for p in version.split(".")[:2]) < (0, 24)


@pytest.mark.parametrize("version", VERSIONS)
def test_verdicts_on_installed_build(
    version: str, plugin_wheel: Path, tmp_path: Path, vllm_venv
) -> None:
    venv = vllm_venv(version)
    py = python(venv)

    uninstall_plugin(venv)
    # The package importable, but not installed (no entry point anywhere).
    shutil.copytree(REPO / "vllm_mmcache_fix", tmp_path / "vllm_mmcache_fix")
    rc, report, elapsed = _check(py, extra_path=str(tmp_path))
    assert report["entry_point_found"] is False
    assert report["exposure"]["touch_creates_ghost"] is _ghost_touch(version)
    assert report["exposure"]["eviction_stalls_on_ghost"] is True
    if _ghost_touch(version):
        assert (rc, report["verdict"]) == (1, "vulnerable"), report
        assert any("--mm-processor-cache-gb 0" in r for r in report["remedies"])
    else:
        assert (rc, report["verdict"]) == (0, "not affected"), report
    # Even without the entry point the patch is tried on this layout.
    assert report["patch_works"] is True, report

    install_plugin(venv, plugin_wheel)
    rc, report, elapsed = _check(py)
    assert (rc, report["verdict"]) == (0, "protected"), report
    assert report["vllm_version"].split("+")[0] == version
    assert report["entry_point_found"] and report["plugin_allowed"]
    assert elapsed < 60, elapsed  # no engine is started

    rc, report, _ = _check(py, env={"VLLM_PLUGINS": "some_other_plugin"})
    assert report["plugin_allowed"] is False
    assert report["verdict"] == ("vulnerable" if _ghost_touch(version) else "not affected")

    rc, report, _ = _check(py, env={"MMCACHE_FIX_MODE": "warn"})
    assert report["verdict"] == ("vulnerable" if _ghost_touch(version) else "not affected")
    assert rc == (1 if _ghost_touch(version) else 0)

    rc, report, _ = _check(py, env={"MMCACHE_FIX_MODE": "bogus"})
    assert (rc, report["verdict"]) == (0, "protected")
    assert any("MMCACHE_FIX_MODE" in p for p in report["problems"])


def test_ascend_filter_is_reported(tmp_path: Path, plugin_wheel: Path, vllm_venv) -> None:
    """With vllm-ascend present, a VLLM_PLUGINS that drops 'ascend' is flagged."""
    venv = vllm_venv(VERSIONS[0])
    install_plugin(venv, plugin_wheel)
    # Metadata of a vllm-ascend install (entry points only) on the path.
    dist = tmp_path / "vllm_ascend-0.23.0rc1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-ascend\nVersion: 0.23.0rc1\n")
    (dist / "entry_points.txt").write_text(
        "[vllm.platform_plugins]\nascend = vllm_ascend:register\n"
    )
    rc, report, _ = _check(
        python(venv), env={"VLLM_PLUGINS": "mmcache_fix"}, extra_path=str(tmp_path)
    )
    assert report["vllm_ascend_version"] == "0.23.0rc1"
    assert report["ascend_allowed"] is False
    assert any("Ascend NPU platform" in p for p in report["problems"])
    rc, report, _ = _check(
        python(venv), env={"VLLM_PLUGINS": "ascend,mmcache_fix"}, extra_path=str(tmp_path)
    )
    assert report["ascend_allowed"] is True and report["verdict"] == "protected"
