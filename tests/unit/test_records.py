"""Record files and generated document blocks (harness/records.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.records import DocBlock, load_record, write_json


def test_a_block_is_replaced_between_its_markers_and_the_prose_kept(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    block = DocBlock("table")
    doc.write_text(f"before\n{block.begin}\nold\n{block.end}\nafter\n")
    assert block.rewrite(doc, "| a |\n| b |")
    assert doc.read_text() == f"before\n{block.begin}\n| a |\n| b |\n{block.end}\nafter\n"
    assert block.find(doc.read_text()) == block.wrap("| a |\n| b |")
    assert not block.rewrite(doc, "| a |\n| b |")  # unchanged: not written again


def test_a_document_without_the_block_is_refused(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text(f"{DocBlock('other').wrap('x')}\n")
    assert DocBlock("table").find(doc.read_text()) is None
    with pytest.raises(SystemExit, match="table:begin"):
        DocBlock("table").rewrite(doc, "y")


def test_a_record_of_another_schema_starts_afresh(tmp_path: Path) -> None:
    path = tmp_path / "compat" / "r.json"
    write_json(path, {"schema": 1, "rows": {"a": 1}})
    assert load_record(path, 1, "rows") == {"schema": 1, "rows": {"a": 1}}
    assert load_record(path, 2, "rows") == {"schema": 2, "rows": {}}
    path.write_text("{not json")
    assert load_record(path, 1, "rows") == {"schema": 1, "rows": {}}
    assert load_record(tmp_path / "missing.json", 1, "rows") == {"schema": 1, "rows": {}}


def test_write_json_leaves_one_whole_file(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "r.json"
    write_json(path, {"b": 1, "a": [1, 2]}, sort_keys=True)
    assert path.read_text() == json.dumps({"a": [1, 2], "b": 1}, indent=1) + "\n"
    assert [p.name for p in path.parent.iterdir()] == ["r.json"]
