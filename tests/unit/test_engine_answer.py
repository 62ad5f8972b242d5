"""EngineCore's side of the heartbeat, as pure logic (stand-in engine, real queues).

The same code runs against vLLM's real ``EngineCoreProc`` in tests/installed and in real
servers in tests/e2e.
"""

from __future__ import annotations

import enum
import queue
import sys
import threading
import time
from typing import Any

from vllm_mmcache_fix.engine_liveness import answer as answer_mod
from vllm_mmcache_fix.engine_liveness.answer import EngineLivenessAnswer, is_ping
from vllm_mmcache_fix.engine_liveness.busy_loop import (
    ADD,
    IDLE,
    STEP,
    SYNC,
    UTILITY,
    LoopState,
    Phase,
)


class RequestType(enum.Enum):
    ADD = b"\x00"
    ABORT = b"\x01"
    UTILITY = b"\x03"
    WAKEUP = b"\x05"


PING = (RequestType.UTILITY, [0, 7, "mmcache_fix_ping", []])


class Engine:
    """Dispatches utility calls as vLLM's ``_handle_client_request`` does."""

    def __init__(self) -> None:
        self.input_queue: queue.Queue[Any] = queue.Queue()
        self.output_queue: queue.Queue[Any] = queue.Queue()
        self.dispatched: list[tuple[Any, str]] = []

    def _handle_client_request(self, request_type: Any, request: Any) -> None:
        self.dispatched.append((request_type, threading.current_thread().name))
        if request_type is RequestType.UTILITY:
            client, call_id, method, args = request
            self.output_queue.put_nowait((client, call_id, getattr(self, method)(*args)))


def _fix(counts: Any = lambda: {"protected": 1}) -> EngineLivenessAnswer:
    fix = EngineLivenessAnswer(counts)
    fix.attempted = fix.enabled = True
    Engine.mmcache_fix_ping = answer_mod.make_ping(fix)  # type: ignore[attr-defined]
    return fix


def test_loop_state_nests_and_keeps_the_outer_start() -> None:
    state = LoopState()
    outer = state.enter(STEP)
    started = state.phase.since
    inner = state.enter(UTILITY, "reset_prefix_cache")
    assert state.snapshot()["state"] == UTILITY
    state.leave(inner)
    assert state.phase.state == STEP and state.phase.since == started
    state.leave(outer)
    snap = state.snapshot()
    assert snap["state"] == IDLE and snap["for_s"] >= 0


def test_only_the_ping_is_recognised() -> None:
    assert is_ping(PING)
    assert is_ping((RequestType.UTILITY, ("x", 1, "mmcache_fix_ping", ())))
    assert not is_ping((RequestType.UTILITY, [0, 8, "get_supported_tasks", []]))
    assert not is_ping((RequestType.ADD, ("req", 0)))
    assert not is_ping((RequestType.WAKEUP, None))
    assert not is_ping(b"ENGINE_CORE_DEAD")
    assert not is_ping(None)


def test_the_input_thread_answers_the_ping_and_passes_everything_else_on() -> None:
    fix = _fix()
    engine = Engine()
    fix.adopt(engine)
    wrapped = answer_mod.make_dispatch(fix, Engine._handle_client_request)
    engine._handle_client_request = wrapped.__get__(engine)  # type: ignore[method-assign]
    done = threading.Event()

    def input_thread() -> None:  # what vLLM's process_input_sockets does
        engine.input_queue.put_nowait(PING)
        engine.input_queue.put_nowait((RequestType.ADD, ("req", 0)))
        done.set()

    threading.Thread(target=input_thread, name="input").start()
    done.wait(5)
    client, call_id, reply = engine.output_queue.get_nowait()
    assert (client, call_id) == (0, 7)
    assert reply["via"] == "input thread" and reply["input_thread"] is True
    assert reply["loop"]["state"] == IDLE and reply["counts"] == {"protected": 1}
    assert engine.dispatched == [(RequestType.UTILITY, "input")]  # answered there, not queued
    assert engine.input_queue.get_nowait() == (RequestType.ADD, ("req", 0))
    assert engine.input_queue.empty()
    assert fix.answers_in_input_thread == 1


