"""EngineCore's side of the heartbeat: the input thread answers, and says what the busy loop does.

Installed in every process (a forked EngineCore inherits the patched classes; vLLM calls no
plugin again after a fork), it acts only where vLLM runs an ``EngineCoreProc`` busy loop
(``vllm_layout.ENGINE_PROC_CLASS``): that is the positive identification of an EngineCore, in
every process model (spawned, forked, DP, Ray actors).

- ``EngineCore.mmcache_fix_ping``: the utility method vLLM looks up by name. Its answer (a
  dict) carries the pid, the busy loop's state and how long it has been in it, and this
  process's plugin counters (for the API server's ``/metrics``).
- At the busy loop's first ``_process_input_queue`` the engine is adopted: its input queue's
  ``put_nowait`` (what the input thread calls for every request) answers a ping right there,
  in the input thread, through vLLM's own ``_handle_client_request`` (vLLM builds the reply and
  puts it on its thread-safe output queue). So a ping is answered in milliseconds while a step
  or a long utility call runs; only a dead or spinning input thread leaves it unanswered.
- ``_process_engine_step`` and ``_handle_client_request`` stamp the busy loop's state
  (:mod:`.busy_loop`): "step since T", "add/abort since T", "utility <name> since T", idle.
"""

from __future__ import annotations

import functools
import math
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from ..core import log, registry, signals
from ..core.guard import InjectedFault
from ..core.lifecycle import DidNotEnable, Fix
from ..core.messages import ANSWER_ACTIVE
from ..core.process import process_label
from ..core.settings import (
    ENV_ABORT_STUCK,
    Mode,
    Switch,
    read_abort_stuck,
    read_mode,
    read_progress_timeout,
)
from ..vllm_layout import (
    BUSY_LOOP_DISPATCH,
    BUSY_LOOP_INPUT,
    BUSY_LOOP_STEP,
    DP_COLLECTIVES,
    DP_DUMMY_BATCH,
    ENGINE_ABORT,
    ENGINE_CORE_CLASS,
    ENGINE_INPUT_QUEUE,
    ENGINE_PING_METHOD,
    ENGINE_PROC_CLASS,
    IDLE_CALLBACK_LIST,
    IDLE_CALLBACKS,
    PARALLEL_CONFIG,
    REQUEST_TYPE_ABORT,
    REQUEST_TYPE_ADD,
    REQUEST_TYPE_UTILITY,
    UTILITY_METHOD_INDEX,
)
from . import fork
from .busy_loop import (
    ABORT,
    ADD,
    ANSWER_SCHEMA,
    IDLE,
    KEY_QUEUED_BEFORE_HOOK,
    STEP,
    STUCK_STATES,
    SYNC,
    UTILITY,
    VIA_BUSY_LOOP,
    VIA_INPUT_THREAD,
    LoopState,
    Phase,
    RawPhase,
)
from .owns import ANSWER_ID
from .progress import SCHEDULER_ATTR, Progress
from .remedy import ABORT_INTERVAL_S, due, finish_output, oldest
from .snapshot import DETAIL_AFTER_S, KEY_DETAILS, engine_details

PATCH_ID = ANSWER_ID
ENGINE_ATTR = "_mmcache_fix_liveness"
"""Set on each adopted engine (through the registry, so revert removes it)."""
IDLE_CALLBACKS_DETAIL = "idle callbacks"
"""The loop state's detail while vLLM runs what a pause or a sleep left for the idle loop."""

Counts = Callable[[], "dict[str, int]"]


class Adopted:
    """What the plugin keeps on one adopted engine."""

    __slots__ = (
        "loop",
        "hooked",
        "progress",
        "aborted_at",
        "queue",
        "queued_since",
        "early_pings",
    )

    def __init__(self) -> None:
        self.loop = LoopState()
        self.progress = Progress()
        self.aborted_at = -math.inf
        """When the remedy last aborted a request of this engine (``time.monotonic()``)."""
        self.hooked = False
        """Whether the input queue's ``put_nowait`` answers pings in the input thread."""
        self.queue: Any = None
        """The hooked input queue (vLLM's ``queue.Queue``), for :func:`queued_s`."""
        self.queued_since = time.monotonic()
        """When the input thread last put an item on the empty input queue."""
        self.early_pings = 0
        """Pings already in the input queue when its ``put_nowait`` was hooked: the busy loop
        answers them, and says so (``KEY_QUEUED_BEFORE_HOOK``)."""


