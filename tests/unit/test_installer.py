"""The harness installs with uv when it is there, with pip otherwise, and passes pip's links."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness import installer


def test_a_named_uv_installs_with_bytecode_and_pips_find_links(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    uv = tmp_path / "uv"
    uv.write_text("")
    monkeypatch.setenv("MMCACHE_HARNESS_UV", str(uv))
    monkeypatch.setenv("PIP_FIND_LINKS", "/opt/a /opt/b")
    monkeypatch.setenv("MMCACHE_HARNESS_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("UV_CACHE_DIR", raising=False)
    argv, env = installer.install_command(Path("/v/bin/python"), "-q", "torch==2.0")
    assert argv[:5] == [str(uv), "pip", "install", "--python", "/v/bin/python"]
    assert "--compile-bytecode" in argv
    assert argv[-2:] == ["-q", "torch==2.0"]
    assert argv[argv.index("/opt/a") - 1] == "--find-links" and "/opt/b" in argv
    assert env["UV_CACHE_DIR"] == str(tmp_path / "cache" / "uv")


def test_a_named_uv_that_is_not_there_means_pip(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MMCACHE_HARNESS_UV", str(tmp_path / "missing"))
    argv, _env = installer.install_command(Path("/v/bin/python"), "x")
    assert argv[:4] == ["/v/bin/python", "-m", "pip", "install"] and argv[-1] == "x"
