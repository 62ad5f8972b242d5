"""The optional remedy for a zero-token livelock (``MMCACHE_FIX_ABORT_STUCK``), as pure logic:
when to abort (the verdict, the rate limit), which request (the oldest stuck one), what vLLM
is asked to do (abort it and send its client a finish), off by default, bad values. A
stand-in engine and scheduler with vLLM's names; real servers: tests/e2e/test_e2e_abort_stuck.py.
"""

from __future__ import annotations

import enum
import logging
import math
import time
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_mmcache_fix.core.settings import (
    ENV_ABORT_STUCK,
    ENV_PROGRESS_TIMEOUT,
    Switch,
    read_abort_stuck,
)
from vllm_mmcache_fix.engine_liveness import answer as answer_mod
from vllm_mmcache_fix.engine_liveness.answer import ENGINE_ATTR, EngineLivenessAnswer
from vllm_mmcache_fix.engine_liveness.progress import HWM_ATTR
from vllm_mmcache_fix.engine_liveness.remedy import ABORT_INTERVAL_S, due, oldest

TIMEOUT = 30.0


class Status(enum.Enum):
    WAITING = 1
    RUNNING = 2
    WAITING_FOR_REMOTE_KVS = 3
    FINISHED_ABORTED = 4


class Request:
    def __init__(self, rid: str, arrival: float, status: Status = Status.RUNNING) -> None:
        self.request_id = rid
        self.arrival_time = arrival
        self.status = status
        self.client_index = 1
        self.num_computed_tokens = 0


class Scheduler:
    def __init__(self, *requests: Request) -> None:
        self.requests = {r.request_id: r for r in requests}
        self.running = [r for r in requests if r.status is Status.RUNNING]
        self.waiting: list[Request] = []

    def finish(self, rid: str) -> None:
        request = self.requests.pop(rid)
        if request in self.running:
            self.running.remove(request)


