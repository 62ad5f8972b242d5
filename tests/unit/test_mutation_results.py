"""The mutation score's bookkeeping (harness/programs/mutation.py) and its committed baseline."""

from __future__ import annotations

import json
import re
import sqlite3
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


def _session(path: Any, items: int, done: int) -> list[str]:
    ids = [f"job{n:02d}" for n in range(items)]
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE work_items (job_id VARCHAR NOT NULL, PRIMARY KEY (job_id))")
        db.execute(
            "CREATE TABLE work_results (worker_outcome VARCHAR(9), output TEXT, "
            "test_outcome VARCHAR(11), diff TEXT, job_id VARCHAR NOT NULL, "
            "PRIMARY KEY (job_id))"
        )
        db.executemany("INSERT INTO work_items VALUES (?)", [(i,) for i in ids])
        db.executemany(
            "INSERT INTO work_results VALUES ('NORMAL', '', 'KILLED', '', ?)",
            [(i,) for i in ids[:done]],
        )
    return ids


def _pending(path: Any) -> set[str]:
    with sqlite3.connect(path) as db:
        return {
            row[0]
            for row in db.execute(
                "SELECT job_id FROM work_items WHERE job_id NOT IN "
                "(SELECT job_id FROM work_results)"
            )
        }


def test_shards_deal_out_the_pending_mutants_and_merge_back_what_ran(tmp_path: Any) -> None:
    session = tmp_path / "f.sqlite"
    ids = _session(session, 11, done=2)
    src = tmp_path / "src"
    src.mkdir()
    (src / "pyproject.toml").write_text("")
    shards = mutation.make_shards(session, src, 3)
    assert [tree.name for tree, _ in shards] == ["src", "src-1", "src-2"]
    assert (tmp_path / "src-2" / "pyproject.toml").exists()
    shares = [_pending(db) for _, db in shards]
    assert set().union(*shares) == set(ids[2:])  # every pending mutant is in a shard ...
    assert sum(len(s) for s in shares) == 9  # ... in one only
    assert all(len(s) == 3 for s in shares)
    # Shard 1 ran one of its mutants and was stopped; shard 2 ran two.
    ran = sorted(shares[1])[:1] + sorted(shares[2])[:2]
    for (_, db), jobs in ((shards[1], ran[:1]), (shards[2], ran[1:])):
        with sqlite3.connect(db) as con:
            con.executemany(
                "INSERT INTO work_results VALUES ('NORMAL', 'x', 'SURVIVED', 'd', ?)",
                [(j,) for j in jobs],
            )
    assert mutation.merge_shards(session) == 3
    assert not list(tmp_path.glob("f.shard-*.sqlite"))
    assert _pending(session) == set(ids[2:]) - set(ran)
    with sqlite3.connect(session) as con:
        outputs = {row[0] for row in con.execute("SELECT output FROM work_results")}
    assert mutation.OTHER_SHARD not in outputs
    assert mutation.merge_shards(session) == 0