def is_ping(item: Any) -> bool:
    """Whether ``item`` (what the input thread queues) is a utility call of the ping."""
    try:
        request_type, request = item
        return (
            getattr(request_type, "name", None) == REQUEST_TYPE_UTILITY
            and isinstance(request, (list, tuple))
            and len(request) > UTILITY_METHOD_INDEX
            and request[UTILITY_METHOD_INDEX] == ENGINE_PING_METHOD
        )
    except Exception:
        return False


class EngineLivenessAnswer(Fix):
    id = "engine-liveness-answer"
    runs_in = "EngineCore"
    watches = (ENGINE_CORE_CLASS.module,)

    # Each is on after a reset and off for good after an internal error at its site.
    adopting: bool
    stamping: bool
    progressing: bool
    """Net progress kept after each step."""
    input_thread: bool
    """Pings answered in the input thread."""
    queue_watch: bool
    """The input thread notes when the input queue stops being empty (:func:`queued_s`)."""
    detailing: bool
    """Answers carry the stall snapshot's details."""
    fork_locks: bool
    """This (forked) process made its locks new after the fork; False when that broke."""
    answering: bool
    """Answers carry the loop's state, progress and counts (when off, the answer is pid and
    route only: the API server turns its check off)."""
    aborting: bool
    """The remedy works."""

    def __init__(self, counts: Counts) -> None:
        super().__init__()
        self.counts = counts
        self._answer_site = self.errors.site("engine_liveness.answer")
        self._adopt_site = self.errors.site("engine_liveness.adopt")
        self._stamp_site = self.errors.site("engine_liveness.loop_state")
        self._input_site = self.errors.site("engine_liveness.input_thread")
        self._queue_site = self.errors.site("engine_liveness.input_queue")
        self._progress_site = self.errors.site("engine_liveness.progress")
        self._details_site = self.errors.site("engine_liveness.snapshot_details")
        self._abort_site = self.errors.site("engine_liveness.abort_stuck")
        self._fork_site = self.errors.site(fork.SITE)  # counted in a forked child (fork.py)
        self._switch_of: dict[str, str] = {
            self._input_site.name: "input_thread",
            self._queue_site.name: "queue_watch",
            self._stamp_site.name: "stamping",
            self._progress_site.name: "progressing",
            self._details_site.name: "detailing",
            self._adopt_site.name: "adopting",
            self._abort_site.name: "aborting",
            self._answer_site.name: "answering",
            self._fork_site.name: "fork_locks",
        }
        """The flag an internal error at a site turns off."""
        self._reset()

    def _reset(self) -> None:
        self.targets: list[str] = []
        self.answers = 0
        self.answers_in_input_thread = 0
        self.engines = 0
        for flag in self._switch_of.values():
            setattr(self, flag, True)
        self._local = threading.local()
        self._busy_loop = threading.local()
        """``record``: the engine whose busy loop runs on this thread (for the DP
        collectives, which are called without the engine)."""
        self._announced = False
        self.abort_timeout = 0.0
        """The progress timeout when ``MMCACHE_FIX_ABORT_STUCK=on`` (0: the remedy is off)."""
        self.stuck_aborts = 0
        """Requests the remedy aborted in this process."""

    # -- lifecycle -----------------------------------------------------------------

    def _install(self) -> None:
        if read_mode().value == Mode.OFF:
            raise DidNotEnable("disabled by MMCACHE_FIX_MODE=off")
        self.errors.reload_faults()
        abort = read_abort_stuck()
        if abort.problem:
            log.warning("%s", abort.problem)
        if abort.value == Switch.ON:
            timeout = read_progress_timeout()
            self.abort_timeout = timeout.value
            if timeout.value == 0:
                log.warning(
                    "%s=on has no effect: the progress rule is off (its timeout is 0)",
                    ENV_ABORT_STUCK,
                )
        fork.register()

    def _uninstall(self) -> None:
        registry.revert_patch(PATCH_ID)

    def _status(self) -> dict[str, Any]:
        return {
            "targets": list(self.targets),
            "engines": self.engines,
            "answers": self.answers,
            "answers_in_input_thread": self.answers_in_input_thread,
            "input_thread": self.input_thread,
            "input_queue": self.queue_watch,
            "loop_state": self.stamping,
            "progress": self.progressing,
            "snapshot_details": self.detailing,
            "abort_stuck": bool(self.abort_timeout) and self.aborting,
            "stuck_aborts": self.stuck_aborts,
            "answer": self.answering,
            "fork_locks": self.fork_locks,
        }

    def _on_internal_error(self, where: str, exc: BaseException) -> None:
        flag = self._switch_of.get(where)
        if flag is not None:
            setattr(self, flag, False)

    def _on_import(self, name: str) -> bool:
        module = sys.modules.get(ENGINE_CORE_CLASS.module)
        core = getattr(module, ENGINE_CORE_CLASS.cls, None)
        if not isinstance(core, type):
            self.note_problem(f"{ENGINE_CORE_CLASS.module}.{ENGINE_CORE_CLASS.cls} not found")
            return True
        ping = ENGINE_PING_METHOD
        if ping in core.__dict__ and not registry.is_patched(core, ping):
            self.note_problem(f"{core.__qualname__} already has {ping}; left alone")
            return True
        if registry.apply(PATCH_ID, core, ENGINE_PING_METHOD, make_ping(self)):
            self.targets.append(f"{core.__module__}.{core.__qualname__}.{ENGINE_PING_METHOD}")
        proc = getattr(module, ENGINE_PROC_CLASS.cls, None)
        wrappers: tuple[tuple[str, Callable[[EngineLivenessAnswer, Any], Any]], ...] = (
            (BUSY_LOOP_INPUT, make_adopting_input),
            (BUSY_LOOP_STEP, make_step),
            (BUSY_LOOP_DISPATCH, make_dispatch),
        )
        missing = [attr for attr, _ in wrappers if not callable(_own(proc, attr))]
        if missing:
            # The busy loop answers the ping between steps; the API server turns its check off
            # for such an engine (it cannot tell a long step from a stuck one).
            self.note_problem(
                f"{ENGINE_PROC_CLASS.module}.{ENGINE_PROC_CLASS.cls} lacks {', '.join(missing)}: "
                "pings are answered by the busy loop only"
            )
            return True
        assert isinstance(proc, type)
        for attr, make in wrappers:
            if registry.wrap(PATCH_ID, proc, attr, functools.partial(make, self)):
                self.targets.append(f"{proc.__module__}.{proc.__qualname__}.{attr}")
        # What a pause or a sleep left for the idle loop (0.17.0+): judged as a utility call.
        if callable(_own(proc, IDLE_CALLBACKS)):
            make = functools.partial(make_idle_callbacks, self)
            if registry.wrap(PATCH_ID, proc, IDLE_CALLBACKS, make):
                self.targets.append(f"{proc.__module__}.{proc.__qualname__}.{IDLE_CALLBACKS}")
        # A client's aborts, between steps or inside one: not progress.
        if callable(_own(core, ENGINE_ABORT)):
            if registry.wrap(PATCH_ID, core, ENGINE_ABORT, functools.partial(make_aborts, self)):
                self.targets.append(f"{core.__module__}.{core.__qualname__}.{ENGINE_ABORT}")
        # A DP rank's waits for its peers: judged as a step, not as the loop stopping.
        config = getattr(module, PARALLEL_CONFIG, None)
        waits = [(config, attr, "dp all-reduce", False) for attr in DP_COLLECTIVES]
        waits.append((core, DP_DUMMY_BATCH, "dummy batch", True))
        for owner, attr, detail, method in waits:
            if not callable(_own(owner, attr)):
                continue
            assert isinstance(owner, type)
            make = functools.partial(make_sync, self, detail, method=method)
            if registry.wrap(PATCH_ID, owner, attr, make):
                self.targets.append(f"{owner.__module__}.{owner.__qualname__}.{attr}")
        return True

    # -- the busy loop ---------------------------------------------------------------

    def adopt(self, engine: Any) -> None:
        """The busy loop of ``engine`` starts: hook its input thread, keep its state."""
        if not self.adopting or ENGINE_ATTR in engine.__dict__:
            return
        with self._adopt_site:
            record = Adopted()
            registry.set_instance_attr(PATCH_ID, engine, ENGINE_ATTR, record)
            self._busy_loop.record = record  # adopted on its busy loop's thread
            queue = getattr(engine, ENGINE_INPUT_QUEUE, None)
            put = getattr(queue, "put_nowait", None)
            if callable(put) and hasattr(queue, "__dict__"):
                hook = make_put(self, weakref.ref(engine), put)
                registry.set_instance_attr(PATCH_ID, queue, "put_nowait", hook)
                record.hooked = True
                record.early_pings = queued_pings(queue)
                if callable(getattr(queue, "empty", None)):
                    record.queue = queue
            self.engines += 1
            if not self._announced:
                self._announced = True
                log.info(
                    "%s %s: EngineCore's input thread answers the /health heartbeat (%s), with "
                    "the busy loop's state",
                    ANSWER_ACTIVE,
                    process_label(),
                    ENGINE_PING_METHOD if record.hooked else "input queue not found: busy loop",
                )
        signals.ENGINE_CORE_RUNNING.send()

    def enter(self, engine: Any, state: str, detail: str = "") -> tuple[Adopted, RawPhase] | None:
        """Enter ``state`` in ``engine``'s loop (None: the engine whose busy loop runs on this
        thread); the token to give back to :meth:`leave`."""
        if not self.stamping:
            return None
        with self._stamp_site:
            if engine is None:
                record = getattr(self._busy_loop, "record", None)
            else:
                record = engine.__dict__.get(ENGINE_ATTR)
            if record is not None:
                return record, record.loop.enter(state, detail)
        return None

    def enter_request(self, engine: Any, args: tuple[Any, ...]) -> tuple[Adopted, RawPhase] | None:
        if not self.stamping or len(args) < 2:
            return None
        name = getattr(args[0], "name", None)
        if name == REQUEST_TYPE_ADD:
            return self.enter(engine, ADD)
        if name == REQUEST_TYPE_ABORT:
            return self.enter(engine, ABORT)
        if name == REQUEST_TYPE_UTILITY:
            method = ""
            with self._stamp_site:
                method = str(args[1][UTILITY_METHOD_INDEX])
            if method == ENGINE_PING_METHOD:
                return None
            return self.enter(engine, UTILITY, method)
        return None

    def leave(self, token: tuple[Adopted, RawPhase]) -> None:
        with self._stamp_site:
            record, previous = token
            record.loop.leave(previous)

    def after_request(
        self, token: tuple[Adopted, RawPhase] | None, since: float, engine: Any = None
    ) -> None:
        """An add, abort, utility call or wait for the peers returned: the progress clock
        learns of it (the time of a call or a wait does not count; after an add, how many
        requests ``engine``'s scheduler holds)."""
        if token is None or not self.progressing:
            return
        with self._progress_site:
            record = token[0]
            state = record.loop.phase.state
            now = time.monotonic()
            if state == ADD:
                scheduler = engine.__dict__.get(SCHEDULER_ATTR) if engine is not None else None
                held = getattr(scheduler, "requests", None)
                record.progress.added(now, None if held is None else len(held))
            elif state in (UTILITY, SYNC):
                record.progress.skip(now - since)

    def after_aborts(self, engine: Any) -> None:
        """``engine`` aborted requests (a client's, or the remedy's): no progress (the remedy
        restarts the clock itself). Inside a step this comes before the step's finishes."""
        if not self.progressing:
            return
        with self._progress_site:
            record = engine.__dict__.get(ENGINE_ATTR)
            scheduler = engine.__dict__.get(SCHEDULER_ATTR)
            if record is not None and scheduler is not None:
                record.progress.client_aborted(scheduler)

    def abort_stuck(self, engine: Any, record: Adopted, now: float) -> None:
        """After a step, on the busy loop's thread: at the ``no_progress`` verdict, abort the
        oldest stuck request and send its client a finish (reason abort), as vLLM does for a
        request it aborts itself. vLLM's calls are outside the guard."""
        picked: tuple[str, int, float, float] | None = None
        with self._abort_site:
            if self._abort_site.fail:
                raise InjectedFault(f"fault injected at {self._abort_site.name}")
            scheduler = engine.__dict__.get(SCHEDULER_ATTR)
            if scheduler is None:
                return
            stalled = record.progress.stalled_s(scheduler, now)
            if not due(stalled, self.abort_timeout, record.aborted_at, now):
                return
            record.aborted_at = now
            request = oldest(scheduler.requests.values())
            if request is None:
                return
            arrived = getattr(request, "arrival_time", None)
            age = time.time() - arrived if isinstance(arrived, (int, float)) else float("nan")
            client = getattr(request, "client_index", 0)
            picked = (str(request.request_id), int(client or 0), age, stalled)
        if picked is None:
            return
        request_id, client, age, stalled = picked
        engine.abort_requests([request_id])
        send = getattr(engine, "_send_abort_outputs_to_client", None)
        if callable(send):
            send([request_id], client)
        else:
            engine.output_queue.put_nowait((client, finish_output(request_id)))
        with self._abort_site:
            self.stuck_aborts += 1
            record.progress.aborted(time.monotonic())
            log.warning(
                "%s: aborted request %s (waiting %.1f s): no net progress for %.1f s while it "
                "waited (zero-token livelock); its client gets finish_reason 'abort', the other "
                "requests go on; the next abort of this engine at the earliest in %g s",
                ENV_ABORT_STUCK,
                request_id,
                age,
                stalled,
                ABORT_INTERVAL_S,
            )

    # -- the input thread ------------------------------------------------------------

    def answer_in_input_thread(self, engine: Any, item: Any) -> None:
        """Run vLLM's own dispatch for the ping ``item`` here, in the input thread."""
        self._local.in_input_thread = True
        try:
            dispatch = getattr(engine, BUSY_LOOP_DISPATCH)
            dispatch(*item)
        except Exception as exc:
            # Never queued again for the busy loop: vLLM may already have answered it, and a
            # second answer to one call breaks the client. From now on the busy loop answers.
            self.errors.record(self._input_site.name, exc)
        finally:
            self._local.in_input_thread = False

    def queueing(self, engine: Any) -> None:
        """The input thread is about to queue a request (not a ping): if the queue is empty,
        the busy loop's wait for it starts now."""
        if not self.queue_watch:
            return
        with self._queue_site:
            record = engine.__dict__.get(ENGINE_ATTR)
            if record is not None:
                note_first_put(record)

    def answer(self, engine: Any) -> dict[str, Any]:
        """The ping's answer: never raises (vLLM would log a traceback per ping)."""
        via_input = bool(getattr(self._local, "in_input_thread", False))
        reply: dict[str, Any] = {
            "schema": ANSWER_SCHEMA,
            "pid": os.getpid(),
            "via": VIA_INPUT_THREAD if via_input else VIA_BUSY_LOOP,
        }
        if not self.answering:
            return reply
        with self._answer_site:
            self.answers += 1
            self.answers_in_input_thread += via_input
            record = engine.__dict__.get(ENGINE_ATTR)
            reply["input_thread"] = bool(record is not None and record.hooked and self.input_thread)
            if not via_input and record is not None and record.early_pings > 0:
                record.early_pings -= 1
                reply[KEY_QUEUED_BEFORE_HOOK] = True
            if record is not None and self.stamping:
                reply["loop"] = record.loop.snapshot()
            scheduler = getattr(engine, SCHEDULER_ATTR, None)
            if record is not None and self.progressing and scheduler is not None:
                reply["progress"] = progress = progress_snapshot(
                    record, scheduler, via_input and self.queue_watch
                )
                if self.detailing and stall_building(record, progress):
                    with self._details_site:
                        reply[KEY_DETAILS] = engine_details(engine, scheduler)
            reply["counts"] = dict(self.counts())
        return reply


