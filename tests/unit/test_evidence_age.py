"""The committed evidence says its age: every record names its plugin commit, the newest
record of each release is at most ``MAX_AGE_DAYS`` older than the last change to the code
it proves, and
docs/evidence.md shows each release's newest date and commit."""

from __future__ import annotations

import re

import pytest

from harness import evidence


def test_every_record_names_a_commit_of_this_history() -> None:
    recs = list(evidence.records())
    assert len(recs) > 40
    files = {r.file for r in recs}
    assert files == set(evidence.PROVES)
    for rec in recs:
        assert rec.commit, f"{rec.file} {rec.key}: no plugin commit"
        assert re.fullmatch(r"[0-9a-f]{40}", evidence.full_commit(rec.commit)), rec
        assert rec.date is None or re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d", rec.date), rec


def test_no_release_s_newest_record_is_older_than_the_bound() -> None:
    problems = evidence.stale(list(evidence.records()))
    assert not problems, "\n".join(problems) + (
        "\nrun the program that writes the file again on this commit (harness/evidence.py)"
    )


def test_the_bound_catches_an_old_record() -> None:
    first = evidence._git("rev-list", "--max-parents=0", "HEAD").split()[0]
    old = evidence.Record("matrix.json", "0.23.0", "0.23.0", first, None)
    assert evidence.age(first, evidence.PROVES["matrix.json"]) > 0
    behind = evidence.days_behind(old)
    assert behind > 0
    assert evidence.stale([old], bound=behind) == []
    (problem,) = evidence.stale([old], bound=behind - 0.01)
    assert problem.startswith("matrix.json 0.23.0: newest record ran") and "at most" in problem
    # The record's own date counts when it has one: a run long after its commit is fresh.
    changed = evidence.last_change(first, evidence.PROVES["matrix.json"])
    assert changed is not None
    later = evidence.Record(
        "matrix.json", "0.23.0", "0.23.0", first, changed.strftime("%Y-%m-%d %H:%M")
    )
    assert evidence.days_behind(later) < 1 / 1440
    # A newer record of the same release is what counts.
    head = evidence._git("rev-parse", "HEAD")
    assert evidence.stale([old, evidence.Record("matrix.json", "x", "0.23.0", head, None)]) == []


def test_the_docs_table_is_what_the_records_render() -> None:
    text = evidence.DOC.read_text()
    block = evidence.doc_block(text)
    assert block is not None, "docs/evidence.md has no evidence-age block"
    assert block == evidence.render(list(evidence.records())), (
        "run python -m harness evidence --write"
    )


@pytest.mark.parametrize("file", sorted(evidence.PROVES))
def test_what_each_file_proves_exists(file: str) -> None:
    for path in evidence.PROVES[file]:
        assert (evidence.REPO_ROOT / path).exists(), path
