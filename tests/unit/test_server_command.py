"""The harness's ``vllm serve`` command: the multimodal profile skipped only when asked,
and only on releases whose argument parser has ``--skip-mm-profiling``."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness import server


@pytest.mark.parametrize(
    ("value", "version", "skips"),
    [
        ("1", "0.23.0", True),
        ("1", "0.32.0", True),
        ("1", "0.10.1.1", True),
        ("1", "0.10.0", False),  # 0.10.0's parser has no such flag: vLLM would refuse it
        ("1", "?", False),
        ("", "0.23.0", False),
        ("0", "0.23.0", False),
        ("yes", "0.23.0", False),
    ],
)
def test_skips_mm_profiling(
    monkeypatch: pytest.MonkeyPatch, value: str, version: str, skips: bool
) -> None:
    monkeypatch.setenv(server.SKIP_MM_PROFILING_ENV, value)
    assert server.skips_mm_profiling(version) is skips


def test_the_flag_reaches_the_command_only_when_set(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr("harness.venvs.venv_vllm_version", lambda venv: "0.23.0")
    monkeypatch.delenv(server.SKIP_MM_PROFILING_ENV, raising=False)
    plain = server.server_command(tmp_path, tmp_path / "m", 8000, ["--seed", "1"])
    assert "--skip-mm-profiling" not in plain
    monkeypatch.setenv(server.SKIP_MM_PROFILING_ENV, "1")
    fast = server.server_command(tmp_path, tmp_path / "m", 8000, ["--seed", "1"])
    assert fast[: len(plain) - 2] == plain[:-2]
    assert fast[-3:] == ["--skip-mm-profiling", "--seed", "1"]  # the caller's arguments last
