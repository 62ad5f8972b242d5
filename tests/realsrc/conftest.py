"""Fixtures of the realsrc tier."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from harness import realsrc


@pytest.fixture
def lru_source() -> Callable[[str], Path]:
    """Path of the real released ``vllm/utils/cache.py`` of a version (0.11.1+)."""

    def get(version: str) -> Path:
        path = realsrc.source_root(version) / "vllm" / "utils" / "cache.py"
        assert path.is_file(), f"{path} missing"
        return path

    return get
