"""A unified-diff applier in Python, for images without ``patch(1)``."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from .outcome import PatchError

# --------------------------------------------------------------------------- diffs in Python


@dataclass
class _Hunk:
    old_start: int
    new_start: int
    old_lines: list[str] = field(default_factory=list)
    new_lines: list[str] = field(default_factory=list)


_HUNK_HEADER = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def parse_unified_diff(diff_text: str) -> tuple[str, list[_Hunk]]:
    """(path after ``b/``, hunks) of a single-file unified diff."""
    lines = diff_text.splitlines(keepends=True)
    target: str | None = None
    hunks: list[_Hunk] = []
    index = 0
    while index < len(lines):
        line = lines[index]
        if line.startswith("+++ ") and target is None:
            name = line[4:].rstrip("\n").split("\t", 1)[0]
            target = name[2:] if name.startswith("b/") else name
            index += 1
            continue
        match = _HUNK_HEADER.match(line)
        if match and target is not None:
            old_count = int(match.group(2) or "1")
            new_count = int(match.group(4) or "1")
            hunk = _Hunk(old_start=int(match.group(1)), new_start=int(match.group(3)))
            index += 1
            while (old_count > 0 or new_count > 0) and index < len(lines):
                body = lines[index]
                tag, text = body[:1], body[1:]
                if tag == " ":
                    hunk.old_lines.append(text)
                    hunk.new_lines.append(text)
                    old_count -= 1
                    new_count -= 1
                elif tag == "-":
                    hunk.old_lines.append(text)
                    old_count -= 1
                elif tag == "+":
                    hunk.new_lines.append(text)
                    new_count -= 1
                elif tag == "\\":
                    pass
                else:
                    raise PatchError(f"malformed hunk line: {body!r}")
                index += 1
            if old_count or new_count:
                raise PatchError("truncated hunk")
            hunks.append(hunk)
            continue
        index += 1
    if target is None or not hunks:
        raise PatchError("not a unified diff")
    return target, hunks


def apply_unified_diff(text: str, diff_text: str, *, reverse: bool = False) -> str:
    """Apply a single-file diff exactly (context must match; offsets allowed, no fuzz)."""
    _, hunks = parse_unified_diff(diff_text)
    lines = text.splitlines(keepends=True)
    out: list[str] = []
    cursor = 0
    offset = 0
    for number, hunk in enumerate(hunks, 1):
        if reverse:
            old, new, start = hunk.new_lines, hunk.old_lines, hunk.new_start
        else:
            old, new, start = hunk.old_lines, hunk.new_lines, hunk.old_start
        # A hunk without old lines inserts after line ``start``; others begin at it.
        anchor = start - 1 if old else start
        position = _find_block(lines, old, anchor + offset, cursor)
        if position is None:
            raise PatchError(f"hunk #{number} does not match")
        offset = position - anchor
        out.extend(lines[cursor:position])
        out.extend(new)
        cursor = position + len(old)
    out.extend(lines[cursor:])
    return "".join(out)


def _find_block(lines: list[str], block: list[str], expected: int, lower: int) -> int | None:
    size = len(block)
    limit = len(lines) - size
    for distance in range(0, len(lines) + 1):
        for position in (expected - distance, expected + distance):
            if lower <= position <= limit and lines[position : position + size] == block:
                return position
        if expected - distance < lower and expected + distance > limit:
            break
    return None
