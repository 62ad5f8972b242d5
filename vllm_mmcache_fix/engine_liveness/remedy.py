"""The optional remedy for a zero-token livelock: abort the oldest stuck request.

Off by default (``MMCACHE_FIX_ABORT_STUCK=on`` turns it on). When EngineCore has made no net
progress for the progress timeout while eligible work waits (the ``no_progress`` verdict,
:mod:`.progress`), the busy loop, right after a step, aborts the request that has waited
longest: vLLM's own ``EngineCore.abort_requests`` takes it out of the scheduler, and a finish
output (reason ``abort``, no new tokens) goes on the engine's output queue to the request's
API server, as vLLM does for requests it aborts itself; so the client gets an answer instead
of waiting forever, and the other requests go on. At most once per
:data:`ABORT_INTERVAL_S` per engine. The recovery vllm#39734 asks for, which otherwise needs
the process killed.

Everything here runs on the busy loop's thread (where vLLM uses the scheduler); when the
setting is off, the step wrapper is the plain one (no work per step at all).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

ABORT_INTERVAL_S = 300.0
"""At most one abort per engine in this many seconds."""
_NOT_STUCK = ("WAITING_FOR", "FINISHED")
"""Prefixes of ``RequestStatus`` names of a request the remedy never picks."""


def due(stalled_s: float, timeout: float, last_at: float, now: float) -> bool:
    """Whether to abort now: no net progress for ``timeout`` seconds and no abort by this
    engine in the last :data:`ABORT_INTERVAL_S` (``last_at``: ``-inf`` before the first)."""
    return timeout > 0 and stalled_s >= timeout and now - last_at >= ABORT_INTERVAL_S


def oldest(requests: Iterable[Any]) -> Any | None:
    """The stuck request that has waited longest (by vLLM's ``arrival_time``); requests
    waiting for remote KV, a grammar or streaming input, and finished ones, are skipped."""
    best: Any = None
    best_at = math.inf
    for request in requests:
        status = str(getattr(getattr(request, "status", None), "name", ""))
        if status.startswith(_NOT_STUCK):
            continue
        arrived = getattr(request, "arrival_time", None)
        at = float(arrived) if isinstance(arrived, (int, float)) else math.inf
        if best is None or at < best_at:
            best, best_at = request, at
    return best


def finish_output(request_id: str) -> Any:
    """vLLM's ``EngineCoreOutputs`` finishing ``request_id`` as aborted, no new tokens (for a
    release without ``EngineCoreProc._send_abort_outputs_to_client``)."""
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason

    output = EngineCoreOutput(request_id, [], finish_reason=FinishReason.ABORT)
    return EngineCoreOutputs(finished_requests={request_id}, outputs=[output])
