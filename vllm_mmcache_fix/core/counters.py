"""Plain counters any part of the plugin can bump, in any process (no imports, no vLLM).

They travel to the API server's ``/metrics`` with the rest of the process's counts
(:func:`vllm_mmcache_fix.plugin.counts`): in EngineCore with each answer to the API server's
heartbeat, in the API server directly.
"""

from __future__ import annotations

import threading

STALL_CACHE_EVICTION = "cache_eviction"
"""A stall inside the multimodal cache's eviction (vllm#43941): what the alert is for."""
STALL_BUSY = "busy"
"""A thread busy in one call elsewhere (a long tokenization, a CPU forward pass)."""
STALL_CAUSES = (STALL_CACHE_EVICTION, STALL_BUSY)

_lock = threading.Lock()
_stalls: dict[str, int] = dict.fromkeys(STALL_CAUSES, 0)


def count_stall(cause: str, n: int = 1) -> None:
    """One stall seen by the stall sentinel in this process (``mmcache_fix_stalls_total``)."""
    with _lock:
        _stalls[cause] = _stalls.get(cause, 0) + n


def stalls(cause: str) -> int:
    with _lock:
        return _stalls.get(cause, 0)


def reset() -> None:
    with _lock:
        _stalls.clear()
        _stalls.update(dict.fromkeys(STALL_CAUSES, 0))
