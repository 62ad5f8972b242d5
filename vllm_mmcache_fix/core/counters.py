"""Plain counters any part of the plugin can bump, in any process (no imports, no vLLM).

They travel to the API server's ``/metrics`` with the rest of the process's counts
(:func:`vllm_mmcache_fix.plugin.counts`): in EngineCore through the liveness round trip,
in the API server directly.
"""

from __future__ import annotations

import threading

_lock = threading.Lock()
_stalls = 0


def count_stall(n: int = 1) -> None:
    """One stall seen by the stall sentinel in this process (``mmcache_fix_stalls_total``)."""
    global _stalls
    with _lock:
        _stalls += n


def stalls() -> int:
    with _lock:
        return _stalls


def reset() -> None:
    global _stalls
    with _lock:
        _stalls = 0