def queued_pings(queue: Any) -> int:
    """The pings waiting in ``queue`` (a ``queue.Queue``; 0 for anything else). Counted after
    the hook is in place: every ping queued from then on is answered by the hook instead."""
    mutex, items = getattr(queue, "mutex", None), getattr(queue, "queue", None)
    if mutex is None or items is None:
        return 0
    with mutex:
        return sum(1 for item in list(items) if is_ping(item))


def note_first_put(record: Adopted) -> None:
    """Before the input thread queues a request: on an empty queue, the wait starts now."""
    queue = record.queue
    if queue is not None and queue.empty():
        record.queued_since = time.monotonic()


def queued_s(record: Adopted, phase: Phase, now: float) -> float:
    """Seconds the input queue has held requests the busy loop does not take: counted only
    while the loop is idle (outside every step, add, abort and utility call), from the later
    of the first put on the empty queue and the loop's last change of phase. A healthy idle
    loop waits in the queue's ``get`` and takes a request within milliseconds; one blocked
    before it takes its input (a DP rank waiting outside a step before it took a request)
    lets the request wait here, where the scheduler does not see it."""
    queue = record.queue
    if phase.state != IDLE or queue is None or queue.empty():
        return 0.0
    return max(0.0, now - max(record.queued_since, phase.since))


