"""The pooling-memory figures in docs/design.md are those of the committed run, which passed.

``scripts/pooling-memory`` (harness/programs/pooling_memory.py) writes
``compat/pooling_memory.json``; docs/design.md quotes its 1,000-request run on 0.32.0.
"""

from __future__ import annotations

import json
import re

from harness.paths import REPO_ROOT

RESULTS = REPO_ROOT / "compat" / "pooling_memory.json"
KEY = "0.32.0/1000"
SLACK_MIB = 8.0


def _signed(value: float) -> str:
    return f"{value:+.1f}"


def test_committed_run_passed() -> None:
    entry = json.loads(RESULTS.read_text())[KEY]
    for state in ("with", "without"):
        assert entry[state]["all_ok"], entry[state]["statuses"]
        assert entry[state]["requests"] == 1000
    assert entry["with"]["growth_mb"] <= max(entry["without"]["growth_mb"], 0.0) + SLACK_MIB


def test_the_design_doc_quotes_the_committed_run() -> None:
    entry = json.loads(RESULTS.read_text())[KEY]
    text = " ".join((REPO_ROOT / "docs" / "design.md").read_text().split())
    found = re.search(
        r"API server memory ([+-][\d.]+) MiB with the plugin, ([+-][\d.]+) MiB without", text
    )
    assert found, "docs/design.md: the pooling-memory sentence is missing"
    assert found.group(1) == _signed(entry["with"]["growth_mb"])
    assert found.group(2) == _signed(entry["without"]["growth_mb"])
