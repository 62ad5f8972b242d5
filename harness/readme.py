"""The README's deployment-guide blocks, for the tests that run them."""

from __future__ import annotations

import re

from harness.paths import REPO_ROOT

README = REPO_ROOT / "README.md"
BLOCK = re.compile(r"<!-- guide:(?P<name>[\w-]+) -->\s*```(?P<lang>\w+)\n(?P<body>.*?)```", re.S)


def guide_blocks() -> dict[str, tuple[str, str]]:
    """name -> (language, body) for each ``<!-- guide:NAME -->`` block."""
    return {m["name"]: (m["lang"], m["body"]) for m in BLOCK.finditer(README.read_text())}
