"""The /health round trip's logic, against a stand-in engine client (asyncio only)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from vllm_mmcache_fix.core.settings import DEFAULT_HEALTH_TIMEOUT, read_health_timeout
from vllm_mmcache_fix.engine_liveness import health as health_fix
from vllm_mmcache_fix.engine_liveness.probe import Liveness, engine_name
from vllm_mmcache_fix.vllm_layout import ENGINE_PING_METHOD


class Client:
    """Answers ``_call_utility_async`` after ``delay`` seconds (None: never)."""

    def __init__(self, delay: float | None, engines: int = 1, client_index: int = 0) -> None:
        self.delay = delay
        self.core_engines = [f"e{i}".encode() for i in range(engines)]
        self.client_index = client_index
        self.calls: list[tuple[str, Any]] = []
        self._release: asyncio.Event | None = None

    @property
    def release(self) -> asyncio.Event:
        # Made inside the running loop: on Python 3.9 an Event binds to a loop when built.
        if self._release is None:
            self._release = asyncio.Event()
        return self._release

    async def _call_utility_async(self, method: str, *args: Any, engine: Any) -> Any:
        self.calls.append((method, engine))
        if self.delay is None:
            await self.release.wait()
        else:
            await asyncio.sleep(self.delay)
        return {"schema": 1, "pid": 1, "counts": {"ghost_keys_dropped": 2, "protected": 1}}


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_timeout_setting() -> None:
    assert read_health_timeout({}).value == DEFAULT_HEALTH_TIMEOUT
    assert read_health_timeout({"MMCACHE_FIX_HEALTH_TIMEOUT": "2.5"}).value == 2.5
    assert read_health_timeout({"MMCACHE_FIX_HEALTH_TIMEOUT": "0"}).value == 0
    for bad in ("-1", "abc", "nan", "inf"):
        setting = read_health_timeout({"MMCACHE_FIX_HEALTH_TIMEOUT": bad})
        assert setting.value == DEFAULT_HEALTH_TIMEOUT and setting.problem, bad
        assert "MMCACHE_FIX_HEALTH_TIMEOUT" in setting.problem


def test_engine_names_follow_vllm() -> None:
    assert engine_name(0, 1) == "EngineCore"
    assert [engine_name(i, 2) for i in range(2)] == ["EngineCore_DP0", "EngineCore_DP1"]


def test_a_slow_answer_under_the_timeout_passes() -> None:
    seen: list[float] = []
    names: list[str] = []
    liveness = Liveness(1.0, on_round_trip=lambda e, s: (names.append(e), seen.append(s)))
    client = Client(delay=0.6)
    assert run(liveness.check(client)) is None
    assert client.calls == [(ENGINE_PING_METHOD, b"e0")]
    assert len(seen) == 1 and 0.55 < seen[0] < 1.0
    assert names == ["EngineCore"]
    assert liveness.engine_counts() == [{"ghost_keys_dropped": 2, "protected": 1}]


def test_no_answer_fails_within_the_timeout_and_names_the_engine(
    caplog: pytest.LogCaptureFixture,
) -> None:
    failed: list[str] = []
    liveness = Liveness(0.3, on_failure=failed.append)
    client = Client(delay=None, engines=2)

    async def go() -> tuple[str | None, float, str | None, float]:
        t0 = time.monotonic()
        first = await liveness.check(client)
        took = time.monotonic() - t0
        t1 = time.monotonic()
        second = await liveness.check(client)  # the same calls are still in flight
        return first, took, second, time.monotonic() - t1

    with caplog.at_level("WARNING", logger="vllm.mmcache_fix"):
        first, took, second, took2 = run(go())
    assert first is not None and "EngineCore_DP0" in first and "EngineCore_DP1" in first
    assert "since" not in first or "sent at" in first
    assert 0.29 < took < 1.0
    assert second is not None and took2 < 0.1  # fails at once: no new wait, no new message
    assert len(client.calls) == 2  # one message per engine, however often /health asks
    assert failed == ["EngineCore_DP0", "EngineCore_DP1"] * 2
    warnings = [r.getMessage() for r in caplog.records if "does not answer" in r.getMessage()]
    assert len(warnings) == 2  # one per engine and stall, not one per check
    assert "round trip sent at" in warnings[0] and "UTC" in warnings[0]


def test_an_engine_that_answers_late_passes_again(caplog: pytest.LogCaptureFixture) -> None:
    liveness = Liveness(0.2)
    client = Client(delay=None)

    async def go() -> tuple[str | None, str | None]:
        failing = await liveness.check(client)
        client.release.set()
        await asyncio.sleep(0.05)
        client.delay = 0.0
        return failing, await liveness.check(client)

    with caplog.at_level("WARNING", logger="vllm.mmcache_fix"):
        failing, again = run(go())
    assert failing is not None and again is None
    assert any("answers again" in r.getMessage() for r in caplog.records)


def test_the_check_never_blocks_the_event_loop() -> None:
    liveness = Liveness(0.5)
    client = Client(delay=None)

    async def go() -> int:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        task = asyncio.ensure_future(ticker())
        await liveness.check(client)
        task.cancel()
        return ticks

    assert run(go()) >= 20  # ~50 ticks of 10 ms while the check waited 0.5 s


def test_an_error_answer_means_alive() -> None:
    class Failing(Client):
        async def _call_utility_async(self, method: str, *args: Any, engine: Any) -> Any:
            raise Exception("Call to utility method failed")

    liveness = Liveness(0.5)
    client = Failing(0.0)
    assert run(liveness.check(client)) is None
    assert "utility method failed" in (liveness.status()[0]["error"] or "")


def test_only_the_first_api_server_exports_engine_counts() -> None:
    liveness = Liveness(0.5)
    run(liveness.check(Client(0.0, client_index=1)))
    assert liveness.engine_counts() is None


def test_the_wrapper_raises_vllms_engine_dead_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    import types

    module = types.ModuleType("vllm.v1.engine.exceptions")

    class EngineDeadError(Exception):
        pass

    module.EngineDeadError = EngineDeadError  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm.v1.engine.exceptions", module)
    fix = health_fix.EngineHealth()
    fix.liveness = Liveness(0.2)
    vllm_checked: list[bool] = []

    async def original(self: Any) -> None:
        vllm_checked.append(True)

    wrapped = health_fix.wrap_check_health(fix, original)
    engine = types.SimpleNamespace(engine_core=Client(delay=None))
    with pytest.raises(EngineDeadError, match="EngineCore has not answered"):
        run(wrapped(engine))
    assert vllm_checked == [True]
    engine_ok = types.SimpleNamespace(engine_core=Client(delay=0.0))
    fix.liveness = Liveness(0.2)
    assert run(wrapped(engine_ok)) is None
    # A client without utility calls (in-process engine): vLLM's answer only.
    assert run(wrapped(types.SimpleNamespace(engine_core=object()))) is None


def test_an_internal_error_in_the_round_trip_leaves_vllms_answer(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import types

    fix = health_fix.EngineHealth()

    class Broken(Liveness):
        async def check(self, client: Any) -> str | None:
            raise ValueError("broken bookkeeping")

    fix.liveness = Broken(0.2)

    async def original(self: Any) -> None:
        return None

    wrapped = health_fix.wrap_check_health(fix, original)
    engine = types.SimpleNamespace(engine_core=Client(delay=0.0))
    with caplog.at_level("WARNING", logger="vllm.mmcache_fix"):
        assert run(wrapped(engine)) is None
    assert fix.switched_off is not None
    assert fix.errors.total == 1