class Engine:
    """vLLM's names: ``scheduler``, ``abort_requests``, ``_send_abort_outputs_to_client``."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.sent: list[tuple[list[str], int]] = []
        self.steps = 0

    def abort_requests(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.scheduler.finish(rid)

    def _send_abort_outputs_to_client(self, req_ids: list[str], client_index: int) -> None:
        self.sent.append((list(req_ids), client_index))

    def _process_engine_step(self) -> bool:
        self.steps += 1
        return True


def _fix(monkeypatch: pytest.MonkeyPatch, setting: str | None) -> EngineLivenessAnswer:
    if setting is None:
        monkeypatch.delenv(ENV_ABORT_STUCK, raising=False)
    else:
        monkeypatch.setenv(ENV_ABORT_STUCK, setting)
    monkeypatch.setenv(ENV_PROGRESS_TIMEOUT, f"{TIMEOUT:g}")
    fix = EngineLivenessAnswer(lambda: {})
    fix._install()
    return fix


def _stuck_engine(fix: EngineLivenessAnswer, *requests: Request) -> tuple[Engine, Any]:
    """An adopted engine whose work has waited, without net progress, for 100 s."""
    engine = Engine(Scheduler(*requests))
    fix.adopt(engine)
    record = engine.__dict__[ENGINE_ATTR]
    progress = record.progress
    progress.work, progress.usable = True, True
    progress.requests = len(engine.scheduler.requests)
    progress.since = time.monotonic() - 100.0
    for request in engine.scheduler.running:
        request.__dict__[HWM_ATTR] = request.num_computed_tokens
    return engine, record


# -- the setting ---------------------------------------------------------------------


def test_off_by_default_and_bad_values_say_why() -> None:
    assert read_abort_stuck({}).value == Switch.OFF and read_abort_stuck({}).problem is None
    assert read_abort_stuck({ENV_ABORT_STUCK: " ON "}).value == Switch.ON
    bad = read_abort_stuck({ENV_ABORT_STUCK: "yes please"})
    assert bad.value == Switch.OFF
    assert bad.problem is not None and ENV_ABORT_STUCK in bad.problem
    assert "'yes please'" in bad.problem and "off|on" in bad.problem


def test_a_bad_value_is_logged_and_leaves_the_remedy_off(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="vllm"):
        fix = _fix(monkeypatch, "1")
    assert fix.abort_timeout == 0
    assert any(ENV_ABORT_STUCK in r.getMessage() for r in caplog.records)


def test_off_the_step_wrapper_is_the_plain_one(monkeypatch: pytest.MonkeyPatch) -> None:
    off = _fix(monkeypatch, None)
    assert answer_mod.make_step(off, Engine._process_engine_step).__name__ == (
        "_process_engine_step"
    )
    on = _fix(monkeypatch, "on")
    assert on.abort_timeout == TIMEOUT
    wrapped = answer_mod.make_step(on, Engine._process_engine_step)
    assert wrapped.__name__ == "_process_engine_step_abort_stuck"


def test_off_a_livelocked_engine_keeps_its_request(monkeypatch: pytest.MonkeyPatch) -> None:
    fix = _fix(monkeypatch, "off")
    engine, _ = _stuck_engine(fix, Request("a", 1.0))
    step = answer_mod.make_step(fix, Engine._process_engine_step)
    for _ in range(5):
        step(engine)
    assert engine.steps == 5 and "a" in engine.scheduler.requests and not engine.sent


# -- when and which ------------------------------------------------------------------


@given(
    stalled=st.floats(0, 1000),
    timeout=st.floats(30, 600),
    since_last=st.floats(0, 1000),
)
def test_due_only_at_the_verdict_and_once_per_interval(
    stalled: float, timeout: float, since_last: float
) -> None:
    now = 5000.0
    expected = stalled >= timeout and since_last >= ABORT_INTERVAL_S
    assert due(stalled, timeout, now - since_last, now) is expected
    assert due(stalled, timeout, -math.inf, now) is (stalled >= timeout)
    assert not due(stalled, 0.0, -math.inf, now)  # the progress rule off


def test_the_oldest_stuck_request_is_chosen() -> None:
    requests = [
        Request("new", 30.0),
        Request("remote-kv", 1.0, Status.WAITING_FOR_REMOTE_KVS),
        Request("done", 2.0, Status.FINISHED_ABORTED),
        Request("old", 10.0, Status.WAITING),
        Request("mid", 20.0),
    ]
    assert oldest(requests).request_id == "old"  # type: ignore[union-attr]
    assert oldest([requests[1], requests[2]]) is None
    assert oldest([]) is None


# -- what happens --------------------------------------------------------------------


def test_on_the_oldest_is_aborted_its_client_told_counted_and_logged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    fix = _fix(monkeypatch, "on")
    now = time.time()
    engine, record = _stuck_engine(fix, Request("young", now - 5), Request("stuck", now - 95))
    step = answer_mod.make_step(fix, Engine._process_engine_step)
    with caplog.at_level(logging.WARNING, logger="vllm"):
        step(engine)
    assert list(engine.scheduler.requests) == ["young"]  # the other request goes on
    assert engine.sent == [(["stuck"], 1)]  # a finish to the request's own client
    assert fix.stuck_aborts == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "stuck" in warnings[0] and "waiting 9" in warnings[0]
    assert "no net progress" in warnings[0]
    # The clock restarted: the remaining request is not judged at once.
    assert record.progress.stalled_s(engine.scheduler, time.monotonic()) < 5.0


def test_at_most_one_abort_per_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    fix = _fix(monkeypatch, "on")
    now = time.time()
    engine, record = _stuck_engine(fix, Request("a", now - 50), Request("b", now - 40))
    step = answer_mod.make_step(fix, Engine._process_engine_step)
    step(engine)
    record.progress.since = time.monotonic() - 100.0  # stuck again at once
    for _ in range(10):
        step(engine)
    assert fix.stuck_aborts == 1 and list(engine.scheduler.requests) == ["b"]
    record.aborted_at -= ABORT_INTERVAL_S  # five minutes later
    record.progress.since = time.monotonic() - 100.0
    step(engine)
    assert fix.stuck_aborts == 2 and not engine.scheduler.requests


def test_no_abort_before_the_verdict(monkeypatch: pytest.MonkeyPatch) -> None:
    fix = _fix(monkeypatch, "on")
    engine, record = _stuck_engine(fix, Request("a", time.time() - 29))
    record.progress.since = time.monotonic() - (TIMEOUT - 2.0)
    step = answer_mod.make_step(fix, Engine._process_engine_step)
    step(engine)
    assert fix.stuck_aborts == 0 and "a" in engine.scheduler.requests


def test_an_internal_error_switches_the_remedy_off_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    fix = _fix(monkeypatch, "on")
    fix.errors.reload_faults(frozenset({"engine_liveness.abort_stuck"}))
    engine, _ = _stuck_engine(fix, Request("a", time.time() - 99))
    step = answer_mod.make_step(fix, Engine._process_engine_step)
    for _ in range(3):
        assert step(engine) is True  # vLLM's step goes on
    assert engine.steps == 3 and "a" in engine.scheduler.requests
    assert fix.aborting is False and fix.errors.total == 1


class EngineWithoutSender(Engine):
    """A release without ``_send_abort_outputs_to_client``: the finish goes on the output
    queue as ``(client_index, outputs)``."""

    _send_abort_outputs_to_client = None  # type: ignore[assignment]

    def __init__(self, scheduler: Scheduler) -> None:
        super().__init__(scheduler)
        self.output_queue: Any = None


def test_without_vllms_sender_the_finish_goes_on_the_output_queue(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fix = _fix(monkeypatch, "on")
    monkeypatch.setattr(answer_mod, "finish_output", lambda rid: ("finish", rid))
    engine = EngineWithoutSender(Scheduler(Request("stuck", time.time() - 60)))

    class Queue(list):  # vLLM's output queue: put_nowait
        def put_nowait(self, item: Any) -> None:
            self.append(item)

    engine.output_queue = Queue()
    fix.adopt(engine)
    record = engine.__dict__[ENGINE_ATTR]
    record.progress.work = record.progress.usable = True
    record.progress.requests = 1
    record.progress.since = time.monotonic() - 100.0
    engine.scheduler.running[0].__dict__[HWM_ATTR] = 0
    answer_mod.make_step(fix, Engine._process_engine_step)(engine)
    assert engine.output_queue == [(1, ("finish", "stuck"))]
    assert not engine.scheduler.requests and fix.stuck_aborts == 1
