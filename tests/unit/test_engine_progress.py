"""Net progress in EngineCore (``engine_liveness.progress``) and its verdict in the API server,
as pure logic: a stand-in scheduler with vLLM's attribute names, a clock the test sets."""

from __future__ import annotations

import asyncio
import collections
import enum
import logging
import math
from typing import Any

import pytest

from vllm_mmcache_fix.core.messages import ENGINE_ANSWERS_AGAIN
from vllm_mmcache_fix.core.settings import DEFAULT_PROGRESS_TIMEOUT, read_progress_timeout
from vllm_mmcache_fix.engine_liveness.heartbeat import ENGINE_NO_PROGRESS, Heartbeat, Liveness
from vllm_mmcache_fix.engine_liveness.progress import RECENT_STEPS, Progress, eligible


class Status(enum.Enum):
    WAITING = 1
    RUNNING = 2
    WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR = 3
    WAITING_FOR_REMOTE_KVS = 4


class Pause(enum.Enum):
    UNPAUSED = 0
    PAUSED_ALL = 1


class Request:
    def __init__(self, rid: str, status: Status = Status.WAITING) -> None:
        self.request_id = rid
        self.status = status
        self.num_computed_tokens = 0


class Queue(collections.deque):  # vLLM's FCFSRequestQueue is a deque with peek_request
    def peek_request(self) -> Request:
        if not self:
            raise IndexError("empty")
        return self[0]


class Scheduler:
    def __init__(self) -> None:
        self.requests: dict[str, Request] = {}
        self.waiting = Queue()
        self.running: list[Request] = []
        self._pause_state = Pause.UNPAUSED

    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def admit(self) -> Request:
        request = self.waiting.popleft()
        request.status = Status.RUNNING
        self.running.append(request)
        return request

    def finish(self, request: Request) -> None:
        self.running.remove(request)
        del self.requests[request.request_id]

    def preempt(self, request: Request) -> None:
        self.running.remove(request)
        request.num_computed_tokens = 0
        request.status = Status.WAITING
        self.waiting.appendleft(request)


def test_the_setting_is_30_to_600_or_0() -> None:
    assert read_progress_timeout({}).value == DEFAULT_PROGRESS_TIMEOUT == 60.0
    for good in ("30", "600", "90", "0"):
        assert read_progress_timeout({"MMCACHE_FIX_PROGRESS_TIMEOUT": good}).value == float(good)
    for bad in ("29", "601", "-1", "x", "nan"):
        setting = read_progress_timeout({"MMCACHE_FIX_PROGRESS_TIMEOUT": bad})
        assert setting.value == 60.0 and "MMCACHE_FIX_PROGRESS_TIMEOUT" in str(setting.problem)


def test_a_livelock_stalls_the_clock_and_any_progress_resets_it() -> None:
    sched, p = Scheduler(), Progress()
    r = Request("a")
    sched.add(r)
    p.added(0.0)
    for t in range(1, 100):  # the scheduler schedules nothing: the request never runs
        p.after_step(sched, float(t))
    assert p.stalled_s(sched, 100.0) == 100.0 and p.empty_steps == 99
    sched.admit()
    r.num_computed_tokens = 16  # a prefill chunk
    p.after_step(sched, 101.0)
    assert p.stalled_s(sched, 101.5) == 0.5
    sched.finish(r)
    p.after_step(sched, 102.0)
    assert not p.work and p.stalled_s(sched, 5000.0) == 0.0  # idle: the clock does not run


def test_a_long_chunked_prefill_progresses_every_step() -> None:
    sched, p = Scheduler(), Progress()
    r = Request("long")
    sched.add(r)
    p.added(0.0)
    sched.admit()
    for t in range(1, 64):  # 128k tokens in 2k chunks, one step per 5 s
        r.num_computed_tokens += 2048
        p.after_step(sched, 5.0 * t)
        assert p.stalled_s(sched, 5.0 * t + 4.9) < 5.0
    assert p.empty_steps == 0


