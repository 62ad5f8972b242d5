"""The unit tier is offline by construction: every test gets an empty cache root.

``$MMCACHE_HARNESS_CACHE`` points at a fresh directory and ``$MMCACHE_HARNESS_OFFLINE`` is set,
so a test that reached for released sources, a venv or the tiny model would fail
here instead of quietly using (or downloading) them.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _offline(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> Iterator[None]:
    monkeypatch.setenv("MMCACHE_HARNESS_CACHE", str(tmp_path_factory.mktemp("empty-cache")))
    monkeypatch.setenv("MMCACHE_HARNESS_OFFLINE", "1")
    yield
