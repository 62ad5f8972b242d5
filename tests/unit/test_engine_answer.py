"""EngineCore's side of the heartbeat, as pure logic (stand-in engine, real queues).

The same code runs against vLLM's real ``EngineCoreProc`` in tests/installed and in real
servers in tests/e2e.
"""

from __future__ import annotations

import enum
import queue
import threading
from typing import Any

from vllm_mmcache_fix.engine_liveness import answer as answer_mod
from vllm_mmcache_fix.engine_liveness.answer import EngineLivenessAnswer, is_ping
from vllm_mmcache_fix.engine_liveness.busy_loop import IDLE, STEP, UTILITY, LoopState


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


def test_an_engine_never_adopted_answers_from_its_busy_loop_and_says_so() -> None:
    _fix()
    engine = Engine()
    reply = engine.mmcache_fix_ping()  # type: ignore[attr-defined]
    assert reply["via"] == "busy loop" and reply["input_thread"] is False
    assert "loop" not in reply


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
