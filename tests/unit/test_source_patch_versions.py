"""How the source-patch applier reads vLLM's version strings (no release files needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_mmcache_fix.tools import source_patch


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("__version__ = version = '0.23.0+empty'\n", "0.23.0"),
        ("version: str\n__version__ = version = '0.12.0'\n", "0.12.0"),
        ("__version__ = version = '0.24.0.dev5+g0123abc.empty'\n", "0.24.0"),
    ],
)
def test_version_strings(text: str, expected: str, tmp_path: Path) -> None:
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "_version.py").write_text(text)
    version = source_patch.read_vllm_version(tmp_path)
    assert version is not None and source_patch.release_of(version) == expected
