"""The session's last check on every server log it wrote (``tests/conftest.py``): the plugin
lines no healthy run may print."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness import logscan, paths
from vllm_mmcache_fix.core import messages

P = messages.PREFIX


def test_check_off_and_internal_errors_are_trouble_injected_faults_are_not(
    tmp_path: Path,
) -> None:
    off = (
        f"(APIServer pid=7) WARNING 12-07 00:13:23 [log.py:36] {P}{messages.ENGINE_CHECK_OFF} "
        "EngineCore in MainProcess pid=7: it said its input thread answers"
    )
    real = (
        f"(EngineCore pid=8) WARNING 12-07 00:15:27 [log.py:45] {P}{messages.INTERNAL_ERROR} "
        "in stall-sentinel (sentinel.sample): KeyError('x'); this part of the plugin is off"
    )
    injected = (
        f"(APIServer pid=7) WARNING 12-07 00:15:27 [log.py:45] {P}{messages.INTERNAL_ERROR} "
        "in mm-lru-eviction (lru.cache_built): InjectedFault('fault injected at lru.cache_built')"
    )
    calm = [
        f"(APIServer pid=7) INFO 12-07 00:13:23 [log.py:32] {P}engine liveness on /health",
        "(APIServer pid=7) WARNING 12-07 00:13:23 [api.py:1] internal error of vLLM's own",
    ]
    log = tmp_path / "server.log"
    log.write_text("\n".join([off, *calm, injected, real]) + "\n")
    assert logscan.plugin_trouble(log) == [off, real]
    quiet = tmp_path / "quiet.log"
    quiet.write_text("\n".join([*calm, injected]) + "\n")
    assert logscan.plugin_trouble(quiet) == []


def test_every_log_name_given_is_remembered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(paths.CACHE_ENV, str(tmp_path))
    before = len(paths.CREATED_LOGS)
    path = paths.log_path("e2e-0.32.0-plugin")
    assert paths.CREATED_LOGS[before:] == [path] and path.parent == tmp_path / "logs"
    paths.CREATED_LOGS.remove(path)
