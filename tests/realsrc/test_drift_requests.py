"""What the drift guard keeps for each request, and for how long.

Recovery keeps, for a request that sent items as already cached, the means to
process it again: its processor inputs, which hold the decoded images. Only a
request ``AsyncLLM.generate`` can re-send may keep them, only until its first
output, and all of them together only up to a byte budget. Pooling requests
(``encode``), streaming-input sessions and requests that end in any way keep
nothing; two requests with the same client id never use each other's.

On stand-ins of vLLM's classes around a released vLLM's real ``LRUCache``
(:mod:`harness.drift_sim`). The real server: ``tests/e2e/test_e2e_pooling.py``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import pytest

from harness import drift_sim
from vllm_mmcache_fix import drift_guard as drift
from vllm_mmcache_fix.drift_guard import GUARD, attempts

LRU_VERSION = "0.24.0"


@pytest.fixture
def modules(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict]:
    monkeypatch.delenv(drift.ENV_DRIFT, raising=False)
    mods = drift_sim.install_modules(LRU_VERSION)
    try:
        yield mods
    finally:
        drift.uninstall()
        drift_sim.remove_modules()


def run(coro):
    return asyncio.run(coro)


async def consume(stream: AsyncIterator) -> list:
    return [out async for out in stream]


def warm_world(modules: dict, images: str = "ab") -> drift_sim.World:
    """Installed guard, and ``images`` cached in P0 and P1 (sent as cached from now on)."""
    drift.install()
    world = drift_sim.World(modules, capacity=4)
    for image in images:
        assert run(world.request([image])) == 200
    return world


def test_pooling_requests_keep_no_decoded_images(modules) -> None:
    world = warm_world(modules)

    async def go() -> list[int]:
        return [await world.embed([image]) for image in "ab" * 20]

    assert run(go()) == [200] * 40
    assert world.inputs_alive() == 0


def test_streaming_input_sessions_keep_no_decoded_images(modules) -> None:
    world = warm_world(modules)

    async def chunks() -> AsyncIterator[dict]:
        for image in "abab":
            yield world.render([image])

    outs = run(consume(world.engine.generate(chunks(), None, "session")))
    assert [o.outputs[0].finish_reason for o in outs] == [None] * 4 + ["stop"]
    assert world.inputs_alive() == 0


def test_requests_keep_nothing_however_they_end(modules) -> None:
    world = warm_world(modules)
    world.receiver._cache.pop("a")  # the next request with "a" drifts and is recovered

    async def cancelled_while_queued() -> None:
        world.engine.gate = asyncio.Event()
        task = asyncio.ensure_future(consume(world.engine.generate(world.render(["b"]), None, "q")))
        await asyncio.sleep(0.01)
        assert GUARD.state.attempts.attempts()["open"] == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        world.engine.gate = None

    async def closed_after_first_output() -> None:
        stream = world.engine.generate(world.render(["b"]), None, "closed")
        await stream.__anext__()
        await stream.aclose()

    async def go() -> list[int]:
        got = [await world.request(["a"]), await world.request(["b"], long=True)]
        await cancelled_while_queued()
        await closed_after_first_output()
        got.append(await world.request(["a", "b"]))
        return got

    assert run(go()) == [200, 400, 200]
    assert drift.status()["counts"]["recoveries"] == 1
    assert world.inputs_alive() == 0
    assert GUARD.state.attempts.attempts() == {
        "open": 0,
        "holding_inputs": 0,
        "input_bytes": 0,
        "refused_for_size": 0,
    }


def test_inputs_kept_for_requests_in_flight_are_bounded_in_bytes(modules, monkeypatch) -> None:
    world = warm_world(modules)
    image = drift_sim.DECODED_BYTES  # one image of size 1
    monkeypatch.setattr(GUARD.state.attempts, "replays", attempts.ReplayBudget(int(2.5 * image)))

    async def go() -> list[list]:
        world.engine.gate = asyncio.Event()
        tasks = []
        for i in range(6):
            stream = world.engine.generate(world.render(["a"]), None, f"r{i}")
            tasks.append(asyncio.ensure_future(consume(stream)))
            await asyncio.sleep(0.001)  # reaches EngineCore's queue before the next one
        held = GUARD.state.attempts.attempts()
        assert held["open"] == 6
        assert held["holding_inputs"] == 2
        assert image * 2 <= held["input_bytes"] <= 2.5 * image
        assert held["refused_for_size"] == 4
        assert world.inputs_alive() == 2
        world.engine.gate.set()
        return list(await asyncio.gather(*tasks))

    outs = run(go())
    assert [o[-1].outputs[0].finish_reason for o in outs] == ["length"] * 6
    assert world.inputs_alive() == 0
    assert GUARD.state.attempts.attempts()["input_bytes"] == 0


def test_duplicate_client_request_ids_do_not_cross(modules) -> None:
    """Two concurrent requests with the same client id; only the first one drifts."""
    world = warm_world(modules)
    world.receiver._cache.pop("a")
    first = world.render(["a"])
    second = world.render(["b"])

    async def go() -> list[list]:
        return list(
            await asyncio.gather(
                consume(world.engine.generate(first, None, "same-id")),
                consume(world.engine.generate(second, None, "same-id")),
            )
        )

    outs = run(go())
    assert [o[-1].outputs[0].finish_reason for o in outs] == ["length", "length"]
    counts = drift.status()["counts"]
    assert counts["drift_events"] == 1
    assert counts["recoveries"] == 1
    assert counts["recovery_unavailable"] == 0
    # The re-sent request is the drifted one, with its own item's data.
    resent = world.engine.sent[-1]
    assert [(f.mm_hash, f.data is not None) for f in resent.mm_features] == [("a", True)]
    assert world.inputs_alive() == 0
