"""Net progress in EngineCore: how long eligible work has waited without any.

Activity is not progress: a scheduler that schedules nothing for a request it cannot fit
(the zero-token livelock of vllm#40707, #39734, #45414) keeps the busy loop turning and every
ping answered. So the busy loop records, after each step and in O(1), whether the engine
made **net progress**:

- a request finished (the scheduler holds fewer requests than after the last step, add or
  client abort: a saturated engine whose every request finishes in its step, as many
  arriving meanwhile, progresses), or
- the first running request's computed tokens passed their high-water mark (a request
  preempted and recomputed does not progress until it passes the point it had reached).

A client's abort is not progress: the engine did nothing for it, and in a livelock the
stuck requests' clients time out, abort and retry (a load balancer's 30 s timeout would
otherwise keep the clock from ever reaching the timeout). Only the remedy's own abort of a
stuck request restarts the clock (:meth:`Progress.aborted`).

Vllm's scheduler serves its running list in order, so the first running request is
scheduled first in every step that schedules anything: a healthy step moves it. Only that
request is looked at (its mark is kept on it), so a step costs the same whatever the batch.

Work is **eligible** while a request runs, or the first waiting one is ready to be scheduled
(not waiting for remote KV, for a structured-output grammar or for streaming input), and the
scheduler is not paused. Without eligible work the clock does not run (idle, paused); a
utility call's time does not count; the step in progress counts only past the step bound
(the API server's rule). The answer to the heartbeat carries ``stalled_s``: seconds since
the last net progress while eligible work waited.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from typing import Any

SCHEDULER_ATTR = "scheduler"
"""``EngineCore.scheduler``: vLLM's ``Scheduler`` (``running``, ``waiting``, ``requests``)."""
HWM_ATTR = "_mmcache_fix_hwm"
"""On a vLLM ``Request``: the most computed tokens it reached (the high-water mark)."""
_NOT_READY = "WAITING_FOR"
"""Prefix of vLLM's ``RequestStatus`` names of a waiting request that is not eligible."""
STEP_BOUNDS: tuple[float, ...] = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
"""Upper bounds (seconds) of the step-duration histogram EngineCore keeps (the last bucket,
past 5 s, is unbounded); ``mmcache_fix_engine_step_seconds`` exports it."""
RECENT_STEPS = 16
"""Step durations kept (a ring), for the stall snapshot."""