def progress_snapshot(record: Adopted, scheduler: Any, count_queue: bool = True) -> dict[str, Any]:
    """The progress figures the answer carries (read from the input thread). ``count_queue``
    False: the input queue's wait is not counted (the busy loop answers, so it is taking its
    queue; or the input thread's note of the first put broke)."""
    phase = record.loop.phase
    now = time.monotonic()
    # Inside a step or a utility call the clock stops at its start: a step counts only past
    # the step bound, a utility call not at all.
    until = phase.since if phase.state in (STEP, UTILITY, SYNC) else now
    progress = record.progress
    queued = queued_s(record, phase, now) if count_queue else 0.0
    return {
        # Requests in the scheduler without net progress, or in the input queue untaken.
        "stalled_s": max(progress.stalled_s(scheduler, until), queued),
        "queued_s": queued,
        "empty_steps": progress.empty_steps,
        "steps": progress.steps,
        "step_counts": list(progress.step_counts),
        "step_sum": progress.step_sum,
        "recent_steps_s": [round(d, 6) for d in progress.recent_steps()],
    }


def stall_building(record: Adopted, progress: dict[str, Any]) -> bool:
    """Whether this answer carries the snapshot's details: no net progress, or one step,
    add or abort, for :data:`DETAIL_AFTER_S` (a healthy engine's answers stay small)."""
    stalled = progress.get("stalled_s")
    if isinstance(stalled, float) and stalled >= DETAIL_AFTER_S:
        return True
    phase = record.loop.phase
    return phase.state in STUCK_STATES and time.monotonic() - phase.since >= DETAIL_AFTER_S