def test_a_saturated_engine_whose_requests_finish_in_their_step_progresses() -> None:
    # max_tokens=1, scoring, embeddings: every scheduled request finishes in its step, and
    # as many arrive before the next one, so the scheduler holds as many as before.
    sched, p = Scheduler(), Progress()
    arrived = 0
    for t in range(1, 2000):  # 100 s of 50 ms steps, 16 requests a step, 16 more waiting
        while len(sched.requests) < 32:
            sched.add(Request(f"r{arrived}"))
            p.added(t * 0.05, len(sched.requests))
            arrived += 1
        for request in [sched.admit() for _ in range(16)]:
            sched.running.remove(request)  # finished within the step (no token computed)
            del sched.requests[request.request_id]
        p.after_step(sched, t * 0.05 + 0.05)
        assert not sched.running and len(sched.waiting) == 16
        assert p.stalled_s(sched, t * 0.05 + 0.05) <= 0.05, t
    assert p.empty_steps == 0


def test_an_add_the_scheduler_did_not_take_is_no_progress() -> None:
    sched, p = Scheduler(), Progress()
    sched.add(Request("stuck"))
    p.added(0.0, len(sched.requests))
    p.after_step(sched, 1.0)
    p.added(1.5, len(sched.requests))  # (a streamed input for a request it holds)
    p.after_step(sched, 2.0)
    sched.add(Request("new"))
    p.added(2.5, len(sched.requests))
    p.after_step(sched, 3.0)
    assert p.stalled_s(sched, 10.0) == 10.0 and p.empty_steps == 3


def test_a_preemption_cascade_recomputes_without_net_progress() -> None:
    sched, p = Scheduler(), Progress()
    r = Request("a")
    sched.add(r)
    p.added(0.0)
    sched.admit()
    r.num_computed_tokens = 1000
    p.after_step(sched, 1.0)
    t = 1.0
    for _ in range(20):  # preempted, recomputed to 800, preempted again: never past 1000
        sched.preempt(r)
        t += 1
        p.after_step(sched, t)
        sched.admit()
        for computed in (400, 800):
            r.num_computed_tokens = computed
            t += 1
            p.after_step(sched, t)
    assert p.stalled_s(sched, t) == t - 1.0


def test_waiting_that_is_not_eligible_and_a_paused_scheduler_do_not_count() -> None:
    sched, p = Scheduler(), Progress()
    sched.add(Request("grammar", Status.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR))
    p.added(0.0)
    p.after_step(sched, 1.0)
    assert not eligible(sched) and p.stalled_s(sched, 600.0) == 0.0
    sched.waiting[0].status = Status.WAITING
    p.after_step(sched, 601.0)  # the grammar is ready: the clock starts now, not at 0
    assert p.stalled_s(sched, 611.0) == 10.0
    sched._pause_state = Pause.PAUSED_ALL
    assert p.stalled_s(sched, 700.0) == 0.0


def test_a_new_request_after_a_long_idle_starts_the_clock_then() -> None:
    sched, p = Scheduler(), Progress()
    sched.add(Request("a"))
    p.added(3600.0)
    assert p.stalled_s(sched, 3601.0) == 1.0


def test_a_clients_abort_on_a_scheduler_without_vllms_queues_changes_nothing() -> None:
    p = Progress()
    p.added(0.0, 3)
    p.client_aborted(object())  # a custom --scheduler-cls, before its first step
    assert p.requests == 3 and p.usable is None


def test_a_scheduler_without_vllms_queues_is_never_judged() -> None:
    class Custom:
        requests: dict[str, Any] = {}

    p = Progress()
    p.added(0.0)
    for t in range(1, 10):
        p.after_step(Custom(), float(t))
    assert p.usable is False and p.stalled_s(Custom(), 1000.0) == 0.0
    p.added(1001.0)  # a request added to it later: still never judged (and never read)
    assert p.stalled_s(Custom(), 2000.0) == 0.0


