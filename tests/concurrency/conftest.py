"""Fixtures of the concurrency tier."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from harness import children as child_procs

BURN = "while True:\n    pass\n"


@pytest.fixture
def cpu_contention(children: child_procs.Children) -> Iterator[None]:
    """A CPU-bound process competing with the test's threads for the whole test."""
    proc = children.start(BURN)
    assert proc.poll() is None
    yield
    assert proc.poll() is None  # it competed until the end