def test_the_answer_says_what_the_busy_loop_does() -> None:
    fix = _fix()
    engine = Engine()
    fix.adopt(engine)
    step = answer_mod.make_step(fix, lambda self: self.input_queue.put_nowait(PING) or True)
    assert step(engine) is True  # the ping arrives while the step runs
    reply = engine.output_queue.get_nowait()[2]
    assert reply["loop"]["state"] == STEP
    dispatch = answer_mod.make_dispatch(fix, lambda self, t, r: self.input_queue.put_nowait(PING))
    dispatch(engine, RequestType.UTILITY, [0, 9, "collective_rpc", []])
    reply = engine.output_queue.get_nowait()[2]
    assert reply["loop"]["state"] == UTILITY and reply["loop"]["detail"] == "collective_rpc"
    engine.input_queue.put_nowait(PING)
    assert engine.output_queue.get_nowait()[2]["loop"]["state"] == IDLE


def test_the_step_wrapper_passes_vllms_arguments_through() -> None:
    """vLLM calls its step without arguments (the wrapper then calls it plainly); one that
    took some would get them all, positional and keyword, adopted engine or not."""
    fix = _fix()
    calls: list[tuple[Any, ...]] = []

    def original(self: Any, *args: Any, **kwargs: Any) -> bool:
        calls.append((args, kwargs))
        return True

    step = answer_mod.make_step(fix, original)
    adopted, other = Engine(), Engine()
    fix.adopt(adopted)
    for engine in (adopted, other):
        assert step(engine) is True
        assert step(engine, 1, budget=2) is True
    assert calls == [((), {}), ((1,), {"budget": 2})] * 2
    progress = adopted.__dict__[answer_mod.ENGINE_ATTR].progress
    assert progress.timed == 2  # both steps of the adopted engine were timed


def test_an_engine_never_adopted_answers_from_its_busy_loop_and_says_so() -> None:
    _fix()
    engine = Engine()
    reply = engine.mmcache_fix_ping()  # type: ignore[attr-defined]
    assert reply["via"] == "busy loop" and reply["input_thread"] is False
    assert "loop" not in reply


def test_pings_queued_before_the_hook_are_answered_by_the_busy_loop_and_say_so() -> None:
    """The API server's first pings can reach the input queue before the busy loop adopts the
    engine: the busy loop answers exactly those with ``queued_before_hook``; later pings are
    answered in the input thread, and one the busy loop gets past the hook is not marked."""
    fix = _fix()
    engine = Engine()
    engine.input_queue.put_nowait(PING)
    engine.input_queue.put_nowait((RequestType.ADD, "r"))
    engine.input_queue.put_nowait(PING)
    fix.adopt(engine)
    replies = []
    while not engine.input_queue.empty():  # the busy loop drains what was queued
        engine._handle_client_request(*engine.input_queue.get_nowait())
    while not engine.output_queue.empty():
        replies.append(engine.output_queue.get_nowait()[2])
    assert [(r["via"], r.get("queued_before_hook")) for r in replies] == [("busy loop", True)] * 2
    engine.input_queue.put_nowait(PING)  # hooked: answered in the input thread
    later = engine.output_queue.get_nowait()[2]
    assert later["via"] == "input thread" and "queued_before_hook" not in later
    # A ping that reaches the busy loop some other way (its queue replaced): not marked.
    engine._handle_client_request(*PING)
    lost = engine.output_queue.get_nowait()[2]
    assert lost["via"] == "busy loop" and lost["input_thread"] is True
    assert "queued_before_hook" not in lost


def test_the_answer_never_raises() -> None:
    def broken() -> dict[str, int]:
        raise RuntimeError("counts broke")

    fix = _fix(broken)
    engine = Engine()
    fix.adopt(engine)
    reply = engine.mmcache_fix_ping()  # type: ignore[attr-defined]
    assert reply["schema"] == 2 and "counts" not in reply
    assert fix.errors.total == 1