def test_utility_time_is_skipped() -> None:
    sched, p = Scheduler(), Progress()
    sched.add(Request("a"))
    p.added(0.0)
    p.skip(300.0)  # a 5-minute weight sync while the request waited
    assert p.stalled_s(sched, 310.0) == 10.0


def reply(stalled: float, state: str = "idle", for_s: float = 0.0) -> dict[str, Any]:
    return {
        "schema": 2,
        "pid": 1,
        "via": "input thread",
        "input_thread": True,
        "loop": {"state": state, "detail": "", "for_s": for_s},
        "progress": {"stalled_s": stalled, "empty_steps": 7, "steps": 9},
        "counts": {},
    }


class Client:
    def __init__(self) -> None:
        self.core_engines = [(0).to_bytes(2, "little")]
        self.client_index = 0
        self.answer: Any = reply(0.0)

    async def _call_utility_async(self, method: str, *args: Any, engine: Any) -> Any:
        return self.answer


def test_the_verdict_holds_two_answers_and_clears_at_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def go() -> list[list[str | None]]:
        client = Client()
        beat = Heartbeat(client, 10.0, progress_timeout=30.0)
        out: list[list[str | None]] = []
        for i, stalled in enumerate((29.0, 31.0, 33.0, 35.0, 0.0, 31.0, 0.0)):
            client.answer = reply(stalled)
            beat.tick(client, 2.0 * i, responsive=True)
            for _ in range(5):
                await asyncio.sleep(0)
            out.append([b.stuck for b in beat.verdict()])
        return out

    with caplog.at_level(logging.WARNING, logger="vllm.mmcache_fix"):
        out = asyncio.run(go())
    assert out[0] == [] and out[1] == []  # once past the timeout is not yet a verdict
    assert len(out[2]) == 1 and "no net progress for 33.0 s" in str(out[2][0])
    assert "MMCACHE_FIX_PROGRESS_TIMEOUT=30" in str(out[2][0])
    assert out[3] and out[4] == [] and out[5] == [] and out[6] == []
    messages = [r.getMessage() for r in caplog.records]
    assert sum(ENGINE_NO_PROGRESS in m for m in messages) == 1
    assert sum(ENGINE_ANSWERS_AGAIN in m for m in messages) == 1


def test_progress_rule_off_at_zero() -> None:
    async def go() -> list[Any]:
        client = Client()
        client.answer = reply(10_000.0)
        beat = Heartbeat(client, 10.0, progress_timeout=0.0)
        for i in range(4):
            beat.tick(client, 2.0 * i, responsive=True)
            for _ in range(5):
                await asyncio.sleep(0)
        return beat.verdict()

    assert asyncio.run(go()) == []


# --------------------------------------------------------------------------- the rule's edges


def test_the_recent_steps_are_the_last_ones_oldest_first_after_the_ring_wrapped() -> None:
    sched, p = Scheduler(), Progress()
    assert p.recent_steps() == []
    took = [0.001 * (i + 1) for i in range(40)]  # past two turns of the ring
    t = 0.0
    for i, d in enumerate(took):
        p.after_step(sched, t + d, started=t)
        t += 1.0
        kept = p.recent_steps()
        assert kept == pytest.approx(took[max(0, i + 1 - RECENT_STEPS) : i + 1])
    assert len(p.recent_steps()) == 16  # docs/health.md: "the last 16 step durations"
    assert p.steps == 40 and sum(p.step_counts) == 40


def test_steps_count_every_step_from_zero() -> None:
    sched, p = Scheduler(), Progress()
    assert p.steps == 0 and p.requests == 0 and p.empty_steps == 0
    for t in range(1, 4):
        p.after_step(sched, float(t))
    assert p.steps == 3


