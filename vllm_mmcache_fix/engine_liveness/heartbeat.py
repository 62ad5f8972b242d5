"""The API server's heartbeat to each EngineCore, and the verdict ``/health`` reads.

One asyncio task per engine client, in the client's own event loop, wakes every
:data:`TICK_S` and sends each engine a ping (a utility call EngineCore's input thread
answers, :mod:`.answer`) every :data:`PING_INTERVAL_S`. ``/health`` never waits on EngineCore:
it reads the verdict the heartbeat keeps. An engine is judged stuck only on evidence:

- **silent**: two pings waiting, the older one for longer than the timeout. With one ping
  waiting the next goes at the usual interval, with two every half timeout, so one lost
  answer (vLLM's ROUTER drops replies while a remote engine reconnects) is never taken for a
  dead thread, and the first answer that gets through settles every older ping and clears
  the verdict. EngineCore's input thread answers in milliseconds whatever the busy loop
  does, so silence means that thread is dead or spinning (the 0.23.0 incident; 0.11-0.13's
  ``Expected a cached item`` assertion ending it). This verdict is taken only at a tick
  that came on time: after the event loop itself was blocked (a long call in the request
  path), answers that wait in the socket are read first.
- **no net progress**: an answer says eligible work has waited for longer than the progress
  timeout (``MMCACHE_FIX_PROGRESS_TIMEOUT``, 60 s) without net progress: no request
  finished or was aborted, none computed past its high-water mark (:mod:`.progress`). The
  zero-token livelock, a preemption cascade, a DP engine waiting outside a step. The step in
  progress counts only past the step bound, a utility call not at all.
- **loop stuck**: an answer says the busy loop has been inside one add/abort for longer than
  the timeout, or inside one step for longer than the step bound (vLLM's own bound on one
  step, 300 s, ``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS``, or ``MMCACHE_FIX_STEP_TIMEOUT``): a
  long healthy step (a 100k-token prefill chunk, a long video through the encoder) is not a
  stuck engine. A utility call is healthy however long it runs.

A verdict fails ``/health`` only when it holds at two consecutive evaluations (ticks for
silence, answers for the loop); one answer that says otherwise clears it at once.

At most :data:`MAX_IN_FLIGHT` pings per engine wait on vLLM; one unanswered for four timeouts
expires and frees its place. An engine that cannot answer (no ping method: vLLM's failure
reply; a client without ``engine=``; answers from the busy loop only, or
:data:`MISROUTED_ANSWERS` in a row through the busy loop while its input thread was said to
answer) has its check turned off, with one WARNING.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import math
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..core import log
from ..core.declaration import ENGINE_NAME_KEY
from ..core.messages import (
    ENGINE_ANSWERS_AGAIN,
    ENGINE_CHECK_OFF,
    ENGINE_LOOP_STUCK,
    ENGINE_NOT_ANSWERING,
)
from ..core.process import process_label
from ..vllm_layout import (
    CLIENT_CALL_UTILITY,
    CLIENT_ENGINE_PARAM,
    CLIENT_ENGINES,
    CLIENT_INDEX,
    CLIENT_RESOURCES,
    ENGINE_PING_METHOD,
    UTILITY_SHUTDOWN_REPLY,
)
from .busy_loop import KEY_QUEUED_BEFORE_HOOK, STEP_STATES, STUCK_STATES, VIA_INPUT_THREAD
from .snapshot import KEY_DETAILS

TICK_S = 1.0
"""How often the heartbeat wakes: sends what is due, takes the silent verdict."""
PING_INTERVAL_S = 2.0
"""Seconds between two pings to one engine (docs/health.md: the cost and the bound)."""
MAX_LAG_S = 1.0
"""A tick later than this saw an event loop that was blocked: no silent verdict at it."""
MAX_IN_FLIGHT = 8
"""Pings per engine that may wait on vLLM at once (vLLM keeps one future per unanswered
call): a silent engine is pinged every half timeout (once two wait) until this many wait."""
EXPIRE_TIMEOUTS = 4.0
"""A ping unanswered for this many timeouts expires: it no longer counts toward
:data:`MAX_IN_FLIGHT` (so lost answers never stop the pings), but stays evidence of silence
until a later answer settles it."""
STRIKES = 2
"""Consecutive evaluations a verdict must hold before ``/health`` fails."""
MISROUTED_ANSWERS = 3
"""Answers in a row through the busy loop, while the engine said its input thread answers,
that turn the check off: a hook lost to another plugin sends every answer that way, while a
ping the input thread was queuing as the busy loop hooked the queue (after it counted the
pings already queued) sends one."""
DEFAULT_STEP_TIMEOUT = 300.0
"""vLLM's own bound on one step (``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS``' default)."""

SILENT = "silent"
LOOP = "loop"
NO_PROGRESS = "no_progress"
ENGINE_NO_PROGRESS = "EngineCore makes no net progress"
"""The WARNING of the no-progress verdict (log scans and alerts grep for it)."""
DEFAULT_PROGRESS_TIMEOUT = 60.0
VERDICT_CLASS = "stall class:"
"""In the verdict's WARNING, before the class (``silent``, ``loop``, ``no_progress``)."""

