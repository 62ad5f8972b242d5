"""The stall snapshot's details and the step timing, from EngineCore's two threads at once.

The busy loop steps (times each step, moves requests between the scheduler's queues, as
vLLM's scheduler does: a deque for ``waiting`` as vLLM's ``FCFSRequestQueue``, a list for
``running``, a dict for ``requests``) while the input thread answers pings with the
progress figures and the details, with a 1 µs switch interval and a competing CPU-bound
process: the reader never raises, and every reading is well-formed and bounded.
"""

from __future__ import annotations

import collections
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from vllm_mmcache_fix.engine_liveness import snapshot as snap
from vllm_mmcache_fix.engine_liveness.answer import Adopted, progress_snapshot, stall_building
from vllm_mmcache_fix.engine_liveness.progress import RECENT_STEPS, STEP_BOUNDS

RUN_S = 3.0


class Request:
    def __init__(self, rid: str) -> None:
        self.request_id = rid
        self.status = "WAITING"
        self.num_computed_tokens = 0
        self.arrival_time = time.time()


class Queue(collections.deque):  # type: ignore[type-arg]
    def peek_request(self) -> Any:
        if not self:
            raise IndexError("empty")
        return self[0]


class Scheduler:
    def __init__(self) -> None:
        self.requests: dict[str, Request] = {}
        self.waiting = Queue()
        self.running: list[Request] = []


@pytest.fixture
def tiny_switch_interval() -> Iterator[None]:
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def test_details_read_while_the_busy_loop_steps(
    cpu_contention: None, tiny_switch_interval: None
) -> None:
    record, sched, engine = Adopted(), Scheduler(), object()
    stop = threading.Event()
    errors: list[BaseException] = []
    readings = [0]
    steps = [0]

    def busy_loop() -> None:
        n = 0
        try:
            while not stop.is_set():
                n += 1
                request = Request(f"r{n}")
                sched.requests[request.request_id] = request
                sched.waiting.append(request)
                if len(sched.waiting) > 20:
                    moved = sched.waiting.popleft()
                    moved.status = "RUNNING"
                    sched.running.append(moved)
                if len(sched.running) > 20:
                    done = sched.running.pop(0)
                    del sched.requests[done.request_id]
                if n % 7 == 0:
                    sched.waiting.clear()  # an abort of every waiting request
                for r in sched.running[:3]:
                    r.num_computed_tokens += 1
                started = time.monotonic()
                record.progress.after_step(sched, time.monotonic(), started)
                steps[0] += 1
        except BaseException as exc:  # noqa: BLE001 - the test reports it
            errors.append(exc)

    def input_thread() -> None:
        try:
            while not stop.is_set():
                progress = progress_snapshot(record, sched)
                stall_building(record, progress)
                details = snap.engine_details(engine, sched)
                requests = details[snap.KEY_REQUESTS]
                assert len(requests) <= snap.MAX_REQUESTS + 1
                assert all(isinstance(r["request_id"], str) for r in requests)
                assert len(progress["recent_steps_s"]) <= RECENT_STEPS
                assert len(progress["step_counts"]) == len(STEP_BOUNDS) + 1
                readings[0] += 1
        except BaseException as exc:  # noqa: BLE001 - the test reports it
            errors.append(exc)

    threads = [
        threading.Thread(target=busy_loop, name="busy-loop", daemon=True),
        threading.Thread(target=input_thread, name="input-thread", daemon=True),
    ]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + RUN_S
    while time.monotonic() < deadline and not errors:
        time.sleep(0.05)
    stop.set()
    for thread in threads:
        thread.join(10)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    assert readings[0] >= 20 and steps[0] >= 1000, (readings, steps)
    assert sum(record.progress.step_counts) == record.progress.timed == steps[0]
