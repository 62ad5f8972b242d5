"""Committed record files and the generated blocks of the documents.

Every resumable program keeps its results in one JSON file under ``compat/`` (read at
start, written after each case, so an interrupted run resumes) and renders a table into a
document between two markers, ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->``; the prose
around a block is written by hand. This module is the one place that reads, writes and
replaces them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def read_json(path: Path) -> Any:
    """The file's JSON value; None when the file is missing or not JSON."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def load_record(path: Path, schema: int, table: str) -> dict[str, Any]:
    """A record file of ``schema`` with its ``table`` (an empty one when the file is missing,
    unreadable or of another schema: the run then starts afresh)."""
    data = read_json(path)
    if not isinstance(data, dict) or data.get("schema") != schema:
        data = {"schema": schema, table: {}}
    data.setdefault(table, {})
    return data


def write_json(path: Path, data: Any, *, indent: int = 1, sort_keys: bool = False) -> None:
    """Write ``data`` whole or not at all (a run stopped mid-write leaves the old file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=indent, sort_keys=sort_keys) + "\n")
    tmp.replace(path)


@dataclass(frozen=True)
class DocBlock:
    """The generated part of a document, between ``<!-- NAME:begin -->`` and its end."""

    name: str

    @property
    def begin(self) -> str:
        return f"<!-- {self.name}:begin -->"

    @property
    def end(self) -> str:
        return f"<!-- {self.name}:end -->"

    def wrap(self, body: str) -> str:
        return f"{self.begin}\n{body}\n{self.end}"

    def find(self, text: str) -> str | None:
        """The block in ``text``, markers included; None when it has none."""
        start, end = text.find(self.begin), text.find(self.end)
        if start < 0 or end < start:
            return None
        return text[start : end + len(self.end)]

    def rewrite(self, path: Path, body: str) -> bool:
        """Put ``body`` in the block of ``path``; True when the file changed."""
        text = path.read_text()
        old = self.find(text)
        if old is None:
            raise SystemExit(f"{path}: no {self.begin} ... {self.end} block")
        new = text.replace(old, self.wrap(body))
        if new == text:
            return False
        path.write_text(new)
        return True