Clock = Callable[[], float]
OnVerdict = Callable[["EngineBeat", str, str], str]


def engine_rank(identity: Any, index: int) -> int:
    """The DP rank of an engine: vLLM's identity is the rank as 2 little-endian bytes (its
    position in the client's list when it is not, as with an external load balancer whose
    API server manages ranks 4 and 5)."""
    if isinstance(identity, (bytes, bytearray)) and len(identity) == 2:
        return int.from_bytes(identity, "little")
    return index


def engine_name(rank: int, data_parallel: bool) -> str:
    """vLLM's own name of the process: ``EngineCore`` alone, ``EngineCore_DP<rank>`` with
    DP (the global rank, as vLLM names the process)."""
    return f"EngineCore_DP{rank}" if data_parallel else "EngineCore"


def _dp_size(client: Any) -> int:
    parallel = getattr(getattr(client, "vllm_config", None), "parallel_config", None)
    size = getattr(parallel, "data_parallel_size", 1)
    return size if isinstance(size, int) else 1


def _clock_text(wall: float | None) -> str:
    if wall is None:
        return "never"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(wall)) + " UTC"


def accepts_engine(call: Any) -> bool:
    """Whether a client's ``_call_utility_async`` takes ``engine=`` (one engine per call)."""
    try:
        params = inspect.signature(call).parameters
    except (TypeError, ValueError):
        return False
    param = params.get(CLIENT_ENGINE_PARAM)
    return param is not None and param.kind in (
        inspect.Parameter.KEYWORD_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
    )


def client_is_dead(client: Any) -> bool:
    resources = getattr(client, CLIENT_RESOURCES[0], None)
    return bool(getattr(resources, CLIENT_RESOURCES[1], False))


@dataclass
class Ping:
    sent_at: float
    sent_wall: float


