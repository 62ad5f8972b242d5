"""The mutation score's bookkeeping (harness/programs/mutation.py) and its committed baseline."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from harness import evidence
from harness.programs import mutation


def _row(line: int, outcome: str | None, diff: str = "") -> list[Any]:
    item = {
        "mutations": [
            {"operator_name": "core/NumberReplacer", "occurrence": line, "start_pos": [line, 4]}
        ]
    }
    result = None if outcome is None else {"test_outcome": outcome, "diff": diff}
    return [item, result]


def test_the_score_counts_killed_over_judged_less_equivalent() -> None:
    rows = [
        _row(1, "killed"),
        _row(2, "killed"),
        _row(3, "survived", "--- a\n+++ b\n-    x = 1\n+    x = 2\n"),
        _row(4, "survived"),
        _row(5, "incompetent"),
        _row(6, None),
    ]
    equivalent = {"core/NumberReplacer@3:4#3": "the value is never read"}
    got = mutation.summarize("f.py", "c" * 40, rows, equivalent)
    assert (got["killed"], got["survived"], got["incompetent"], got["pending"]) == (2, 2, 1, 1)
    assert got["equivalent"] == 1
    assert got["score"] == pytest.approx(2 / 3, abs=1e-4)
    first, second = got["survivors"]
    assert first["diff"] == "-    x = 1\n+    x = 2" and first["equivalent"]
    assert second["equivalent"] is None
    assert mutation.summarize("f.py", "c", [_row(1, None)], {})["score"] is None


def test_the_committed_baseline_is_consistent() -> None:
    if not mutation.RESULTS.exists():
        pytest.skip("no baseline committed")
    data = json.loads(mutation.RESULTS.read_text())
    targets = {t.path for t in mutation.TARGETS}
    assert set(data["files"]) <= targets
    for path, got in data["files"].items():
        assert re.fullmatch(r"[0-9a-f]{40}", evidence.full_commit(got["commit"])), path
        judged = got["killed"] + got["survived"] - got["equivalent"]
        if judged:
            assert got["score"] == pytest.approx(got["killed"] / judged, abs=1e-4), path
        assert len(got["survivors"]) == got["survived"], path
        whys = data["equivalent"].get(path, {})
        assert all(len(why) > 15 for why in whys.values()), path
