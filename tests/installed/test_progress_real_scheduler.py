"""Net progress on vLLM's real scheduler: a saturated engine whose every request finishes
within its step makes progress at every step (:mod:`tests.installed.progress_saturated`).

With the count of the scheduler's requests after the last step as the only reference, as
many arrivals as finishes in between hid every finish: no step made progress and
``/health`` turned 503 after ``MMCACHE_FIX_PROGRESS_TIMEOUT`` on a healthy engine serving
320 requests a second.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from harness import tiny_models
from harness.paths import REPO_ROOT
from harness.programs import vllm_tests
from harness.venvs import e2e_versions, python

PROGRAM = Path(__file__).with_name("progress_saturated.py")
STEPS = 100


@pytest.mark.parametrize("version", e2e_versions())
def test_a_saturated_engine_of_one_step_requests_has_no_empty_step(version: str, vllm_venv) -> None:
    venv = vllm_venv(version)
    release = vllm_tests.prepare_release(version)  # vLLM's own test helpers, from its sdist
    model = tiny_models.ensure_model(venv)
    proc = subprocess.run(
        [python(venv), str(PROGRAM), str(release.root), str(model), str(STEPS)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=str(REPO_ROOT),
        env={
            "VLLM_TARGET_DEVICE": "cpu",
            "PATH": "/usr/bin:/bin",
            "HOME": str(Path.home()),
            "PYTHONPATH": str(REPO_ROOT),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
        },
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, proc.stderr[-3000:]
    got = json.loads(lines[-1][len("RESULT ") :])
    print(got)
    assert got["vllm"] == version and got["internal_errors"] == 0
    # Saturated throughout: every step served 16 requests, three times as many arrived.
    assert got["steps"] == STEPS and got["finished"] == 16 * STEPS
    assert got["waiting"] > 0 and got["running"] == 0
    assert got["empty_steps"] == 0