@dataclass
class EngineBeat:
    """One engine as this API server's heartbeat sees it."""

    name: str
    identity: Any
    started_at: float
    pending: list[Ping] = field(default_factory=list)
    """Pings waiting: unanswered and sent after the last answered one, oldest first."""
    flying: list[Ping] = field(default_factory=list)
    """Pings whose call to vLLM has not returned and that have not expired (at most
    :data:`MAX_IN_FLIGHT`)."""
    last_sent: float = -math.inf
    answered_at: float | None = None
    answered_wall: float | None = None
    round_trip_s: float | None = None
    loop: dict[str, Any] | None = None
    """The busy loop's state in the last answer (``state``, ``detail``, ``for_s``)."""
    progress: dict[str, Any] | None = None
    """Net progress in the last answer (``stalled_s``, ``empty_steps``, ``steps``)."""
    counts: dict[str, Any] | None = None
    """The plugin counters EngineCore sent with its last answer."""
    details: dict[str, Any] | None = None
    """The stall snapshot's details in the last answer (only while a stall builds)."""
    verdicts: dict[str, int] = field(default_factory=dict)
    """Stall episodes that failed ``/health``, per verdict class."""
    stuck: str | None = None
    """Why ``/health`` fails for this engine (None: it does not)."""
    stuck_kind: str | None = None
    candidate: str | None = None
    """The verdict's kind seen at the last evaluation, before it fails ``/health``."""
    strikes: int = 0
    """Consecutive evaluations that found :attr:`candidate`."""
    off: str | None = None
    """Why this engine's check is off (None: it is on)."""
    misrouted: int = 0
    """Answers in a row through the busy loop while the input thread was said to answer."""
    answers: int = 0
    failed_checks: int = 0

    def age(self, now: float) -> float:
        """Seconds since the last answer (since the heartbeat started, before the first)."""
        return now - (self.answered_at if self.answered_at is not None else self.started_at)

    def status(self, now: float) -> dict[str, Any]:
        return {
            "engine": self.name,
            "answers": self.answers,
            "pending": len(self.pending),
            "in_flight": len(self.flying),
            "last_answer_age_s": round(self.age(now), 3),
            "answered_at": self.answered_wall,
            "round_trip_s": self.round_trip_s,
            "loop": dict(self.loop) if self.loop else None,
            "progress": dict(self.progress) if self.progress else None,
            "stuck": self.stuck,
            "off": self.off,
            "failed_checks": self.failed_checks,
        }


