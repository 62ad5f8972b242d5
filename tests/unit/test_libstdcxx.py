"""The newer ``libstdc++`` the harness gives releases built with a newer GCC (0.10.2, 0.11.2)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from harness.libstdcxx import SYSTEM_LIBSTDCXX, missing_versions, weaken_version_need

needs_system_lib = pytest.mark.skipif(
    not SYSTEM_LIBSTDCXX.exists() or shutil.which("readelf") is None,
    reason="needs the system libstdc++ and readelf",
)


def _flags(path: Path, version: str) -> str:
    out = subprocess.run(["readelf", "-V", str(path)], capture_output=True, text=True).stdout
    return next(line for line in out.splitlines() if f"Name: {version} " in line)


@needs_system_lib
def test_weakening_marks_only_that_version_need(tmp_path: Path) -> None:
    lib = tmp_path / "libstdc++.so.6"
    shutil.copy(SYSTEM_LIBSTDCXX.resolve(), lib)
    assert "Flags: none" in _flags(lib, "GLIBC_2.34")
    assert weaken_version_need(lib, b"GLIBC_2.34") is True
    assert "Flags: WEAK" in _flags(lib, "GLIBC_2.34")
    assert "Flags: none" in _flags(lib, "GLIBC_2.2.5")
    assert weaken_version_need(lib, b"GLIBC_9.99") is False


def test_weakening_refuses_a_file_that_is_not_elf64(tmp_path: Path) -> None:
    path = tmp_path / "x.so"
    path.write_bytes(b"not an ELF file at all" * 4)
    with pytest.raises(ValueError, match="not an ELF64"):
        weaken_version_need(path, b"GLIBC_2.38")


@needs_system_lib
def test_missing_versions_are_those_the_system_library_lacks(tmp_path: Path) -> None:
    pkg = tmp_path / "lib" / "python3.11" / "site-packages" / "vllm"
    pkg.mkdir(parents=True)
    (pkg / "_C.abi3.so").write_bytes(b"\x00GLIBCXX_3.4.32\x00CXXABI_1.3.15\x00GLIBCXX_3.4.11\x00")
    assert missing_versions(tmp_path) == {"GLIBCXX_3.4.32", "CXXABI_1.3.15"}
    (pkg / "_C.abi3.so").write_bytes(b"\x00GLIBCXX_3.4.11\x00CXXABI_1.3\x00")
    assert missing_versions(tmp_path) == set()
