"""The heartbeat's rules and ``/health``'s wrapper, against a stand-in engine client.

Pure logic (asyncio only): the real classes are exercised in tests/installed and on real
servers in tests/e2e. Ticks are driven by hand with the times a test chooses, except where
the event loop's own timing is the point.
"""

from __future__ import annotations

import asyncio
import logging
import time
import types
from collections.abc import Callable
from typing import Any

import pytest

from vllm_mmcache_fix.core import signals
from vllm_mmcache_fix.core.declaration import ENGINE_NAME_KEY
from vllm_mmcache_fix.core.messages import (
    ENGINE_ANSWERS_AGAIN,
    ENGINE_CHECK_OFF,
    ENGINE_LOOP_STUCK,
    ENGINE_NOT_ANSWERING,
)
from vllm_mmcache_fix.core.settings import (
    DEFAULT_HEALTH_TIMEOUT,
    MIN_HEALTH_TIMEOUT,
    read_health_timeout,
    read_step_timeout,
)
from vllm_mmcache_fix.engine_liveness import health as health_fix
from vllm_mmcache_fix.engine_liveness import heartbeat as hb
from vllm_mmcache_fix.engine_liveness.heartbeat import (
    MISROUTED_ANSWERS,
    Heartbeat,
    Liveness,
    engine_name,
)
from vllm_mmcache_fix.vllm_layout import ENGINE_PING_METHOD

TIMEOUT = 10.0


def reply(state: str = "idle", for_s: float = 0.0, detail: str = "", **extra: Any) -> dict:
    return {
        "schema": 2,
        "pid": 1,
        "via": "input thread",
        "input_thread": True,
        "loop": {"state": state, "detail": detail, "for_s": for_s},
        "counts": {"ghost_keys_dropped": 2, "protected": 1},
        **extra,
    }


class Client:
    """``_call_utility_async`` answers with ``self.answer`` (a dict, an exception, or None:
    held until :meth:`release`)."""

    def __init__(self, engines: int = 1, client_index: int = 0, answer: Any = None) -> None:
        self.core_engines = [i.to_bytes(2, "little") for i in range(engines)]
        self.client_index = client_index
        self.answer = reply() if answer is None else answer
        self.hold = False
        self.calls: list[tuple[str, Any]] = []
        self.held: list[tuple[asyncio.Future[Any], Any]] = []
        self.resources = types.SimpleNamespace(engine_dead=False)

    async def _call_utility_async(self, method: str, *args: Any, engine: Any) -> Any:
        self.calls.append((method, engine))
        if self.hold:
            future = asyncio.get_running_loop().create_future()
            self.held.append((future, engine))
            return await future
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer

    def release(self, answer: Any = None) -> None:
        for future, _ in self.held:
            if not future.done():
                future.set_result(reply() if answer is None else answer)
        self.held.clear()


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def _until(condition: Callable[[], bool], within: float = 10.0) -> None:
    """Turns the loop until ``condition`` holds; bounded, so a regression fails the assert
    after it instead of hanging, and a loaded machine only takes longer."""
    deadline = time.monotonic() + within
    while not condition() and time.monotonic() < deadline:
        await asyncio.sleep(0.005)