class Heartbeat:
    """The heartbeat of one engine client (its engines, its task)."""

    def __init__(
        self,
        client: Any,
        timeout: float,
        on_answer: Callable[[str, float], None] = lambda engine, seconds: None,
        clock: Clock = time.monotonic,
        guard: Any = None,
        enabled: Callable[[], bool] = lambda: True,
        step_timeout: float = DEFAULT_STEP_TIMEOUT,
        progress_timeout: float = DEFAULT_PROGRESS_TIMEOUT,
        on_verdict: OnVerdict | None = None,
    ) -> None:
        self.timeout = timeout
        self.on_verdict = on_verdict
        """Called at the first verdict of an episode; returns text for the WARNING (the
        snapshot's file). Must not raise (it guards its own work)."""
        self.step_timeout = max(step_timeout, timeout)
        self.progress_timeout = progress_timeout
        """Seconds without net progress while eligible work waits (0: not judged)."""
        self.on_answer = on_answer
        self.clock = clock
        self.guard = guard if guard is not None else contextlib.nullcontext()
        """Around the heartbeat's own work (a ``Site``: an error there is the plugin's)."""
        self.enabled = enabled
        self.client_index = getattr(client, CLIENT_INDEX, 0)
        self._client = weakref.ref(client)
        self.beats: list[EngineBeat] = []
        self.task: asyncio.Future[Any] | None = None
        self.stopped: str | None = None
        self.started_at = clock()
        self.pings: set[asyncio.Future[Any]] = set()
        self._refresh(client)
        call = getattr(client, CLIENT_CALL_UTILITY, None)
        if not accepts_engine(call):
            for beat in self.beats:
                self.turn_off(
                    beat,
                    f"this vLLM's {type(client).__name__}.{CLIENT_CALL_UTILITY} has no "
                    f"{CLIENT_ENGINE_PARAM}= parameter (it cannot ask one engine)",
                )

    # -- the task ------------------------------------------------------------------

    def start(self) -> None:
        """Start the task in the running event loop (the caller's)."""
        self.task = asyncio.get_running_loop().create_task(self.run())

    async def run(self) -> None:
        try:
            expected = self.clock()
            while self.stopped is None:
                now = self.clock()
                client = self._client()
                if client is None:
                    self.stop("the engine client is gone")
                    return
                if client_is_dead(client):
                    self.stop("EngineCore is dead (vLLM's own check reports it)")
                    return
                if not self.enabled():
                    self.stop("switched off after an internal error")
                    return
                with self.guard:
                    self.tick(client, now, responsive=now - expected <= MAX_LAG_S)
                del client
                expected = self.clock() + TICK_S
                await asyncio.sleep(TICK_S)
        except asyncio.CancelledError:
            self.stop("cancelled")
            raise

    def stop(self, reason: str) -> None:
        """No verdict any more: ``/health`` is vLLM's own again. Pings in flight are left to
        finish (cancelling one would leave vLLM a reply for a call it forgot)."""
        if self.stopped is None:
            self.stopped = reason
        for beat in self.beats:
            beat.stuck = beat.stuck_kind = None
        task = self.task
        if task is not None and not task.done() and task is not _current_task():
            task.cancel()

    # -- one tick ------------------------------------------------------------------

    def tick(self, client: Any, now: float, *, responsive: bool) -> None:
        """Send what is due; take the silent verdict (only when the loop ran on time)."""
        self._refresh(client)
        for beat in self.beats:
            if beat.off is not None:
                continue
            waiting = len(beat.pending)
            if beat.candidate in (LOOP, NO_PROGRESS) and beat.strikes < STRIKES and waiting < 2:
                due = True  # an answer found a stall: the next answer confirms it or clears it
            elif waiting >= 2:
                due = now - beat.last_sent >= self.timeout / 2  # silent: confirm, or get through
            else:
                # One unanswered ping is no silence (a reply vLLM's ROUTER dropped): waiting
                # half a timeout for the next left the age, the counts and a stall's
                # confirmation that long behind.
                due = now - beat.last_sent >= PING_INTERVAL_S
            _expire(beat, now - EXPIRE_TIMEOUTS * self.timeout)
            if due and len(beat.flying) < MAX_IN_FLIGHT:
                self.send(client, beat, now)
            if not responsive:
                continue  # no evidence either way at a late tick
            oldest = beat.pending[0] if beat.pending else None
            if (
                oldest is not None
                and len(beat.pending) >= 2
                and now - oldest.sent_at > self.timeout
            ):
                self._judge(
                    beat,
                    SILENT,
                    f"{beat.name} has not answered for {now - oldest.sent_at:.1f} s "
                    f"({len(beat.pending)} pings sent since {_clock_text(oldest.sent_wall)}; "
                    f"last answer: {_clock_text(beat.answered_wall)}; "
                    f"MMCACHE_FIX_HEALTH_TIMEOUT={self.timeout:g}): its input thread reads no "
                    "request (dead, or spinning)",
                )
            elif beat.candidate == SILENT:
                beat.candidate, beat.strikes = None, 0

    def send(self, client: Any, beat: EngineBeat, now: float) -> None:
        ping = Ping(now, time.time())
        beat.pending.append(ping)
        beat.flying.append(ping)
        beat.last_sent = now
        call = getattr(client, CLIENT_CALL_UTILITY)
        task = asyncio.get_running_loop().create_task(self._ping(beat, ping, call))
        self.pings.add(task)
        task.add_done_callback(self.pings.discard)

    async def _ping(self, beat: EngineBeat, ping: Ping, call: Callable[..., Any]) -> None:
        try:
            reply = await call(ENGINE_PING_METHOD, **{CLIENT_ENGINE_PARAM: beat.identity})
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            with self.guard:
                _landed(beat, ping)
                self._failed(beat, ping, exc)
            return
        with self.guard:
            _landed(beat, ping)
            self.answered(beat, ping, reply, self.clock())

    # -- answers -------------------------------------------------------------------

    def answered(self, beat: EngineBeat, ping: Ping, reply: Any, now: float) -> None:
        if ping in beat.pending:
            # An answer also settles every older ping: one that was lost is never awaited.
            del beat.pending[: beat.pending.index(ping) + 1]
        beat.answers += 1
        beat.answered_at = now
        beat.answered_wall = time.time()
        beat.round_trip_s = now - ping.sent_at
        if not isinstance(reply, Mapping):
            self.turn_off(beat, f"its {ENGINE_PING_METHOD} answered {type(reply).__name__}")
            return
        if (
            reply.get("input_thread") is True
            and reply.get("via") != VIA_INPUT_THREAD
            and reply.get(KEY_QUEUED_BEFORE_HOOK) is not True  # queued before the hook: alive
        ):
            beat.misrouted += 1
            if beat.misrouted >= MISROUTED_ANSWERS:
                self.turn_off(
                    beat,
                    f"it said its input thread answers, but {beat.misrouted} answers in a row "
                    f"came through {reply.get('via') or 'another way'} (another plugin may have "
                    "replaced its input queue), so a long step or utility call could not be "
                    "told from a stuck engine",
                )
                return
            # One such answer is a ping that raced the hook at start-up: it is an answer.
        else:
            beat.misrouted = 0
        if reply.get("input_thread") is not True:
            self.turn_off(
                beat,
                "it answers from its busy loop only (its input thread is not hooked: "
                f"pid {reply.get('pid')}, answer schema {reply.get('schema')}), so a long step "
                "or utility call could not be told from a stuck engine",
            )
            return
        loop = reply.get("loop")
        beat.loop = dict(loop) if isinstance(loop, Mapping) else None
        progress = reply.get("progress")
        beat.progress = dict(progress) if isinstance(progress, Mapping) else None
        counts = reply.get("counts")
        beat.counts = dict(counts) if isinstance(counts, Mapping) else None
        details = reply.get(KEY_DETAILS)
        beat.details = dict(details) if isinstance(details, Mapping) else None
        self.on_answer(beat.name, beat.round_trip_s)
        self.judge_loop(beat)

    def judge_loop(self, beat: EngineBeat) -> None:
        """An answer came: the input thread lives; the busy loop may still be stuck."""
        loop = beat.loop or {}
        state = loop.get("state")
        seconds = loop.get("for_s")
        stepping = state in STEP_STATES
        bound = self.step_timeout if stepping else self.timeout
        if state in STUCK_STATES and isinstance(seconds, (int, float)) and seconds > bound:
            setting = "MMCACHE_FIX_STEP_TIMEOUT" if stepping else "MMCACHE_FIX_HEALTH_TIMEOUT"
            self._judge(
                beat,
                LOOP,
                f"{beat.name}'s busy loop has been inside one {state} for {seconds:.1f} s "
                f"({setting}={bound:g}); its input thread still answers",
            )
            return
        progress = beat.progress or {}
        stalled = progress.get("stalled_s")
        if (
            self.progress_timeout > 0
            and isinstance(stalled, (int, float))
            and stalled > self.progress_timeout
        ):
            self._judge(
                beat,
                NO_PROGRESS,
                f"{beat.name} has made no net progress for {stalled:.1f} s while requests "
                f"wait (no request finished, none computed past its mark; "
                f"{progress.get('empty_steps', 0)} empty steps so far; "
                f"MMCACHE_FIX_PROGRESS_TIMEOUT={self.progress_timeout:g}): its busy loop "
                "turns without serving (a scheduler that cannot fit a request, a preemption "
                "cascade, a DP engine waiting outside a step, a busy loop that stopped taking "
                "its input queue)",
            )
            return
        self._clear_stuck(beat)

    def _judge(self, beat: EngineBeat, kind: str, text: str) -> None:
        """One evaluation found ``kind``: fail ``/health`` once :data:`STRIKES` in a row did."""
        if beat.candidate == kind:
            beat.strikes += 1
        else:
            beat.candidate, beat.strikes = kind, 1
        if beat.strikes >= STRIKES:
            self._set_stuck(beat, kind, text)

    def _failed(self, beat: EngineBeat, ping: Ping, exc: Exception) -> None:
        if ping in beat.pending:
            beat.pending.remove(ping)
        client = self._client()
        if self.stopped is not None or client is None or client_is_dead(client):
            return  # the engine died or is shutting down: vLLM's own check says so
        if any(cls.__name__ == "EngineDeadError" for cls in type(exc).__mro__):
            self.stop("EngineCore is dead (vLLM's own check reports it)")
            return
        if str(exc) == UTILITY_SHUTDOWN_REPLY:
            self.stop("EngineCore is shutting down")
            return
        self.turn_off(beat, f"its ping failed: {type(exc).__name__}: {exc}")

    def turn_off(self, beat: EngineBeat, why: str) -> None:
        if beat.off is not None:
            return
        beat.off = why
        beat.stuck = beat.stuck_kind = None
        log.warning(
            "%s %s in %s: %s. /health no longer judges it (vLLM's own check still runs); "
            "install vllm-mmcache-fix where EngineCore runs, with the same version",
            ENGINE_CHECK_OFF,
            beat.name,
            process_label(),
            why,
        )

    def _set_stuck(self, beat: EngineBeat, kind: str, text: str) -> None:
        first = beat.stuck is None
        beat.stuck, beat.stuck_kind = text, kind
        if first:
            beat.verdicts[kind] = beat.verdicts.get(kind, 0) + 1
            extra = ""
            if self.on_verdict is not None:
                try:
                    extra = self.on_verdict(beat, kind, text)
                except Exception:  # its own guard failed: the verdict stands without it
                    extra = ""
            log.warning(
                "%s in %s: %s; /health now fails (%s %s)%s. Run 'vllm-mmcache-fix diagnose "
                "--pid <API server pid>' to see where",
                {SILENT: ENGINE_NOT_ANSWERING, NO_PROGRESS: ENGINE_NO_PROGRESS}.get(
                    kind, ENGINE_LOOP_STUCK
                ),
                process_label(),
                text,
                VERDICT_CLASS,
                kind,
                extra,
            )

    def _clear_stuck(self, beat: EngineBeat) -> None:
        beat.candidate, beat.strikes = None, 0
        if beat.stuck is None:
            return
        was = beat.stuck
        beat.stuck = beat.stuck_kind = None
        log.warning(
            "%s in %s: %s (it was: %s)",
            ENGINE_ANSWERS_AGAIN,
            process_label(),
            beat.name,
            was,
        )

    # -- engines -------------------------------------------------------------------

    def _refresh(self, client: Any) -> None:
        engines = getattr(client, CLIENT_ENGINES, None)
        if not isinstance(engines, Sequence):
            return
        identities = list(engines)
        if [b.identity for b in self.beats] == identities:
            return
        # First call, or the engines changed (elastic DP): keep the beats still valid.
        old = {b.identity: b for b in self.beats}
        now = self.clock()
        beats = [old.get(e) or EngineBeat("", e, now) for e in identities]
        data_parallel = len(beats) > 1 or _dp_size(client) > 1
        for index, beat in enumerate(beats):
            beat.name = engine_name(engine_rank(beat.identity, index), data_parallel)
        self.beats = beats

    def verdict(self) -> list[EngineBeat]:
        """The engines ``/health`` fails for now."""
        if self.stopped is not None:
            return []
        return [b for b in self.beats if b.stuck is not None and b.off is None]


