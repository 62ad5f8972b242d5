"""The committed false-verdict matrix: every healthy-but-slow case ran on a real server at
full length, ``/health`` answered 200 at every poll, and the slow thing was really slow.

The runs are ``scripts/false-verdicts`` (``harness/programs/false_verdicts.py``); this reads
what they recorded, re-derives each verdict from the raw figures and checks the bars."""

from __future__ import annotations

from typing import Any

import pytest

from harness.programs import false_verdicts as fv
from harness.records import read_json

DATA: dict[str, Any] = read_json(fv.RESULTS) or {}
CASES: dict[str, Any] = DATA.get("cases", {})

LENGTH_S = {
    "chunked_prefill": 3 * fv.PROGRESS_TIMEOUT_S,
    "slow_grammar": fv.SLOW_S,
    "remote_kv": fv.SLOW_S,
    "pause": fv.SLOW_S,
    "long_utility": fv.UTILITY_S,
    "saturated": fv.SATURATED_S,
    "idle": fv.IDLE_S,
    "api2": fv.LOAD_S,
    "dp2": fv.LOAD_S,
}
"""How long each case's slow part must have lasted (the matrix's bar)."""


def test_every_case_has_a_bar() -> None:
    assert set(LENGTH_S) == set(fv.CASES)


@pytest.mark.parametrize("key", fv.DEFAULT)
def test_the_case_ran_at_full_length_and_health_stayed_200(key: str) -> None:
    rec = CASES.get(key)
    assert rec is not None, f"run scripts/false-verdicts {key}"
    assert rec["scale"] == 1.0, rec  # a smoke run does not count
    assert rec["progress_timeout_s"] == fv.PROGRESS_TIMEOUT_S == 30
    assert rec["status"] == "pass", rec
    assert rec["ok"] is True and "error" not in rec, rec
    assert rec["non_200"] == 0 and rec["first_non_200_s"] is None, rec
    # Polled once a second for the whole case (a poll can be missed on a loaded machine).
    assert rec["polls"] >= 0.9 * rec["seconds"], rec
    name = key.partition("/")[2]
    assert rec["seconds"] >= LENGTH_S[name], rec


def test_the_slow_parts_were_slow() -> None:
    got = {k.partition("/")[2]: v for k, v in CASES.items() if k.startswith("0.32.0/")}
    assert got["chunked_prefill"]["prefill_s"] >= 3 * fv.PROGRESS_TIMEOUT_S
    assert got["chunked_prefill"]["prompt_tokens"] >= 2500
    assert got["slow_grammar"]["waited_s"] >= fv.SLOW_S
    assert got["remote_kv"]["answered_s"] >= fv.SLOW_S
    assert got["remote_kv"]["statuses"] == [200, 200]
    assert got["pause"]["answered_while_paused"] == 0 and got["pause"]["statuses"] == [200, 200]
    assert got["long_utility"]["utility_s"] >= fv.UTILITY_S
    assert got["long_utility"]["request_behind_it"] == [200]
    saturated = got["saturated"]
    assert saturated["requests"] == saturated["requests_ok"] > fv.SATURATED_CLIENTS
    assert saturated["prompt_tokens_median"] >= 2500
    for name in ("api2", "dp2"):
        assert got[name]["requests"] == got[name]["requests_ok"] > 0


def test_what_this_machine_cannot_run_says_why() -> None:
    assert DATA.get("not_on_cpu") == fv.NOT_ON_CPU
    assert set(fv.NOT_ON_CPU) == {"sleep_wake", "streaming_input"}


def test_every_case_is_described() -> None:
    assert set(fv.WHAT) == set(fv.CASES)


def test_the_doc_table_is_what_the_results_render() -> None:
    block = fv.doc_block(fv.DOC.read_text())
    assert block is not None
    assert block == fv.BLOCK.wrap(fv.render_table(DATA)), "run scripts/false-verdicts --doc"