def test_a_dispatch_that_raises_in_the_input_thread_is_never_queued_twice() -> None:
    """vLLM may have answered before raising: a second answer to one call would break the
    client. The ping is dropped (the API server's confirming ping is answered by the busy loop
    from then on)."""
    fix = _fix()
    engine = Engine()

    def broken(request_type: Any, request: Any) -> None:
        raise RuntimeError("dispatch broke")

    fix.adopt(engine)
    engine._handle_client_request = broken  # type: ignore[method-assign]
    engine.input_queue.put_nowait(PING)
    assert engine.input_queue.empty()
    assert fix.input_thread is False and fix.errors.total == 1
    engine.input_queue.put_nowait(PING)  # now for the busy loop
    assert engine.input_queue.get_nowait() == PING


class Scheduler:  # vLLM's attribute names; nothing waits in it
    def __init__(self) -> None:
        self.requests: dict[str, Any] = {}
        self.waiting: list[Any] = []
        self.running: list[Any] = []


def _queued_engine() -> tuple[EngineLivenessAnswer, Engine, answer_mod.Adopted]:
    fix = _fix()
    engine = Engine()
    engine.scheduler = Scheduler()  # type: ignore[attr-defined]
    fix.adopt(engine)
    record = engine.__dict__[answer_mod.ENGINE_ATTR]
    return fix, engine, record


def _ping(engine: Engine) -> dict[str, Any]:
    engine.input_queue.put_nowait(PING)
    return engine.output_queue.get_nowait()[2]["progress"]


def test_a_request_the_busy_loop_does_not_take_counts_as_no_progress() -> None:
    """The scheduler is empty, the request is still in the input queue: the figure is the
    time since it was put (the loop idle since before), and only while the loop is idle."""
    fix, engine, record = _queued_engine()
    assert _ping(engine)["queued_s"] == 0.0  # nothing queued
    engine.input_queue.put_nowait((RequestType.ADD, ("req", 0)))
    put_at = record.queued_since
    engine.input_queue.put_nowait((RequestType.ADD, ("req2", 0)))
    assert record.queued_since == put_at  # the wait began at the first put
    now = time.monotonic()
    record.queued_since = now - 50.0  # the request has waited 50 s
    record.loop.phase = Phase(IDLE, "", now - 100.0)
    progress = _ping(engine)
    assert 50.0 <= progress["queued_s"] < 55.0
    assert progress["stalled_s"] == progress["queued_s"]
    # The loop changed phase 5 s ago (it took something): the wait counts from then.
    record.loop.phase = Phase(IDLE, "", time.monotonic() - 5.0)
    assert 5.0 <= _ping(engine)["queued_s"] < 10.0
    # Inside a utility call (healthy however long), a step (its own bound) or an add: 0.
    for state in (UTILITY, STEP, ADD):
        record.loop.phase = Phase(state, "x", now - 100.0)
        assert _ping(engine)["queued_s"] == 0.0, state
    # Taken: nothing waits.
    record.loop.phase = Phase(IDLE, "", now - 100.0)
    while not engine.input_queue.empty():
        engine.input_queue.get_nowait()
    assert _ping(engine)["queued_s"] == 0.0
    engine.input_queue.put_nowait((RequestType.ADD, ("req3", 0)))
    assert time.monotonic() - record.queued_since < 1.0  # the empty queue's first put
    assert fix.errors.total == 0


def test_the_busy_loop_answering_never_counts_its_own_queue() -> None:
    """Pings answered by the busy loop (input-thread answering off): the loop is draining its
    queue at that moment, so nothing is said to wait there."""
    fix, engine, record = _queued_engine()
    engine.input_queue.put_nowait((RequestType.ADD, ("req", 0)))
    record.queued_since = 0.0
    record.loop.phase = Phase(IDLE, "", 0.0)
    reply = engine.mmcache_fix_ping()  # type: ignore[attr-defined]
    assert reply["via"] == "busy loop" and reply["progress"]["queued_s"] == 0.0


def test_a_broken_queue_check_leaves_requests_flowing() -> None:
    fix, engine, record = _queued_engine()

    class Broken(queue.Queue):  # type: ignore[type-arg]
        def empty(self) -> bool:
            raise RuntimeError("empty broke")

    record.queue = Broken()
    record.queued_since = 0.0
    engine.input_queue.put_nowait((RequestType.ADD, ("req", 0)))
    assert fix.errors.total == 1 and fix.queue_watch is False
    assert fix.input_thread is True  # pings are still answered in the input thread
    record.loop.phase = Phase(IDLE, "", 0.0)
    assert _ping(engine)["queued_s"] == 0.0  # a figure it can no longer keep is not given
    assert engine.input_queue.get_nowait() == (RequestType.ADD, ("req", 0))