class Progress:
    """Written by the busy loop; read by the input thread (plain floats and ints)."""

    __slots__ = (
        "since",
        "work",
        "requests",
        "empty_steps",
        "steps",
        "unpaused",
        "usable",
        "step_counts",
        "step_sum",
        "recent",
        "timed",
    )

    def __init__(self) -> None:
        self.since = time.monotonic()
        """The last net progress, or when eligible work began waiting."""
        self.work = False
        """Eligible work waited after the last step (or an add). Written after
        :attr:`since` when it turns True (the input thread reads both without a lock: the
        other order shows it an idle engine's hours as seconds without progress)."""
        self.requests = 0
        """``len(scheduler.requests)`` after the last step or add."""
        self.empty_steps = 0
        """Steps that made no net progress while eligible work waited."""
        self.steps = 0
        self.unpaused: Any = None
        """vLLM's ``PauseState.UNPAUSED``, once seen (compared by identity)."""
        self.usable: bool | None = None
        """Whether the scheduler has vLLM's ``requests``, ``running`` and ``waiting`` (a
        custom ``--scheduler-cls`` may not): checked at the first step; never judged
        without them."""
        self.step_counts = [0] * (len(STEP_BOUNDS) + 1)
        """Steps per duration bucket (:data:`STEP_BOUNDS`, then the unbounded one)."""
        self.step_sum = 0.0
        self.recent = [0.0] * RECENT_STEPS
        """The last step durations, a ring indexed by :attr:`timed`."""
        self.timed = 0

    def recent_steps(self) -> list[float]:
        """The last step durations, oldest first (read from the input thread)."""
        timed, ring = self.timed, list(self.recent)
        if timed < RECENT_STEPS:
            return ring[:timed]
        cut = timed % RECENT_STEPS
        return ring[cut:] + ring[:cut]

    def added(self, now: float, held: int | None = None) -> None:
        """A request was added (the scheduler ``held`` this many requests then): the clock
        starts now if nothing waited."""
        if held is not None:
            self.requests = held
        if not self.work:
            self.since = now  # first: a reader that sees the work sees when it began
            self.work = True

    def aborted(self, now: float) -> None:
        """The remedy aborted the oldest stuck request: the clock restarts."""
        self.since = now

    def client_aborted(self, scheduler: Any) -> None:
        """A client's abort took requests out of the scheduler (between steps, or inside one
        before its outputs): no progress. The count after it is the reference, and the request
        it leaves first in the running list is judged from where it stands (its first sight
        as the first is not progress)."""
        requests = getattr(scheduler, "requests", None)
        running = getattr(scheduler, "running", None)
        if self.usable is False or requests is None or running is None:
            return  # a scheduler without vLLM's queues is never judged
        self.requests = len(requests)
        if running:
            first = running[0]
            first.__dict__.setdefault(HWM_ATTR, first.num_computed_tokens)

    def skip(self, seconds: float) -> None:
        """Time the busy loop spent in a utility call does not count."""
        if self.work and seconds > 0:
            self.since += seconds

    def after_step(self, scheduler: Any, now: float, started: float = -1.0) -> None:
        """After one step of the busy loop (begun at ``started``): its duration kept, then
        O(1) reads of the scheduler (``None``: nothing to read, the clock stops)."""
        if started >= 0.0:
            took = now - started
            self.step_counts[bisect_left(STEP_BOUNDS, took)] += 1
            self.step_sum += took
            self.recent[self.timed % RECENT_STEPS] = took
            self.timed += 1
        if self.usable is not True:
            if self.usable is None:
                self.usable = all(
                    hasattr(scheduler, name) for name in ("requests", "running", "waiting")
                )
            if not self.usable:
                self.work = False
                return
        self.steps += 1
        requests = len(scheduler.requests)
        progressed = requests < self.requests
        self.requests = requests
        running = scheduler.running
        if running:
            first = running[0]
            computed = first.num_computed_tokens
            marks = first.__dict__
            if computed > marks.get(HWM_ATTR, -1):
                marks[HWM_ATTR] = computed
                progressed = True
            pause = scheduler.__dict__.get("_pause_state")
            ready = pause is None or pause is self.unpaused or unpaused(self, pause)
        else:
            ready = eligible(scheduler)
        if not ready:
            self.work = False
            self.since = now
        elif not self.work:
            self.since = now  # first, as in added()
            self.work = True
        elif progressed:
            self.since = now
        else:
            self.empty_steps += 1

    def stalled_s(self, scheduler: Any, until: float) -> float:
        """Seconds without net progress while eligible work waited, up to ``until``."""
        if not self.work or self.usable is False or not eligible(scheduler):
            return 0.0
        return max(0.0, until - self.since)


def unpaused(progress: Progress, pause: Any) -> bool:
    """Whether ``pause`` is vLLM's ``PauseState.UNPAUSED`` (remembered for the next step)."""
    if getattr(pause, "name", None) == "UNPAUSED":
        progress.unpaused = pause
        return True
    return False


def eligible(scheduler: Any) -> bool:
    """Whether eligible work waits: a request runs, or the first waiting one is ready, and
    the scheduler is not paused. O(1); safe from the input thread (reads only)."""
    pause = getattr(scheduler, "_pause_state", None)
    if pause is not None and getattr(pause, "name", "UNPAUSED") != "UNPAUSED":
        return False
    if scheduler.running:
        return True
    waiting = scheduler.waiting
    if not waiting:
        return False
    try:
        head = waiting.peek_request()
    except Exception:  # emptied meanwhile (read from the input thread)
        return False
    status = getattr(getattr(head, "status", None), "name", "")
    return not str(status).startswith(_NOT_READY)