def test_a_running_request_seen_first_at_zero_tokens_is_progress_once() -> None:
    sched, p = Scheduler(), Progress()
    sched.add(Request("a"))
    p.added(0.0)
    sched.admit()  # scheduled, nothing computed yet (a long first step)
    p.after_step(sched, 5.0)
    assert p.stalled_s(sched, 6.0) == 1.0 and p.empty_steps == 0
    p.after_step(sched, 7.0)  # still at 0: no progress now
    assert p.stalled_s(sched, 8.0) == 3.0 and p.empty_steps == 1


def test_only_the_first_running_request_is_judged() -> None:
    sched, p = Scheduler(), Progress()
    head, other = Request("head"), Request("other")
    for r in (head, other):
        sched.add(r)
    p.added(0.0)
    sched.admit()
    sched.admit()
    head.num_computed_tokens = 100
    p.after_step(sched, 1.0)
    for t in range(2, 10):  # the head is stuck at 100; the other request moves
        other.num_computed_tokens += 16
        p.after_step(sched, float(t))
    assert p.stalled_s(sched, 10.0) == 9.0 and p.empty_steps == 8


def test_a_paused_scheduler_with_running_requests_stops_the_clock() -> None:
    sched, p = Scheduler(), Progress()
    r = Request("a")
    sched.add(r)
    p.added(0.0)
    sched.admit()
    sched._pause_state = Pause.PAUSED_ALL  # the requests stay in running while paused
    for t in range(1, 50):
        p.after_step(sched, float(t))
    assert not p.work and p.stalled_s(sched, 100.0) == 0.0 and p.unpaused is None
    sched._pause_state = Pause.UNPAUSED
    p.after_step(sched, 200.0)  # resumed: the clock starts now
    assert p.work and p.unpaused is Pause.UNPAUSED and p.stalled_s(sched, 210.0) == 10.0


def test_a_waiting_queue_emptied_while_read_is_not_eligible() -> None:
    class Emptied(Queue):
        def peek_request(self) -> Request:
            raise IndexError("emptied by the busy loop meanwhile")

    sched = Scheduler()
    sched.waiting = Emptied([Request("a")])
    assert eligible(sched) is False


def test_skip_moves_the_clock_only_forward_and_only_while_work_waits() -> None:
    sched, p = Scheduler(), Progress()
    p.skip(100.0)  # nothing waits: nothing to move
    sched.add(Request("a"))
    p.added(0.0)
    assert p.since == 0.0
    p.skip(0.5)
    p.skip(-0.5)  # a clock read out of order never takes time back
    assert p.since == 0.5 and p.stalled_s(sched, 10.0) == 9.5


def test_stalled_is_never_negative_when_read_before_the_clock() -> None:
    sched, p = Scheduler(), Progress()
    sched.add(Request("a"))
    p.added(50.0)
    # The input thread took ``until`` just before the busy loop moved ``since``.
    assert p.stalled_s(sched, 49.0) == 0.0


def test_the_clock_is_written_before_the_work_that_starts_it() -> None:
    # The input thread reads ``work`` then ``since`` without a lock. Were ``work`` written
    # first, a reader between the two writes would see the work with an idle engine's old
    # clock: its hours of idling as seconds without progress. (CPython with the GIL checks
    # for a thread switch at neither write; an interpreter that does, or runs without the
    # GIL, would show it.)
    class Recorded(Progress):
        def __setattr__(self, name: str, value: Any) -> None:
            writes.append(name)
            super().__setattr__(name, value)

    writes: list[str] = []
    sched = Scheduler()
    sched.add(Request("a"))
    for start_the_clock in ("added", "after_step"):
        p = Recorded()
        p.usable = True
        writes.clear()
        if start_the_clock == "added":
            p.added(3600.0)
        else:
            p.after_step(sched, 3600.0)
        assert p.work and p.since == 3600.0
        assert writes.index("since") < writes.index("work"), (start_the_clock, writes)