def _expire(beat: EngineBeat, before: float) -> None:
    """Pings sent before ``before`` leave the bound; of the evidence (the waiting pings) the
    oldest and the newest are kept."""
    while beat.flying and beat.flying[0].sent_at < before:
        del beat.flying[0]
    if len(beat.pending) > MAX_IN_FLIGHT:
        del beat.pending[1 : len(beat.pending) - MAX_IN_FLIGHT + 1]


def _landed(beat: EngineBeat, ping: Ping) -> None:
    """A ping's call to vLLM returned (an answer or an error): no longer in flight."""
    with contextlib.suppress(ValueError):
        beat.flying.remove(ping)


def _current_task() -> asyncio.Future[Any] | None:
    try:
        return asyncio.current_task()
    except RuntimeError:
        return None


@dataclass
class Liveness:
    """The heartbeats of every engine client in this process."""

    timeout: float
    on_answer: Callable[[str, float], None] = lambda engine, seconds: None
    heartbeats: weakref.WeakKeyDictionary[Any, Heartbeat] = field(
        default_factory=weakref.WeakKeyDictionary
    )

    @staticmethod
    def usable(client: Any) -> bool:
        """Whether ``client`` talks to EngineCore processes through utility calls."""
        return callable(getattr(client, CLIENT_CALL_UTILITY, None)) and isinstance(
            getattr(client, CLIENT_ENGINES, None), Sequence
        )

    guard: Any = None
    enabled: Callable[[], bool] = lambda: True
    step_timeout: float = DEFAULT_STEP_TIMEOUT
    progress_timeout: float = DEFAULT_PROGRESS_TIMEOUT
    on_verdict: OnVerdict | None = None

    def attach(self, client: Any) -> Heartbeat | None:
        """The heartbeat of ``client``, started now (in the running loop) if it was not;
        None for a client without engine processes."""
        if not self.usable(client):
            return None
        beat = self.heartbeats.get(client)
        if beat is not None:
            return beat
        beat = Heartbeat(
            client,
            self.timeout,
            self.on_answer,
            guard=self.guard,
            enabled=self.enabled,
            step_timeout=self.step_timeout,
            progress_timeout=self.progress_timeout,
            on_verdict=self.on_verdict,
        )
        self.heartbeats[client] = beat
        beat.start()
        return beat

    def _all(self) -> list[Heartbeat]:
        for _ in range(3):  # read from the metrics thread while the event loop may add one
            try:
                return list(self.heartbeats.values())
            except RuntimeError:
                continue
        return []

    def engine_counts(self) -> list[Mapping[str, Any]] | None:
        """EngineCore's counters for ``/metrics``, from the first API server only; None
        elsewhere and until an engine has answered (an EngineCore series at 0 would tell an
        alert that the engine is not protected while it is only not yet asked)."""
        for beat in self._all():
            if beat.client_index == 0:
                # Each engine's counts carry its name: the exporter follows each engine's
                # counters by it, so one that leaves takes nothing back from a summed series.
                found = [(b.name, b.counts) for b in list(beat.beats) if b.counts is not None]
                return [{**counts, ENGINE_NAME_KEY: name} for name, counts in found] or None
        return None

    def progress_figures(self) -> list[dict[str, Any]] | None:
        """Per engine, from the first API server only (as :meth:`engine_counts`): seconds
        without net progress, empty steps, the step-duration histogram, verdicts by class.
        An engine whose check is off has NaN seconds (as its last answer's age): its last
        figure would stay on the gauge for the server's life."""
        for beat in self._all():
            if beat.client_index != 0 or beat.stopped is not None:
                continue
            out: list[dict[str, Any]] = []
            for engine in list(beat.beats):
                if engine.off is not None:
                    out.append({"engine": engine.name, "stalled_s": math.nan})
                    continue
                if engine.progress is None:
                    continue
                out.append({"engine": engine.name, **engine.progress, "verdicts": engine.verdicts})
            return out or None
        return None

    def ages(self, now: float | None = None) -> dict[str, float]:
        """Seconds since each engine last answered (NaN where its check is off)."""
        now = time.monotonic() if now is None else now
        out: dict[str, float] = {}
        for beat in self._all():
            if beat.stopped is not None:
                continue
            for engine in list(beat.beats):
                age = math.nan if engine.off is not None else engine.age(now)
                if engine.name not in out or age < out[engine.name]:
                    out[engine.name] = age
        return out

    def status(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        return [
            {**engine.status(now), "stopped": beat.stopped}
            for beat in self._all()
            for engine in list(beat.beats)
        ]
