"""Net progress on vLLM's real scheduler: a saturated engine whose every request finishes
within its step makes progress at every step (:mod:`tests.installed.progress_saturated`).

With the count of the scheduler's requests after the last step as the only reference, as
many arrivals as finishes in between hid every finish: no step made progress and
``/health`` turned 503 after ``MMCACHE_FIX_PROGRESS_TIMEOUT`` on a healthy engine serving
320 requests a second.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from harness import tiny_models
from harness.programs import vllm_tests
from harness.venvs import e2e_versions, run_result

PROGRAM = Path(__file__).with_name("progress_saturated.py")
STEPS = 100


@pytest.mark.parametrize("version", e2e_versions())
def test_a_saturated_engine_of_one_step_requests_has_no_empty_step(version: str, vllm_venv) -> None:
    venv = vllm_venv(version)
    release = vllm_tests.prepare_release(version)  # vLLM's own test helpers, from its sdist
    model = tiny_models.ensure_model(venv)
    got = run_result(
        venv,
        str(PROGRAM),
        str(release.root),
        str(model),
        str(STEPS),
        env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
    )
    print(got)
    assert got["vllm"] == version and got["internal_errors"] == 0
    # Saturated throughout: every step served 16 requests, three times as many arrived.
    assert got["steps"] == STEPS and got["finished"] == 16 * STEPS
    assert got["waiting"] > 0 and got["running"] == 0
    assert got["empty_steps"] == 0
