"""What EngineCore's busy loop is doing, as the input thread's answer reports it.

The busy loop writes its state (:class:`LoopState`) as it enters and leaves a step or a
request; the input thread reads it when it answers a heartbeat ping. One tuple is swapped
per change, so a reader never sees half of one.
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

IDLE = "idle"
"""Between steps: waiting for requests, or about to step."""
STEP = "step"
ADD = "add"
ABORT = "abort"
UTILITY = "utility"
"""A utility call (``detail`` names it): healthy however long it runs (profiler stop, weight
sync, LoRA load, sleep/wake)."""
SYNC = "sync"
"""A DP rank waits for the other ranks (``detail``: the DP all-reduce or a dummy batch): as
long as their step, so judged as a step (the step bound)."""

STUCK_STATES = frozenset({STEP, ADD, ABORT, SYNC})
"""States in which one long stay is evidence of a stuck engine (above the timeout)."""
STEP_STATES = frozenset({STEP, SYNC})
"""Of those, the ones judged by the step bound (``MMCACHE_FIX_STEP_TIMEOUT``), not by the
timeout: one step of this engine or of a peer it waits for."""

ANSWER_SCHEMA = 2
VIA_INPUT_THREAD = "input thread"
VIA_BUSY_LOOP = "busy loop"
KEY_QUEUED_BEFORE_HOOK = "queued_before_hook"
"""Set (True) in an answer the busy loop gives to a ping the input thread had queued before
the hook that answers pings in the input thread was in place (the busy loop adopts its engine
after EngineCore said it was ready, so the API server's first ping can be queued first): the
engine is alive, and the input thread answers the next pings."""


class Phase(NamedTuple):
    state: str
    detail: str
    since: float
    """``time.monotonic()`` in EngineCore when the busy loop entered it."""


RawPhase = tuple[str, str, float]
"""A :class:`Phase` as the busy loop writes it: a plain tuple of the same three fields."""


class LoopState:
    """Written by the busy loop only; read from any thread (:attr:`phase`, :meth:`snapshot`).

    The busy loop swaps one plain ``(state, detail, since)`` tuple, :attr:`raw`, per change:
    at every step a :class:`Phase` would cost 0.1 µs more to build (``scripts/bench-step``).
    A reader gets it as a :class:`Phase`."""

    __slots__ = ("raw",)

    def __init__(self) -> None:
        self.raw: RawPhase = (IDLE, "", time.monotonic())

    @property
    def phase(self) -> Phase:
        return Phase._make(self.raw)

    @phase.setter
    def phase(self, phase: RawPhase) -> None:
        self.raw = phase

    def enter(self, state: str, detail: str = "") -> RawPhase:
        """Enter ``state``; returns the phase to give back to :meth:`leave`."""
        previous = self.raw
        self.raw = (state, detail, time.monotonic())
        return previous

    def leave(self, previous: RawPhase) -> None:
        # Back to what the loop was doing: idle after a step, or the outer phase when a phase
        # was entered inside another one (its ``since`` kept).
        self.raw = (IDLE, "", time.monotonic()) if previous[0] == IDLE else previous

    def snapshot(self, now: float | None = None) -> dict[str, Any]:
        phase = self.phase
        now = time.monotonic() if now is None else now
        return {"state": phase.state, "detail": phase.detail, "for_s": max(0.0, now - phase.since)}