def _own(cls: Any, attr: str) -> Any:
    return cls.__dict__.get(attr) if isinstance(cls, type) else None


def make_ping(fix: EngineLivenessAnswer) -> Callable[[Any], dict[str, Any]]:
    def mmcache_fix_ping(self: Any) -> dict[str, Any]:
        return fix.answer(self)

    return mmcache_fix_ping


def make_put(
    fix: EngineLivenessAnswer, engine_ref: Callable[[], Any], original: Callable[[Any], None]
) -> Callable[[Any], None]:
    def put_nowait(item: Any) -> None:
        if fix.input_thread:
            engine = engine_ref()
            if engine is not None:
                if is_ping(item):
                    fix.answer_in_input_thread(engine, item)
                    return
                fix.queueing(engine)
        original(item)

    return put_nowait


def make_adopting_input(fix: EngineLivenessAnswer, original: Any) -> Any:
    def _process_input_queue(self: Any, *args: Any, **kwargs: Any) -> Any:
        if fix.adopting and ENGINE_ATTR not in self.__dict__:
            fix.adopt(self)
        return original(self, *args, **kwargs)

    return _process_input_queue


def make_step(fix: EngineLivenessAnswer, original: Any) -> Any:
    """The busy loop's state around each step, then net progress after it. Every step runs
    this, so it is written flat (no helper calls on the way: ``scripts/bench-step`` holds it
    to 2 µs); the plugin's work is guarded by ``try`` blocks (free in CPython 3.11 when
    nothing raises) and vLLM's own call is outside them."""
    monotonic = time.monotonic
    stamp_site = fix._stamp_site
    progress_site = fix._progress_site

    def _process_engine_step(self: Any, *args: Any, **kwargs: Any) -> Any:
        record = self.__dict__.get(ENGINE_ATTR) if fix.stamping else None
        if record is None:
            return original(self, *args, **kwargs)
        loop = record.loop
        previous = loop.raw
        try:
            started = monotonic()
            loop.raw = (STEP, "", started)
            if stamp_site.fail:
                raise InjectedFault(f"fault injected at {stamp_site.name}")
        except Exception as exc:
            fix.errors.record(stamp_site.name, exc)
            return original(self, *args, **kwargs)
        try:
            # vLLM calls it without arguments: a plain call costs 0.1 µs less than one that
            # unpacks them.
            result = original(self, *args, **kwargs) if args or kwargs else original(self)
        finally:
            now = monotonic()
            loop.raw = (IDLE, "", now) if previous[0] == IDLE else previous
        if fix.progressing:
            try:
                record.progress.after_step(self.__dict__.get(SCHEDULER_ATTR), now, started)
                if progress_site.fail:
                    raise InjectedFault(f"fault injected at {progress_site.name}")
            except Exception as exc:
                fix.errors.record(progress_site.name, exc)
        return result

    if fix.abort_timeout <= 0:
        return _process_engine_step
    step = _process_engine_step

    timeout = fix.abort_timeout
    abort_site = fix._abort_site

    def _process_engine_step_abort_stuck(self: Any, *args: Any, **kwargs: Any) -> Any:
        # Only with MMCACHE_FIX_ABORT_STUCK=on: after each step, a flat check of the clock
        # (plain reads); the full verdict and the abort only once it may be due.
        result = step(self, *args, **kwargs)
        if fix.aborting:
            record = self.__dict__.get(ENGINE_ATTR)
            if record is not None:
                try:
                    progress = record.progress
                    now = monotonic()
                    maybe = (
                        progress.work
                        and now - progress.since >= timeout
                        and now - record.aborted_at >= ABORT_INTERVAL_S
                    )
                except Exception as exc:
                    fix.errors.record(abort_site.name, exc)
                    maybe = False
                if maybe:
                    fix.abort_stuck(self, record, now)
        return result

    return _process_engine_step_abort_stuck