def records(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


# -- settings ----------------------------------------------------------------------------


def test_timeout_default_floor_and_off() -> None:
    assert read_health_timeout({}).value == DEFAULT_HEALTH_TIMEOUT == 60.0
    assert read_health_timeout({"MMCACHE_FIX_HEALTH_TIMEOUT": "0"}).value == 0
    assert read_health_timeout({"MMCACHE_FIX_HEALTH_TIMEOUT": "5"}).value == MIN_HEALTH_TIMEOUT
    assert read_health_timeout({"MMCACHE_FIX_HEALTH_TIMEOUT": "120"}).value == 120
    for bad in ("0.001", "4.9", "-1", "abc", "nan", "inf"):
        setting = read_health_timeout({"MMCACHE_FIX_HEALTH_TIMEOUT": bad})
        assert setting.value == DEFAULT_HEALTH_TIMEOUT and setting.problem, bad
        assert "MMCACHE_FIX_HEALTH_TIMEOUT" in setting.problem, bad
    assert "floor" in (read_health_timeout({"MMCACHE_FIX_HEALTH_TIMEOUT": "0.001"}).problem or "")


def test_engine_names_follow_vllm_by_dp_rank() -> None:
    assert engine_name(0, False) == "EngineCore"
    assert [engine_name(i, True) for i in range(2)] == ["EngineCore_DP0", "EngineCore_DP1"]

    async def go(client: Any) -> list[str]:
        return [b.name for b in Heartbeat(client, TIMEOUT).beats]

    # An API server managing DP ranks 4 and 5 (hybrid/external load balancing): vLLM's
    # identities are the ranks, and so are the names (not the positions 0 and 1).
    ranks = Client()
    ranks.core_engines = [r.to_bytes(2, "little") for r in (4, 5)]
    assert run(go(ranks)) == ["EngineCore_DP4", "EngineCore_DP5"]
    # One engine of a DP=8 deployment (external LB: one rank per API server).
    one = Client()
    one.core_engines = [(6).to_bytes(2, "little")]
    one.vllm_config = types.SimpleNamespace(
        parallel_config=types.SimpleNamespace(data_parallel_size=8)
    )
    assert run(go(one)) == ["EngineCore_DP6"]
    alone = Client()
    alone.core_engines = [(0).to_bytes(2, "little")]
    assert run(go(alone)) == ["EngineCore"]


# -- the rules -----------------------------------------------------------------------------


def test_a_healthy_engine_is_pinged_every_interval_and_its_counts_kept() -> None:
    answered: list[tuple[str, float]] = []

    async def go() -> tuple[Heartbeat, Client]:
        client = Client(engines=2)
        beat = Heartbeat(client, TIMEOUT, lambda e, s: answered.append((e, s)))
        for now in (0.0, 1.0, 2.0, 3.0, 4.0):
            beat.tick(client, now, responsive=True)
            await settle()
        return beat, client

    beat, client = run(go())
    # t=0, 2, 4: three pings per engine, never more than one waiting
    assert (
        client.calls == [(ENGINE_PING_METHOD, b"\x00\x00"), (ENGINE_PING_METHOD, b"\x01\x00")] * 3
    )
    assert [e for e, _ in answered] == ["EngineCore_DP0", "EngineCore_DP1"] * 3
    assert beat.verdict() == []
    assert beat.beats[0].counts == {"ghost_keys_dropped": 2, "protected": 1}
    assert beat.beats[0].loop == {"state": "idle", "detail": "", "for_s": 0.0}


def test_silence_is_judged_on_two_pings_past_the_timeout_twice_and_clears_on_an_answer(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def go() -> dict[str, Any]:
        client = Client()
        client.hold = True
        beat = Heartbeat(client, TIMEOUT, clock=lambda: 100.0)
        seen: dict[str, Any] = {}
        beat.tick(client, 0.0, responsive=True)
        beat.tick(client, hb.PING_INTERVAL_S, responsive=True)  # one unanswered: no silence yet
        beat.tick(client, TIMEOUT / 2 - 0.5, responsive=True)
        seen["pings_before_half"] = len(beat.beats[0].pending)  # two wait: half a timeout
        beat.tick(client, TIMEOUT / 2 + hb.PING_INTERVAL_S, responsive=True)  # the confirming ping
        beat.tick(client, TIMEOUT, responsive=True)
        seen["stuck_at_timeout"] = beat.verdict()
        beat.tick(client, TIMEOUT + 0.5, responsive=False)  # a late tick never judges
        seen["stuck_late_tick"] = beat.verdict()
        beat.tick(client, TIMEOUT + 1.0, responsive=True)
        seen["stuck_first_evaluation"] = beat.verdict()  # one evaluation is not enough
        beat.tick(client, TIMEOUT + 2.0, responsive=True)
        seen["stuck"] = [b.stuck for b in beat.verdict()]
        for now in range(int(TIMEOUT) + 3, 600):
            beat.tick(client, float(now), responsive=True)
        await settle()
        seen["in_flight_at_600"] = len(beat.beats[0].flying)  # bounded, however long
        seen["stuck_at_600"] = [b.stuck for b in beat.verdict()]
        client.release()
        await settle()
        seen["after_answer"] = beat.verdict()
        seen["in_flight"] = len(beat.beats[0].flying)
        return seen

    with caplog.at_level(logging.WARNING, logger="vllm.mmcache_fix"):
        seen = run(go())
    assert seen["pings_before_half"] == 2
    assert seen["stuck_at_timeout"] == [] and seen["stuck_late_tick"] == []
    assert seen["stuck_first_evaluation"] == []
    assert len(seen["stuck"]) == 1 and "EngineCore has not answered for 12.0 s" in seen["stuck"][0]
    assert "pings sent since" in seen["stuck"][0] and "input thread" in seen["stuck"][0]
    assert seen["in_flight_at_600"] <= hb.MAX_IN_FLIGHT and len(seen["stuck_at_600"]) == 1
    assert seen["after_answer"] == [] and seen["in_flight"] == 0
    assert len(records(caplog, ENGINE_NOT_ANSWERING)) == 1  # one WARNING per stall
    assert len(records(caplog, ENGINE_ANSWERS_AGAIN)) == 1


def test_lost_answers_never_latch_the_first_later_answer_clears(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """vLLM's ROUTER drops the answers of a reconnecting engine: every ping of the first
    40 s is lost, then the engine answers again. Driven tick by tick for 600 s (timeout 5 s):
    ``/health`` fails while nothing comes back and is healthy from the first later answer to
    the end, with pings still sent."""

    async def go() -> dict[str, Any]:
        client = Client()
        client.hold = True
        beat = Heartbeat(client, 5.0)
        failing: list[float] = []
        for now in range(600):
            if now == 40:
                client.hold = False
                client.held.clear()  # the answers of these pings are lost: never released
            beat.tick(client, float(now), responsive=True)
            await settle()
            if beat.verdict():
                failing.append(float(now))
        return {
            "failing": failing,
            "calls": len(client.calls),
            "answers": beat.beats[0].answers,
            "off": beat.beats[0].off,
            "flying": len(beat.beats[0].flying),
        }

    with caplog.at_level(logging.WARNING, logger="vllm.mmcache_fix"):
        seen = run(go())
    assert seen["failing"] and max(seen["failing"]) < 42, seen  # healed at the first answer
    assert seen["answers"] >= 270 and seen["off"] is None, seen  # pinged to the end
    assert seen["flying"] <= hb.MAX_IN_FLIGHT, seen
    assert len(records(caplog, ENGINE_ANSWERS_AGAIN)) == 1


def test_answers_lost_again_and_again_never_fail_health_nor_pile_up(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Every other answer lost for 600 s: never a 503, and the pings waiting on vLLM stay
    within the bound (lost ones expire)."""

    class Lossy(Client):
        n = 0

        async def _call_utility_async(self, method: str, *args: Any, engine: Any) -> Any:
            self.n += 1
            if self.n % 2:
                self.calls.append((method, engine))
                await asyncio.get_running_loop().create_future()  # never answered
            return await super()._call_utility_async(method, *args, engine=engine)

    async def go() -> tuple[Heartbeat, list[float], int]:
        client = Lossy()
        beat = Heartbeat(client, 5.0)
        failing: list[float] = []
        most = 0
        for now in range(600):
            beat.tick(client, float(now), responsive=True)
            await settle()
            most = max(most, len(beat.beats[0].flying))
            if beat.verdict():
                failing.append(float(now))
        return beat, failing, most

    with caplog.at_level(logging.WARNING, logger="vllm.mmcache_fix"):
        beat, failing, most = run(go())
    assert failing == [] and beat.beats[0].off is None
    assert beat.beats[0].answers >= 100 and most <= hb.MAX_IN_FLIGHT
    assert records(caplog, ENGINE_NOT_ANSWERING) == []


def test_one_lost_answer_is_not_a_dead_thread() -> None:
    async def go() -> tuple[list, int]:
        client = Client()
        client.hold = True
        beat = Heartbeat(client, TIMEOUT)
        beat.tick(client, 0.0, responsive=True)
        await settle()
        lost = client.held.pop()  # this answer never comes
        beat.tick(client, TIMEOUT / 2, responsive=True)
        await settle()
        client.release()
        await settle()
        beat.tick(client, TIMEOUT + 5, responsive=True)
        del lost
        return beat.verdict(), len(beat.beats[0].pending)

    stuck, pending = run(go())
    assert stuck == [] and pending <= 1


def test_one_lost_answer_keeps_the_ping_interval_and_a_stall_is_confirmed_at_once() -> None:
    """A reply vLLM's ROUTER dropped left one ping unanswered: the next ping waited half a
    timeout (30 s at the default), the last answer's age and the engine's counts stood
    still meanwhile, and an answer that found a stuck step was confirmed only then."""
    step_bound = 90.0

    async def go() -> tuple[list[int], list[bool]]:
        client = Client()
        beat = Heartbeat(client, 60.0, step_timeout=step_bound)
        client.hold = True
        beat.tick(client, 0.0, responsive=True)
        await settle()
        client.held.clear()  # that answer never comes
        client.hold = False
        client.answer = reply("step", step_bound + 1)  # the next finds a stuck step
        sent, stuck = [], []
        for now in range(1, 6):
            beat.tick(client, float(now), responsive=True)
            await settle()
            sent.append(len(client.calls))
            stuck.append(bool(beat.verdict()))
        return sent, stuck

    sent, stuck = run(go())
    # t=2: the interval, with one ping unanswered; its answer finds the stall; t=3
    # confirms it: stuck. (Before: no ping until t=30, no verdict until t=31.)
    assert sent[:3] == [1, 2, 3], sent
    assert stuck[:3] == [False, False, True], stuck


def _verdicts(script: list[dict[str, Any]], step_bound: float) -> list[list[str | None]]:
    """The heartbeat's stuck verdicts after each answer of ``script`` (one every 2 s)."""

    async def go() -> list[list[str | None]]:
        client = Client()
        beat = Heartbeat(client, TIMEOUT, step_timeout=step_bound)
        out: list[list[str | None]] = []
        for i, answer in enumerate(script):
            client.answer = answer
            beat.tick(client, 2.0 * i, responsive=True)
            await settle()
            out.append([b.stuck for b in beat.verdict()])
        return out

    return run(go())


def test_a_long_utility_call_or_step_is_healthy_a_step_past_its_bound_is_stuck(
    caplog: pytest.LogCaptureFixture,
) -> None:
    step_bound = 90.0
    script = [
        reply("utility", 30 * TIMEOUT, "reset_prefix_cache"),
        reply("step", TIMEOUT + 1),  # a long healthy step: past the health timeout
        reply("step", step_bound - 1),
        reply("step", step_bound + 1),  # once: not yet
        reply("step", step_bound + 3),  # twice in a row: stuck
        reply("idle", 0.0),  # recovery at once
        reply("add", TIMEOUT + 3),
        reply("add", TIMEOUT + 5),
        reply("idle", 0.0),
    ]
    with caplog.at_level(logging.WARNING, logger="vllm.mmcache_fix"):
        out = _verdicts(script, step_bound)
    assert out[0] == [] and out[1] == [] and out[2] == [] and out[3] == []
    assert len(out[4]) == 1 and "busy loop has been inside one step for 93.0 s" in str(out[4][0])
    assert "MMCACHE_FIX_STEP_TIMEOUT=90" in str(out[4][0])
    assert out[5] == [] and out[6] == []
    assert "add for 15.0 s" in str(out[7][0])
    assert out[8] == []
    assert len(records(caplog, ENGINE_LOOP_STUCK)) == 2
    assert len(records(caplog, ENGINE_ANSWERS_AGAIN)) == 2


def test_an_answer_that_finds_a_stall_is_confirmed_at_the_next_tick() -> None:
    """Pings go every 2 s while answers are healthy; an answer that finds the busy loop past
    its bound is confirmed by a ping at the next tick (1 s), so the 503 comes a ping interval
    sooner; an answer that clears it brings back the 2 s interval."""
    step_bound = 90.0

    async def go() -> tuple[list[int], list[list[str | None]]]:
        client = Client()
        beat = Heartbeat(client, TIMEOUT, step_timeout=step_bound)
        sent, stuck = [], []
        answers = [reply("step", step_bound - 1)] * 4 + [reply("step", step_bound + 1)] * 2
        answers += [reply("idle", 0.0)] * 4
        for now in range(10):
            client.answer = answers[now]
            beat.tick(client, float(now), responsive=True)
            await settle()
            sent.append(len(client.calls))
            stuck.append([b.stuck for b in beat.verdict()])
        return sent, stuck

    sent, stuck = run(go())
    # t=0, 2: the interval; t=4 finds the stall, t=5 confirms it (stuck at once); then the
    # interval again: t=7 finds it cleared, t=9.
    assert sent == [1, 1, 2, 2, 3, 4, 4, 5, 5, 6], sent
    assert [bool(v) for v in stuck] == [False] * 5 + [True] * 2 + [False] * 3, stuck


def test_a_dp_rank_waiting_for_its_peers_is_judged_as_a_step() -> None:
    """The DP all-reduce or a dummy batch waits as long as the peers' step: healthy past the
    health timeout, stuck only past the step bound."""
    step_bound = 90.0
    script = [
        reply("sync", TIMEOUT + 1, "dp all-reduce"),
        reply("sync", step_bound - 1, "dummy batch"),
        reply("sync", step_bound + 1, "dp all-reduce"),
        reply("sync", step_bound + 3, "dp all-reduce"),
    ]
    out = _verdicts(script, step_bound)
    assert out[0] == [] and out[1] == [] and out[2] == []
    assert len(out[3]) == 1 and "inside one sync for 93.0 s" in str(out[3][0])
    assert "MMCACHE_FIX_STEP_TIMEOUT=90" in str(out[3][0])


def test_the_step_bound_is_vllms_own_unless_set() -> None:
    assert read_step_timeout({}).value == 300.0
    assert read_step_timeout({"VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "600"}).value == 600.0
    both = {"VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "600", "MMCACHE_FIX_STEP_TIMEOUT": "120"}
    assert read_step_timeout(both).value == 120.0
    bad = read_step_timeout({"MMCACHE_FIX_STEP_TIMEOUT": "1"})
    assert bad.value == 300.0 and bad.problem and "MMCACHE_FIX_STEP_TIMEOUT" in bad.problem
    # Never below the health timeout: the heartbeat takes the larger.
    assert Heartbeat(Client(), 60.0, step_timeout=10.0).step_timeout == 60.0


def test_an_answer_through_the_busy_loop_while_the_input_thread_was_said_to_answer(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A hook lost to another plugin replacing the input queue: the engine says its input
    thread answers, but every answer comes through the busy loop. Judged by the input-thread
    rule it would fail /health during a long weight sync; the check is turned off instead, at
    the third such answer in a row."""
    seen: list[str | None] = []

    async def go() -> Heartbeat:
        client = Client(answer=reply(via="busy loop"))
        beat = Heartbeat(client, TIMEOUT)
        for now in (0.0, 2.0, 4.0):
            beat.tick(client, now, responsive=True)
            await settle()
            seen.append(beat.beats[0].off)
        return beat

    with caplog.at_level(logging.WARNING, logger="vllm.mmcache_fix"):
        beat = run(go())
    assert MISROUTED_ANSWERS == 3 and seen[:2] == [None, None]
    assert beat.verdict() == [] and "3 answers in a row came through busy loop" in str(seen[2])
    assert len(records(caplog, ENGINE_CHECK_OFF)) == 1


def test_one_answer_through_the_busy_loop_among_the_input_threads_keeps_the_check_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A ping the input thread was putting on the queue while the busy loop hooked it and
    counted the pings already queued reaches the busy loop unmarked: one such answer (or two,
    between answers of the input thread) is an answer, not a lost hook."""
    vias = ["busy loop", "input thread", "busy loop", "busy loop", "input thread", "busy loop"]

    async def go() -> Heartbeat:
        client = Client(answer=reply())
        beat = Heartbeat(client, TIMEOUT)
        for i, via in enumerate(vias):
            client.answer = reply(via=via)
            beat.tick(client, 2.0 * i, responsive=True)
            await settle()
        return beat

    with caplog.at_level(logging.WARNING, logger="vllm.mmcache_fix"):
        beat = run(go())
    engine = beat.beats[0]
    assert engine.off is None and engine.answers == len(vias) and beat.verdict() == []
    assert engine.misrouted == 1 and engine.counts == {"ghost_keys_dropped": 2, "protected": 1}
    assert records(caplog, ENGINE_CHECK_OFF) == []


def test_an_answer_to_a_ping_queued_before_the_hook_keeps_the_check_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The first ping reached EngineCore's input queue before its busy loop hooked it: the
    busy loop answers it and says so. The engine is alive and the check stays on (it was
    turned off for the server's life by this start-up race); its counts reach /metrics."""

    async def go() -> Heartbeat:
        client = Client(answer=reply(via="busy loop", queued_before_hook=True))
        beat = Heartbeat(client, TIMEOUT)
        beat.tick(client, 0.0, responsive=True)
        await settle()
        client.answer = reply()
        for now in (2.0, 4.0):
            beat.tick(client, now, responsive=True)
            await settle()
        return beat

    with caplog.at_level(logging.WARNING, logger="vllm.mmcache_fix"):
        beat = run(go())
    engine = beat.beats[0]
    assert engine.off is None and engine.answers == 3 and beat.verdict() == []
    assert engine.counts == {"ghost_keys_dropped": 2, "protected": 1}
    assert records(caplog, ENGINE_CHECK_OFF) == []


@pytest.mark.parametrize(
    ("answer", "why"),
    [
        (Exception("Call to mmcache_fix_ping method failed: no attribute"), "its ping failed"),
        (reply(input_thread=False, via="busy loop"), "busy loop only"),
        ({"schema": 1, "pid": 3, "counts": {}}, "busy loop only"),
        ("pong", "answered str"),
    ],
)
def test_an_engine_that_cannot_answer_is_turned_off_once(
    answer: Any, why: str, caplog: pytest.LogCaptureFixture
) -> None:
    async def go() -> tuple[Heartbeat, Client]:
        client = Client(answer=answer)
        beat = Heartbeat(client, TIMEOUT)
        for now in range(0, 40, 2):
            beat.tick(client, float(now), responsive=True)
            await settle()
        return beat, client

    with caplog.at_level(logging.WARNING, logger="vllm.mmcache_fix"):
        beat, client = run(go())
    assert len(client.calls) == 1  # never asked again
    assert beat.verdict() == [] and beat.beats[0].off and why in beat.beats[0].off
    warnings = records(caplog, ENGINE_CHECK_OFF)
    assert len(warnings) == 1 and "EngineCore" in warnings[0]
    assert beat.beats[0].counts is None  # an error is never an answer


def test_a_client_without_engine_param_is_off_before_any_ping(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class OldClient(Client):
        async def _call_utility_async(self, method: str, *args: Any) -> Any:  # type: ignore[override]
            raise AssertionError("must not be called")

    async def go() -> Heartbeat:
        client = OldClient()
        beat = Heartbeat(client, TIMEOUT)
        beat.tick(client, 0.0, responsive=True)
        await settle()
        return beat

    with caplog.at_level(logging.WARNING, logger="vllm.mmcache_fix"):
        beat = run(go())
    assert "engine=" in (beat.beats[0].off or "")
    assert len(records(caplog, ENGINE_CHECK_OFF)) == 1


def test_a_graceful_shutdown_stops_the_heartbeat_quietly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def go() -> Heartbeat:
        client = Client(answer=Exception("Server shutting down"))
        beat = Heartbeat(client, TIMEOUT)
        beat.tick(client, 0.0, responsive=True)
        await settle()
        return beat

    with caplog.at_level(logging.WARNING, logger="vllm.mmcache_fix"):
        beat = run(go())
    assert beat.stopped == "EngineCore is shutting down" and beat.verdict() == []
    assert records(caplog, ENGINE_CHECK_OFF) == []


def test_a_dead_engine_stops_the_heartbeat_and_leaves_health_to_vllm() -> None:
    async def go() -> Heartbeat:
        client = Client()
        client.hold = True
        beat = Heartbeat(client, TIMEOUT)
        beat.tick(client, 0.0, responsive=True)
        beat.tick(client, TIMEOUT / 2, responsive=True)
        beat.tick(client, TIMEOUT + 1, responsive=True)
        beat.tick(client, TIMEOUT + 2, responsive=True)
        assert beat.verdict()
        client.resources.engine_dead = True
        beat.start()
        await _until(lambda: beat.stopped is not None)
        return beat

    beat = run(go())
    assert beat.stopped is not None and "dead" in beat.stopped
    assert beat.verdict() == []


def test_a_blocked_event_loop_is_not_taken_for_a_silent_engine(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The API server's own loop blocked longer than the timeout (a long call in the request
    path) while two pings wait: their answers arrived meanwhile and wait unread (a socket read,
    vLLM's decoding, then the future: several loop turns). The first tick after the block must
    not judge them."""
    monkeypatch.setattr(hb, "TICK_S", 0.05)
    monkeypatch.setattr(hb, "MAX_LAG_S", 0.05)
    monkeypatch.setattr(hb, "PING_INTERVAL_S", 0.1)  # the second ping before the first answer

    class Slow(Client):
        async def _call_utility_async(self, method: str, *args: Any, engine: Any) -> Any:
            self.calls.append((method, engine))
            loop = asyncio.get_running_loop()
            future = loop.create_future()

            def hop(n: int) -> None:
                if n:
                    loop.call_soon(hop, n - 1)
                elif not future.done():
                    future.set_result(reply())

            loop.call_later(0.2, hop, 3)  # EngineCore's answer, then the client's own turns
            return await future

    async def go() -> Heartbeat:
        client = Slow()
        beat = Heartbeat(client, 0.3)
        beat.start()
        # Until the first ping and the confirming one are out and both calls reached the
        # engine (a ping task that has not started yet is only asked after the block, and
        # its answer is due 0.2 s later: that is not an answer waiting unread). Bounded: on
        # a loaded machine the ticks come late; the answers need three more loop turns.
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and (
            len(beat.beats[0].pending) < 2 or len(client.calls) < 2
        ):
            await asyncio.sleep(0.005)
        assert len(beat.beats[0].pending) == 2 and len(client.calls) == 2
        time.sleep(1.0)  # the loop blocked: both answers are due meanwhile
        await asyncio.sleep(0.3)
        beat.stop("done")
        return beat

    with caplog.at_level(logging.WARNING, logger="vllm.mmcache_fix"):
        beat = run(go())
    assert beat.beats[0].answers >= 2
    assert records(caplog, ENGINE_NOT_ANSWERING) == []


def test_ages_counts_only_from_the_first_api_server_and_elastic_engines() -> None:
    async def go() -> tuple[Liveness, Client]:
        liveness = Liveness(TIMEOUT)
        first, second = Client(engines=1), Client(client_index=1)
        for client in (first, second):
            beat = liveness.attach(client)
            assert beat is not None
            beat.tick(client, 0.0, responsive=True)
        await settle()
        first.core_engines.append((1).to_bytes(2, "little"))  # a new engine (elastic DP)
        liveness.heartbeats[first].tick(first, 2.0, responsive=True)
        await settle()
        for beat in liveness._all():
            beat.stop("done")
        return liveness, first

    liveness, first = run(go())
    counts = {"ghost_keys_dropped": 2, "protected": 1}
    assert liveness.engine_counts() == [
        {**counts, ENGINE_NAME_KEY: "EngineCore_DP0"},
        {**counts, ENGINE_NAME_KEY: "EngineCore_DP1"},
    ]
    assert [b.name for b in liveness.heartbeats[first].beats] == [
        "EngineCore_DP0",
        "EngineCore_DP1",
    ]
    assert liveness.ages() == {}  # stopped heartbeats export no age
    assert Liveness(TIMEOUT).attach(object()) is None  # no engine processes: nothing to ask


def test_no_engine_counts_until_an_engine_answers() -> None:
    """Before EngineCore's first answer /metrics must not say "0 engines protected"."""

    async def go() -> tuple[Any, Any]:
        liveness = Liveness(TIMEOUT)
        client = Client()
        client.hold = True
        beat = liveness.attach(client)
        assert beat is not None
        await settle()
        assert client.held  # asked, not answered
        before = liveness.engine_counts()
        client.release()
        await settle()
        after = liveness.engine_counts()
        beat.stop("done")
        return before, after

    before, after = run(go())
    assert before is None
    assert after == [{"ghost_keys_dropped": 2, "protected": 1, ENGINE_NAME_KEY: "EngineCore"}]


def test_ages_are_nan_where_the_check_is_off() -> None:
    async def go() -> dict[str, float]:
        liveness = Liveness(TIMEOUT)
        client = Client(answer=Exception("Call to mmcache_fix_ping method failed"))
        liveness.attach(client)
        await _until(lambda: any(age != age for age in liveness.ages().values()))
        return liveness.ages()

    ages = run(go())
    assert list(ages) == ["EngineCore"] and ages["EngineCore"] != ages["EngineCore"]


# -- /health -------------------------------------------------------------------------------


@pytest.fixture
def engine_dead_error(monkeypatch: pytest.MonkeyPatch) -> type:
    import sys

    module = types.ModuleType("vllm.v1.engine.exceptions")

    class EngineDeadError(Exception):
        pass

    module.EngineDeadError = EngineDeadError  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm.v1.engine.exceptions", module)
    return EngineDeadError


def _fix(timeout: float = TIMEOUT) -> health_fix.EngineHealth:
    fix = health_fix.EngineHealth()
    fix.timeout = timeout
    fix.liveness = Liveness(timeout, guard=fix._beat_site)
    return fix


def test_health_reads_the_verdict_at_once_after_vllms_own_check(engine_dead_error: type) -> None:
    fix = _fix()
    order: list[str] = []
    serving: list[bool] = []
    signals.API_SERVER_SERVING.connect(lambda: serving.append(True))

    async def original(self: Any) -> None:
        order.append("vllm")

    wrapped = health_fix.wrap_check_health(fix, original)

    async def go() -> tuple[Any, float, Any]:
        client = Client()
        client.hold = True
        engine = types.SimpleNamespace(engine_core=client)
        fix.attach(engine)
        first = await wrapped(engine)
        beat = fix.liveness.heartbeats[client]  # type: ignore[union-attr]
        beat.tick(client, 0.0, responsive=True)
        beat.tick(client, TIMEOUT / 2, responsive=True)
        beat.tick(client, TIMEOUT + 1, responsive=True)
        beat.tick(client, TIMEOUT + 2, responsive=True)
        # A callback queued now runs at the loop's next turn: only if the check suspended
        # (waited for an answer) has it run when the check returns.
        turned: list[bool] = []
        asyncio.get_running_loop().call_soon(turned.append, True)
        try:
            await wrapped(engine)
            failed = None
        except Exception as exc:
            failed = exc
        waited = bool(turned)
        beat.stop("done")
        return first, waited, failed

    try:
        first, waited, failed = run(go())
    finally:
        signals.API_SERVER_SERVING._receivers = ()
    assert first is None and order == ["vllm", "vllm"]
    assert isinstance(failed, engine_dead_error) and "has not answered" in str(failed)
    assert not waited  # read, never awaited
    assert serving == [True]


def test_health_without_engine_processes_or_outside_a_loop_is_vllms(
    engine_dead_error: type,
) -> None:
    fix = _fix()

    async def original(self: Any) -> None:
        return None

    wrapped = health_fix.wrap_check_health(fix, original)
    assert run(wrapped(types.SimpleNamespace(engine_core=object()))) is None
    engine = types.SimpleNamespace(engine_core=Client())
    fix.attach(engine)  # no running loop: nothing starts
    assert not fix.liveness.heartbeats  # type: ignore[union-attr]
    assert run(wrapped(engine)) is None  # started at the first check instead
    assert len(fix.liveness.heartbeats) == 1  # type: ignore[union-attr]


def test_an_internal_error_leaves_vllms_answer(caplog: pytest.LogCaptureFixture) -> None:
    fix = _fix()

    class Broken(Liveness):
        def attach(self, client: Any) -> Any:
            raise ValueError("broken bookkeeping")

    fix.liveness = Broken(TIMEOUT)

    async def original(self: Any) -> None:
        return None

    wrapped = health_fix.wrap_check_health(fix, original)
    with caplog.at_level(logging.WARNING, logger="vllm.mmcache_fix"):
        assert run(wrapped(types.SimpleNamespace(engine_core=Client()))) is None
    assert fix.switched_off is not None and fix.errors.total == 1


def test_timeout_zero_turns_off_the_heartbeat_only(
    monkeypatch: pytest.MonkeyPatch, engine_dead_error: type
) -> None:
    """``MMCACHE_FIX_HEALTH_TIMEOUT=0`` means what the docs say: no pings, ``/health`` is
    vLLM's own. The process is still an API server: the stall sentinel and the metrics
    start (they listen for ``API_SERVER_SERVING``), once."""
    monkeypatch.setenv("MMCACHE_FIX_HEALTH_TIMEOUT", "0")
    fix = health_fix.EngineHealth()
    fix._install()
    serving: list[bool] = []
    signals.API_SERVER_SERVING.connect(lambda: serving.append(True))

    async def original(self: Any) -> None:
        return None

    wrapped = health_fix.wrap_check_health(fix, original)

    async def go() -> list[Any]:
        client = Client()
        client.hold = True
        engine = types.SimpleNamespace(engine_core=client)
        fix.attach(engine)
        return [await wrapped(engine) for _ in range(3)] + [client.calls]

    try:
        out = run(go())
    finally:
        signals.API_SERVER_SERVING._receivers = ()
    assert fix.liveness is None and fix.status()["heartbeat"] is False
    assert out == [None, None, None, []]  # 200 from vLLM's check, no ping sent
    assert serving == [True]


def test_warn_mode_keeps_the_engine_check_as_documented(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``MMCACHE_FIX_MODE=warn`` leaves the caches alone but keeps the stall detection: the
    words (the mode's docstring, the settings table ``check`` prints) say what the check
    does in that mode."""
    from vllm_mmcache_fix import plugin

    monkeypatch.setenv("MMCACHE_FIX_MODE", "warn")
    fix = health_fix.EngineHealth()
    fix._install()
    assert fix.liveness is not None and fix.timeout == DEFAULT_HEALTH_TIMEOUT
    meaning = next(spec.meaning for spec in plugin.settings() if spec.name == "MMCACHE_FIX_MODE")
    assert "warn: leave the caches" in meaning and "/health check" in meaning
    assert "patch nothing" not in meaning


# -- the fix's lifecycle: install, patch, uninstall ------------------------------------------


def test_mode_off_leaves_health_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_mmcache_fix.core.lifecycle import DidNotEnable

    monkeypatch.setenv("MMCACHE_FIX_MODE", "off")
    fix = health_fix.EngineHealth()
    with pytest.raises(DidNotEnable, match="MMCACHE_FIX_MODE=off"):
        fix._install()
    assert fix.liveness is None and fix.timeout is None


def test_each_bad_timeout_is_warned_about_once_and_good_ones_are_not(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    fix = health_fix.EngineHealth()
    fix._install()
    assert fix.problems == [] and fix.liveness is not None
    assert fix.step_timeout == max(read_step_timeout().value, fix.timeout)
    for name in (
        "MMCACHE_FIX_HEALTH_TIMEOUT",
        "MMCACHE_FIX_STEP_TIMEOUT",
        "MMCACHE_FIX_PROGRESS_TIMEOUT",
    ):
        monkeypatch.setenv(name, "soon")
        fix = health_fix.EngineHealth()
        with caplog.at_level(logging.WARNING, logger="vllm.mmcache_fix"):
            caplog.clear()
            fix._install()
            fix._install()
        assert len(fix.problems) == 1 and name in fix.problems[0], name
        (warned,) = records(caplog, name)
        assert warned.endswith(fix.problems[0]), name
        monkeypatch.delenv(name)


def test_uninstall_stops_every_heartbeat() -> None:
    fix = _fix()

    async def go() -> list[Any]:
        clients = [Client(), Client(client_index=1)]
        for client in clients:
            fix.attach(types.SimpleNamespace(engine_core=client))
        beats = list(fix.liveness.heartbeats.values())  # type: ignore[union-attr]
        fix._uninstall()
        return [beat.stopped for beat in beats]

    assert run(go()) == ["uninstalled", "uninstalled"]


def test_an_internal_error_outside_the_snapshots_stops_every_heartbeat() -> None:
    fix = _fix()

    async def go() -> tuple[Any, ...]:
        engine = types.SimpleNamespace(engine_core=Client())  # (heartbeats are weakly held)
        fix.attach(engine)
        (beat,) = fix.liveness.heartbeats.values()  # type: ignore[union-attr]
        fix.snapshots = object()  # type: ignore[assignment]
        fix._on_internal_error(fix._snapshot_site.name, ValueError("disk full"))
        after_snapshot = (fix.snapshots, fix.switched_off, beat.stopped)
        fix._on_internal_error(fix._site.name, ValueError("bug"))
        return after_snapshot, fix.switched_off, beat.stopped

    after_snapshot, switched_off, stopped = run(go())
    assert after_snapshot == (None, None, None)
    assert switched_off == "internal error at engine_health.check: ValueError('bug')"
    assert stopped == "switched off after an internal error"


def test_the_first_heartbeat_says_once_that_this_process_serves(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from vllm_mmcache_fix.core.messages import LIVENESS_ACTIVE

    fix = _fix()
    fix.step_timeout = fix.progress_timeout = 60.0

    async def go() -> None:
        engines = [types.SimpleNamespace(engine_core=Client(client_index=i)) for i in range(2)]
        for engine in engines:
            fix.attach(engine)
        assert len(fix.liveness.heartbeats) == 2  # type: ignore[union-attr]
        for beat in list(fix.liveness.heartbeats.values()):  # type: ignore[union-attr]
            beat.stop("done")

    assert not fix.serving
    with caplog.at_level(logging.INFO, logger="vllm.mmcache_fix"):
        run(go())
    assert fix.serving
    assert len(records(caplog, LIVENESS_ACTIVE)) == 1


def _vllm_modules(
    monkeypatch: pytest.MonkeyPatch, check_health: bool = True, engine_param: bool = True
) -> type:
    """Stand-ins of ``vllm.v1.engine.async_llm`` and ``core_client``."""
    import sys

    async def _check(self: Any) -> None:
        return None

    body: dict[str, Any] = {"__init__": lambda self: None}
    if check_health:
        body["check_health"] = _check
    async_llm = types.ModuleType("vllm.v1.engine.async_llm")
    cls = type("AsyncLLM", (), body)
    cls.__module__ = async_llm.__name__
    async_llm.AsyncLLM = cls  # type: ignore[attr-defined]

    if engine_param:

        async def call(self: Any, method: str, *args: Any, engine: Any = None) -> Any:
            return None
    else:

        async def call(self: Any, method: str, *args: Any) -> Any:  # type: ignore[misc]
            return None

    core_client = types.ModuleType("vllm.v1.engine.core_client")
    core_client.AsyncMPClient = type("AsyncMPClient", (), {"_call_utility_async": call})  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, async_llm.__name__, async_llm)
    monkeypatch.setitem(sys.modules, core_client.__name__, core_client)
    return cls


def test_the_patch_wraps_asyncllms_init_and_check_health(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_mmcache_fix.core import registry

    cls = _vllm_modules(monkeypatch)
    fix = health_fix.EngineHealth()
    try:
        assert fix._on_import("vllm.v1.engine.async_llm") is True
        assert registry.is_patched(cls, "__init__") and registry.is_patched(cls, "check_health")
        assert fix.targets == [
            "vllm.v1.engine.async_llm.AsyncLLM.__init__",
            "vllm.v1.engine.async_llm.AsyncLLM.check_health",
        ]
        assert fix.problems == []
    finally:
        registry.revert_patch(health_fix.PATCH_ID)
    assert not registry.is_patched(cls, "check_health")


def test_the_patch_leaves_a_vllm_it_cannot_serve(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import sys

    from vllm_mmcache_fix.core import registry

    # No check_health on AsyncLLM.
    cls = _vllm_modules(monkeypatch, check_health=False)
    fix = health_fix.EngineHealth()
    assert fix._on_import("vllm.v1.engine.async_llm") is True
    assert not registry.is_patched(cls, "__init__") and fix.targets == []
    assert fix.problems == ["vllm.v1.engine.async_llm.AsyncLLM.check_health or __init__ not found"]
    # AsyncLLM is not a class.
    monkeypatch.setattr(sys.modules["vllm.v1.engine.async_llm"], "AsyncLLM", lambda: None)
    fix = health_fix.EngineHealth()
    assert fix._on_import("vllm.v1.engine.async_llm") is True
    assert fix.targets == [] and len(fix.problems) == 1
    # The client's utility call cannot pick one engine: warned once, nothing patched.
    cls = _vllm_modules(monkeypatch, engine_param=False)
    fix = health_fix.EngineHealth()
    with caplog.at_level(logging.WARNING, logger="vllm.mmcache_fix"):
        assert fix._on_import("vllm.v1.engine.async_llm") is True
        (problem,) = fix.problems
        (warned,) = records(caplog, "has no engine= parameter")  # at the first import
        assert fix._on_import("vllm.v1.engine.async_llm") is True
    assert not registry.is_patched(cls, "check_health") and fix.targets == []
    assert problem.startswith("vllm.v1.engine.core_client.AsyncMPClient._call_utility_async has")
    assert warned.endswith(problem)
    assert len(records(caplog, "has no engine= parameter")) == 1


def test_the_client_class_is_old_only_when_its_call_cannot_pick_an_engine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import sys

    monkeypatch.delitem(sys.modules, "vllm.v1.engine.core_client", raising=False)
    assert health_fix.EngineHealth._old_client_class() is None
    _vllm_modules(monkeypatch)
    assert health_fix.EngineHealth._old_client_class() is None
    _vllm_modules(monkeypatch, engine_param=False)
    assert health_fix.EngineHealth._old_client_class() == "vllm.v1.engine.core_client.AsyncMPClient"


def test_the_stuck_error_is_vllms_engine_dead_error_or_a_runtime_error(
    monkeypatch: pytest.MonkeyPatch, engine_dead_error: type
) -> None:
    import sys

    fix = health_fix.EngineHealth()
    try:
        raise KeyError("inside vLLM")
    except KeyError:
        first = fix.error("EngineCore 0 has not answered")
    assert isinstance(first, engine_dead_error) and type(first) is not engine_dead_error
    assert str(first) == "EngineCore 0 has not answered" and first.__suppress_context__
    assert type(first).__name__ == "EngineStuck" and type(first).__module__ == health_fix.__name__
    assert type(fix.error("again")) is type(first)  # one class per base
    module = sys.modules["vllm.v1.engine.exceptions"]
    for base in (None, "EngineDeadError", int):
        monkeypatch.setattr(module, "EngineDeadError", base)
        got = fix.error("stuck")
        assert type(got) is RuntimeError and str(got) == "stuck", base
    monkeypatch.delitem(sys.modules, "vllm.v1.engine.exceptions")
    assert type(fix.error("stuck")) is RuntimeError


def test_a_fix_that_was_never_installed_never_marks_the_process_serving() -> None:
    fix = health_fix.EngineHealth()  # no timeout read, no heartbeat

    async def go() -> None:
        engine = types.SimpleNamespace(engine_core=Client())
        fix.attach(engine)
        assert fix.verdict(engine) is None

    run(go())
    assert not fix.serving and fix.errors.total == 0


def test_every_failing_check_is_counted_and_signalled_per_stuck_engine() -> None:
    fix = _fix()
    failed: list[str] = []
    signals.ENGINE_HEALTH_FAILED.connect(failed.append)

    async def go() -> tuple[Any, ...]:
        client = Client(engines=2)
        client.hold = True
        engine = types.SimpleNamespace(engine_core=client)
        fix.attach(engine)
        beat = fix.liveness.heartbeats[client]  # type: ignore[union-attr]
        for now in (0.0, TIMEOUT / 2, TIMEOUT + 1, TIMEOUT + 2):
            beat.tick(client, now, responsive=True)
        verdicts = [fix.verdict(engine) for _ in range(2)]
        counts = [b.failed_checks for b in beat.beats]
        names = [b.name for b in beat.beats]
        beat.stop("done")
        return verdicts, counts, names

    try:
        verdicts, counts, names = run(go())
    finally:
        signals.ENGINE_HEALTH_FAILED.disconnect(failed.append)
    assert all(v is not None and v.count("has not answered") == 2 for v in verdicts), verdicts
    assert counts == [2, 2]
    assert sorted(failed) == sorted(names * 2)


def test_timeout_zero_outside_a_loop_is_not_serving_yet(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MMCACHE_FIX_HEALTH_TIMEOUT", "0")
    fix = health_fix.EngineHealth()
    fix._install()
    engine = types.SimpleNamespace(engine_core=Client())
    fix.attach(engine)  # vLLM built the client outside an event loop
    assert not fix.serving and fix.errors.total == 0 and fix.switched_off is None

    async def go() -> None:
        fix.attach(engine)

    run(go())
    assert fix.serving and fix.errors.total == 0


def test_the_installed_heartbeat_pings_until_the_fix_is_switched_off() -> None:
    fix = health_fix.EngineHealth()
    fix._install()

    async def go() -> tuple[Any, ...]:
        client = Client()
        engine = types.SimpleNamespace(engine_core=client)
        fix.attach(engine)
        beat = fix.liveness.heartbeats[client]  # type: ignore[union-attr]
        await _until(lambda: bool(client.calls))
        running = beat.stopped
        fix.switched_off = "internal error at a test"
        await _until(lambda: beat.stopped is not None)
        stopped = beat.stopped
        beat.stop("done")
        return running, stopped, len(client.calls)

    running, stopped, calls = run(go())
    assert running is None and calls >= 1
    assert stopped == "switched off after an internal error"