def test_a_healthy_busy_loop_keeps_the_queue_wait_near_zero_under_contention() -> None:
    """Two threads as in EngineCore: the input thread queues requests and pings; the busy
    loop takes each request (an add phase) and waits in ``get`` between them; a 1 µs switch
    interval. No answer says a request waited more than a second. Then the loop stops
    taking its queue: the answers' figure grows past a second."""
    fix, engine, record = _queued_engine()
    dispatch = answer_mod.make_dispatch(fix, lambda self, t, r: None)
    stop = threading.Event()
    blocked = threading.Event()

    def busy_loop() -> None:
        while not stop.is_set():
            if blocked.is_set():
                time.sleep(0.01)
                continue
            try:
                item = engine.input_queue.get(timeout=0.05)
            except queue.Empty:
                continue
            dispatch(engine, *item)

    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    loop = threading.Thread(target=busy_loop, name="busy-loop")
    loop.start()
    try:
        worst = 0.0
        end = time.monotonic() + 2.0
        n = 0
        while time.monotonic() < end:
            engine.input_queue.put_nowait((RequestType.ADD, (f"r{n}", 0)))
            n += 1
            worst = max(worst, _ping(engine)["queued_s"])
        assert n > 100 and worst < 1.0, (n, worst)
        blocked.set()
        time.sleep(0.1)
        engine.input_queue.put_nowait((RequestType.ADD, ("stuck", 0)))
        time.sleep(1.2)
        assert _ping(engine)["queued_s"] >= 1.0
        assert fix.errors.total == 0
    finally:
        stop.set()
        loop.join(5)
        sys.setswitchinterval(before)


def test_a_dp_rank_waiting_for_its_peers_says_so_and_its_wait_is_not_lost_progress() -> None:
    """While the all-reduce (``ParallelConfig``'s collective, called without the engine, on
    the busy loop's thread) or a dummy batch waits, the answer says ``sync`` and a request in
    the input queue is not counted (the rank takes it right after); once it returns, the
    wait is skipped by the progress clock, as a utility call is."""
    fix, engine, record = _queued_engine()  # adopted on this thread: the busy loop's
    seen: dict[str, Any] = {}

    def all_reduce(dp_group: Any, has_unfinished: bool) -> bool:
        record.queued_since = time.monotonic() - 500.0
        engine.input_queue.put_nowait((RequestType.ADD, ("req", 0)))
        engine.input_queue.put_nowait(PING)
        seen["during"] = engine.output_queue.get_nowait()[2]
        time.sleep(0.05)  # the peers' step
        return has_unfinished

    record.progress.work = True
    record.progress.since = since = time.monotonic() - 10.0
    sync = answer_mod.make_sync(fix, "dp all-reduce", all_reduce, method=False)
    started = time.monotonic()
    assert sync(object(), True) is True
    took = time.monotonic() - started
    loop, progress = seen["during"]["loop"], seen["during"]["progress"]
    assert loop["state"] == SYNC and loop["detail"] == "dp all-reduce", loop
    assert progress["queued_s"] == 0.0, progress
    assert record.loop.phase.state == IDLE  # back to idle after it
    assert record.progress.since >= since + 0.05 and record.progress.since <= since + took
    # A dummy batch: the engine is its first argument.
    dummy = answer_mod.make_sync(
        fix, "dummy batch", lambda self: self.mmcache_fix_ping()["loop"], method=True
    )
    got = dummy(engine)
    assert got["state"] == SYNC and got["detail"] == "dummy batch", got
    # Called on another thread than the busy loop's: nothing of this engine changes.
    before = record.progress.since
    other: list[Any] = []
    thread = threading.Thread(target=lambda: other.append(sync(object(), False)))
    thread.start()
    thread.join(5)
    assert other == [False] and record.progress.since == before
    assert seen["during"]["loop"]["state"] == IDLE  # its ping inside saw the loop idle
    assert fix.errors.total == 0
