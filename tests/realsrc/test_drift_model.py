"""The drift guard against P1, with requests pending together and resolved in any order.

Requests are processed (P0's sender cache changes) and stay pending; later each one is
rejected (rolled back), reaches EngineCore (committed, P1's cache changes) or is dropped
(rolled back at the next safe point), in any order. With a cache that holds every image
(so the order alone is in question), after every step:

* every item P0 would send as already cached is held by P1 (apart from those a pending
  request holds);
* P0 and P1 order the keys no pending request touched the same way;
* with nothing pending, P0's order is P1's order;
* no request gets a 500 and the guard never marks a key doubtful.

With a small cache (evictions while requests are pending) the guard cannot always know
what EngineCore evicted instead (see :mod:`vllm_mmcache_fix.drift_guard.journal`): there
the machine asserts that no client sees a 500, that drifts are recovered and that the
guard stays on.

A hypothesis state machine explores the interleavings; direct tests pin the example of
issue 22 (two rejected requests that moved the same key) and every order of rejections
and commits of three requests sharing keys.

On stand-ins of vLLM's classes around a released vLLM's real ``LRUCache``
(:mod:`harness.drift_sim`).
"""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from harness import drift_sim
from vllm_mmcache_fix import drift_guard as drift
from vllm_mmcache_fix.drift_guard import GUARD

# 0.23.0's touch adds missing keys to the order; 0.24.0's and later (0.34.0) do not.
LRU_VERSIONS = ("0.23.0", "0.34.0")
EXAMPLES = int(os.environ.get("MMCACHE_HARNESS_HYPOTHESIS_EXAMPLES", "2000")) // 8
KEYS = "abcdef"
_loop = asyncio.new_event_loop()


def run(coro: Any) -> Any:
    """Run a coroutine on this module's event loop (one loop for all steps: cheaper)."""
    return _loop.run_until_complete(coro)