def test_an_engine_whose_check_turned_off_has_no_seconds_without_progress() -> None:
    # Its last figure would stay on the gauge (and any alert on it) for the server's life.
    liveness = Liveness(10.0)
    client = Client()
    beat = Heartbeat(client, 10.0)
    liveness.heartbeats[client] = beat
    beat.beats[0].progress = {"stalled_s": 50.0}
    assert liveness.progress_figures() == [
        {"engine": "EngineCore", "stalled_s": 50.0, "verdicts": {}}
    ]
    beat.beats[0].off = "the answer's hook was lost"
    (figure,) = liveness.progress_figures() or []
    assert figure["engine"] == "EngineCore" and math.isnan(figure["stalled_s"])
    assert math.isnan(liveness.ages()["EngineCore"])


def test_a_clients_abort_is_not_progress_so_a_livelock_with_retries_still_stalls() -> None:
    # The first request waits and is never scheduled; every 30 s the client of a request
    # behind it times out, aborts and retries (a load balancer's timeout), once between
    # steps and once inside a step (vLLM's aborts queue). The engine did nothing for either:
    # read as progress, the clock never passed 30 s and /health stayed 200 for good.
    sched, p = Scheduler(), Progress()
    for rid in ("first", "behind"):
        sched.add(Request(rid))
    p.added(0.0, len(sched.requests))
    retries = 0
    for step in range(1, 3001):  # 150 s of 50 ms steps, nothing scheduled
        t = step * 0.05
        if step % 300 == 0:
            victim = sched.waiting.pop()
            del sched.requests[victim.request_id]
            p.client_aborted(sched)
            if step % 600:  # inside the step: the retry comes after it
                p.after_step(sched, t)
            retries += 1
            sched.add(Request(f"retry{retries}"))
            p.added(t, len(sched.requests))
            if step % 600:
                continue
        p.after_step(sched, t)
    assert retries == 10
    assert p.stalled_s(sched, 150.0) == 150.0 and p.empty_steps == 3000


def test_an_abort_of_the_first_running_request_judges_the_next_from_where_it_stands() -> None:
    sched, p = Scheduler(), Progress()
    first, second = Request("first"), Request("second")
    for r in (first, second):
        sched.add(r)
    p.added(0.0, len(sched.requests))
    sched.admit()
    sched.admit()
    first.num_computed_tokens = second.num_computed_tokens = 100
    p.after_step(sched, 1.0)  # the first's first sight: progress
    for t in range(2, 40):  # both stuck at 100
        p.after_step(sched, float(t))
    sched.finish(first)  # its client aborted it
    p.client_aborted(sched)
    p.after_step(sched, 40.0)  # the second is first now, still at 100: no progress
    assert p.stalled_s(sched, 41.0) == 40.0
    second.num_computed_tokens = 101
    p.after_step(sched, 42.0)
    assert p.stalled_s(sched, 42.5) == 0.5


def test_a_finish_in_the_step_of_a_clients_abort_is_still_progress() -> None:
    sched, p = Scheduler(), Progress()
    requests = [Request(rid) for rid in ("a", "b", "c")]
    for r in requests:
        sched.add(r)
    p.added(0.0, len(sched.requests))
    sched.admit()
    requests[0].num_computed_tokens = 8
    p.after_step(sched, 1.0)
    p.after_step(sched, 2.0)  # stuck at 8
    sched.waiting.pop()  # "c": aborted inside the step, before its outputs
    del sched.requests["c"]
    p.client_aborted(sched)
    sched.finish(requests[0])  # then "a" finished in that step
    p.after_step(sched, 3.0)
    assert p.stalled_s(sched, 3.5) == 0.5


def test_the_remedys_own_abort_restarts_the_clock() -> None:
    sched, p = Scheduler(), Progress()
    sched.add(Request("stuck"))
    sched.add(Request("next"))
    p.added(0.0, len(sched.requests))
    for t in range(1, 70):
        p.after_step(sched, float(t))
    assert p.stalled_s(sched, 70.0) == 70.0
    p.aborted(70.0)
    assert p.stalled_s(sched, 71.0) == 1.0
