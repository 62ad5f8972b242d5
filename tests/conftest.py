"""Shared pytest configuration and fixtures."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))


@pytest.fixture
def lru_source() -> Callable[[str], Path]:
    """Path of the real released ``vllm/utils/cache.py`` of a version (0.11.1+)."""
    import realsrc

    def get(version: str) -> Path:
        path = realsrc.source_root(version) / "vllm" / "utils" / "cache.py"
        assert path.is_file(), f"{path} missing"
        return path

    return get


@pytest.fixture(autouse=True)
def _revert_patches() -> Iterator[None]:
    """Whatever a test patched in this process is undone after it."""
    yield
    if "vllm_mmcache_fix.plugin" in sys.modules:
        sys.modules["vllm_mmcache_fix.plugin"].uninstrument()


@pytest.fixture(scope="session")
def plugin_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wheel of this checkout, built once per session."""
    from venvs import build_wheel

    return build_wheel(tmp_path_factory.mktemp("wheel"))