@pytest.fixture
def modules_of(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    monkeypatch.delenv(drift.ENV_DRIFT, raising=False)

    def load(version: str) -> dict:
        return drift_sim.install_modules(version)

    try:
        yield load
    finally:
        drift.uninstall()
        drift_sim.remove_modules()


class Pending:
    def __init__(self, images: list[str], prompt: dict, long: bool) -> None:
        self.images = images
        self.prompt: dict | None = prompt
        self.long = long


def resolve(world: drift_sim.World, request: Pending) -> int:
    """Submit a processed request: 400 (rejected), 200 or 500."""
    prompt, request.prompt = request.prompt, None

    async def go() -> int:
        try:
            outs = [o async for o in world.engine.generate(prompt, None, "r")]
        except ValueError:
            return 400
        return 500 if outs[-1].outputs[0].finish_reason == "error" else 200

    return run(go())


def p0_view(world: drift_sim.World) -> list[str]:
    data = world.p0_keys()
    return [k for k in world.p0_order() if k in data]


def p1_view(world: drift_sim.World) -> list[str]:
    data = world.p1_keys()
    return [k for k in world.p1_order() if k in data]


def check(world: drift_sim.World, pending: list[Pending]) -> None:
    """P0 against P1 (see the module docstring). Doubtful keys are those the guard knows
    it cannot place (a rollback after later evictions): they go with their data."""
    busy = {k for request in pending for k in request.images}
    doubtful = set().union(*(s.doubtful for s in GUARD.state.shadows))
    p0, p1 = p0_view(world), p1_view(world)
    missing = set(p0) - set(p1) - busy - doubtful
    assert not missing, (p0, p1, missing)
    quiet = [k for k in p0 if k in set(p1) and k not in busy and k not in doubtful]
    assert quiet == [k for k in p1 if k in set(quiet)], (p0, p1, busy)
    if not pending:
        known = [k for k in p0 if k not in doubtful]
        assert known == [k for k in p1 if k in set(known)], (p0, p1)


# --------------------------------------------------------------------------- examples


def test_two_rejected_requests_that_moved_the_same_key(modules_of) -> None:
    """Issue 22: 0.23.0's LRU at capacity 3 holding K, A, B; R1 = [K] and R2 = [K]
    pending, both rejected, oldest first."""
    world = drift_sim.World(modules_of("0.23.0"), capacity=3)
    drift.install()
    for image in "KAB":
        assert run(world.request([image])) == 200
    first = Pending(["K"], world.render(["K"], text_len=100), True)
    second = Pending(["K"], world.render(["K"], text_len=100), True)
    assert resolve(world, first) == 400
    assert resolve(world, second) == 400
    assert p0_view(world) == p1_view(world) == ["K", "A", "B"]
    # A new image evicts the oldest on both sides; K is sent with its data again.
    assert run(world.request(["C"])) == 200
    assert run(world.request(["K"])) == 200
    assert drift.status()["counts"]["drift_events"] == 0
    assert p0_view(world) == p1_view(world)


PLANS = [(["K"], True), (["K", "A"], True), (["B", "K"], False)]


@pytest.mark.parametrize("version", LRU_VERSIONS)
@pytest.mark.parametrize("order", list(itertools.permutations(range(3))))
@pytest.mark.parametrize("rejected", list(itertools.product((False, True), repeat=3)))
def test_every_order_of_rejections_and_commits(
    modules_of, version: str, order: tuple[int, ...], rejected: tuple[bool, ...]
) -> None:
    world = drift_sim.World(modules_of(version), capacity=4)
    drift.install()
    for image in "KAB":
        assert run(world.request([image])) == 200
    pending = [
        Pending(images, world.render(images, text_len=100 if reject else 4), reject)
        for (images, _), reject in zip(PLANS, rejected)
    ]
    check(world, pending)
    for index in order:
        request = pending[index]
        assert resolve(world, request) == (400 if request.long else 200)
        check(world, [r for r in pending if r.prompt is not None])
    for image in "CKDAB":
        assert run(world.request([image])) == 200
        check(world, [])
    assert drift.status()["counts"]["drift_events"] == 0


@pytest.mark.xfail(
    strict=True,
    reason="known gap: a request that reached EngineCore re-inserted items a pending "
    "request had inserted in P0 (and evicted for); EngineCore evicted by its own order "
    "instead, which the later rollback cannot see",
)
def test_evictions_for_a_pending_request_that_is_rolled_back_later(modules_of) -> None:
    world = drift_sim.World(modules_of("0.24.0"), capacity=4)
    drift.install()
    assert run(world.request(["d", "a", "f"])) == 200
    pending = Pending(["e", "c", "d"], world.render(["e", "c", "d"], text_len=100), True)
    # c and e look uncached (the pending request holds them): sent with their data.
    assert run(world.request(["c", "e"])) == 200
    assert resolve(world, pending) == 400
    check(world, [])


# --------------------------------------------------------------------------- machine


class GuardMachine(RuleBasedStateMachine):
    MODULES: dict = {}
    EVICTIONS = False

    def __init__(self) -> None:
        super().__init__()
        self.world: drift_sim.World
        self.pending: list[Pending] = []

    # A request never holds more items than the cache (vLLM fails those on its own).
    @initialize(capacity=st.integers(3, 5), new_style=st.booleans())
    def setup(self, capacity: int, new_style: bool) -> None:
        drift.uninstall()
        drift.install()
        if not self.EVICTIONS:
            capacity = len(KEYS)
        self.world = drift_sim.World(self.MODULES, capacity=capacity, new_style=new_style)

    def teardown(self) -> None:
        self.pending.clear()
        drift.uninstall()

    images = st.lists(st.sampled_from(KEYS), min_size=1, max_size=3, unique=True)

    @rule(images=images, long=st.booleans())
    def process(self, images: list[str], long: bool) -> None:
        prompt = self.world.render(images, text_len=100 if long else 4)
        self.pending.append(Pending(images, prompt, long))

    @precondition(lambda self: self.pending)
    @rule(data=st.data())
    def submit(self, data: st.DataObject) -> None:
        request = self.pending.pop(data.draw(st.integers(0, len(self.pending) - 1)))
        assert resolve(self.world, request) == (400 if request.long else 200)

    @precondition(lambda self: self.pending)
    @rule(data=st.data())
    def drop(self, data: st.DataObject) -> None:
        """The server gives up on a processed request before it reaches the engine."""
        request = self.pending.pop(data.draw(st.integers(0, len(self.pending) - 1)))
        request.prompt = None  # freed now (no cycles): its weak reference queues the rollback
        assert GUARD.state.pending.has_deferred()
        GUARD.state.pending.drain_deferred()

    @rule(images=images, long=st.booleans())
    def request(self, images: list[str], long: bool) -> None:
        status = run(self.world.request(images, long))
        assert status == (400 if long else 200)

    @invariant()
    def in_step(self) -> None:
        if not hasattr(self, "world"):
            return
        assert drift.status()["switched_off"] is None
        if not self.EVICTIONS:
            check(self.world, self.pending)
            assert not set().union(*(s.doubtful for s in GUARD.state.shadows))


def _machine_settings(examples: int) -> settings:
    return settings(
        max_examples=max(50, examples),
        stateful_step_count=30,
        deadline=timedelta(seconds=5),
        suppress_health_check=[HealthCheck.too_slow],
        print_blob=True,
    )


@pytest.mark.parametrize("version", LRU_VERSIONS)
def test_guard_keeps_p1_order(modules_of, version: str) -> None:
    machine = type(f"OrderMachine_{version.replace('.', '_')}", (GuardMachine,), {})
    machine.MODULES = modules_of(version)
    run_state_machine_as_test(machine, settings=_machine_settings(EXAMPLES))


def test_guard_with_evictions_while_pending(modules_of) -> None:
    machine = type("EvictionMachine", (GuardMachine,), {"EVICTIONS": True})
    machine.MODULES = modules_of("0.24.0")
    run_state_machine_as_test(machine, settings=_machine_settings(EXAMPLES // 2))