def make_phase(
    fix: EngineLivenessAnswer, state: str, detail: str, original: Any, method: bool
) -> Any:
    """vLLM's call ``original`` as the busy loop's ``state`` (``detail``) while it lasts; its
    time does not count against progress after it. ``method``: the engine is its first
    argument (else the engine whose busy loop runs on this thread). vLLM's call is outside
    the guarded parts."""

    def in_phase(*args: Any, **kwargs: Any) -> Any:
        token = fix.enter(args[0] if method and args else None, state, detail)
        try:
            return original(*args, **kwargs)
        finally:
            if token is not None:
                fix.after_request(token, token[0].loop.phase.since)
                fix.leave(token)

    return in_phase


def make_sync(fix: EngineLivenessAnswer, detail: str, original: Any, method: bool) -> Any:
    """A DP rank's wait for its peers: the all-reduce (``ParallelConfig``'s static method,
    called every few turns, on the busy loop's thread) or a dummy batch (``method``: the
    engine is its first argument), as a ``sync`` phase."""
    return make_phase(fix, SYNC, detail, original, method)


def make_aborts(fix: EngineLivenessAnswer, original: Any) -> Any:
    """``EngineCore.abort_requests``: the progress clock learns of the aborts after vLLM's
    call (outside the guarded part). Called only when there is something to abort: no cost
    per step."""

    def abort_requests(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        fix.after_aborts(self)
        return result

    return abort_requests


def make_idle_callbacks(fix: EngineLivenessAnswer, original: Any) -> Any:
    """``EngineCoreProc._notify_idle_state_callbacks``: when callbacks wait (a pause's or a
    sleep's deferred work), the loop is in a utility call named ``idle callbacks`` meanwhile:
    a request queued behind it is not a loop that stopped taking input, and its time does
    not count against progress. With no callback waiting, vLLM's call alone."""
    in_utility = make_phase(fix, UTILITY, IDLE_CALLBACKS_DETAIL, original, method=True)

    def _notify_idle_state_callbacks(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not self.__dict__.get(IDLE_CALLBACK_LIST):
            return original(self, *args, **kwargs)
        return in_utility(self, *args, **kwargs)

    return _notify_idle_state_callbacks


def make_dispatch(fix: EngineLivenessAnswer, original: Any) -> Any:
    def _handle_client_request(self: Any, *args: Any, **kwargs: Any) -> Any:
        token = fix.enter_request(self, args)
        try:
            result = original(self, *args, **kwargs)
        finally:
            if token is not None:
                fix.after_request(token, token[0].loop.phase.since, self)
                fix.leave(token)
        return result

    return _handle_client_request
