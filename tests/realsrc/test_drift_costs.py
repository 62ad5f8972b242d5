"""What the drift guard's bookkeeping costs per request: bounded, whatever the sizes.

* The shadow's positions of keys that left the cache stay bounded by the cache's size
  when requests commit after their items were evicted (no rollback to prune them).
* A rollback moves what the request touched, not the whole order (a cache of thousands
  of entries was re-sorted on every rollback), and evictions still follow EngineCore's
  order afterwards.
* Sizing the inputs kept for re-sending looks at a bounded number of objects, however
  long the prompt.

Counts, not times (the times: ``scripts/bench-request-cost``). On stand-ins of vLLM's
classes around a released vLLM's real ``LRUCache`` (:mod:`harness.drift_sim`).
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Iterator
from typing import Any

import pytest
from PIL import Image

from harness import drift_sim
from vllm_mmcache_fix import drift_guard as drift
from vllm_mmcache_fix.drift_guard import attempts, journal, sender

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


def shadow_of(world: drift_sim.World) -> journal.Shadow:
    shadow = world.sender.__dict__[sender.SHADOW_ATTR]
    assert isinstance(shadow, journal.Shadow)
    return shadow


async def submit(world: drift_sim.World, prompt: dict, request_id: str) -> int:
    outs = [o async for o in world.engine.generate(prompt, None, request_id)]
    return 500 if outs[-1].outputs[0].finish_reason == "error" else 200


def test_positions_of_evicted_keys_stay_bounded_without_rollbacks(modules) -> None:
    """Each request's image is evicted by four others before it commits: 4,004 positions
    after 2,000 such requests with a 4-item cache before the bound."""
    drift.install()
    world = drift_sim.World(modules, capacity=4)
    rounds = 300

    async def go() -> list[int]:
        got = []
        for i in range(rounds):
            # Processed one after another (as the multimodal executor does), sent after:
            # the last four evict the first before it reaches EngineCore.
            prompts = [world.render([f"img{i}-{j}"]) for j in range(5)]
            for j, prompt in enumerate(prompts):
                got.append(await submit(world, prompt, f"r{i}-{j}"))
        return got

    got = asyncio.run(go())
    assert got.count(200) == len(got)
    shadow = shadow_of(world)
    cached = len(world.p0_keys())
    assert drift.status()["counts"]["commits"] == 5 * rounds
    assert len(shadow.base) <= 2 * cached + 64
    assert len(shadow.seq) <= 2 * cached + 64


class CountingOrder(collections.OrderedDict):
    """An LRU order that counts how often a key is moved."""

    moves = 0

    def move_to_end(self, key: Any, last: bool = True) -> None:
        CountingOrder.moves += 1
        super().move_to_end(key, last)


MAX_MOVES = 200
"""Moves of keys one rollback may make in a 3,000-entry order (two keys placed)."""


@pytest.mark.parametrize("where", [0.5, 0.02, 0.98])
def test_a_rollback_moves_what_the_request_touched(modules, monkeypatch, where: float) -> None:
    size = 3000
    drift.install()
    world = drift_sim.World(modules, capacity=size)
    world.sender._cache._LRUCache__order = CountingOrder()
    world.receiver._cache._LRUCache__order = collections.OrderedDict()
    images = [f"img{i}" for i in range(size)]
    moves_in_rollback: list[int] = []
    rollback = journal.Shadow.rollback

    def counted(self: journal.Shadow, j: journal.Journal) -> journal.Rollback:
        before = CountingOrder.moves
        try:
            return rollback(self, j)
        finally:
            moves_in_rollback.append(CountingOrder.moves - before)

    monkeypatch.setattr(journal.Shadow, "rollback", counted)
    touched = images[int(where * (size - 1))]

    async def go() -> list[int]:
        got = [await world.request([image]) for image in images]
        # Touches one cached image, inserts a new one (evicting the oldest): rejected.
        got.append(await world.request([touched, "new"], long=True))
        assert drift.status()["counts"]["rollbacks"] == 1
        # The rolled-back key and the restored entry: a few short scans, not the cache.
        assert len(moves_in_rollback) == 1 and moves_in_rollback[0] <= MAX_MOVES, moves_in_rollback
        p0 = [k for k in shadow_of(world).logical_order() if k in world.p0_keys()]
        assert p0 == world.p1_order() == images
        # A full turn of the cache: every eviction takes what EngineCore evicts.
        for i in range(size + 10):
            got.append(await world.request([f"fresh{i}"]))
            if i % 500 == 0 or i >= size - 5:
                assert world.p0_keys() == world.p1_keys(), i
        return got

    got = asyncio.run(go())
    assert got.count(400) == 1 and got.count(500) == 0, got
    assert drift.status()["counts"]["drift_events"] == 0


class CountingList(list):
    """A list that counts the elements read through iteration."""

    read = 0

    def __iter__(self) -> Iterator[Any]:
        for item in super().__iter__():
            CountingList.read += 1
            yield item


@pytest.mark.parametrize("tokens", [2_000, 128_000])
def test_sizing_a_request_reads_a_bounded_number_of_objects(tokens: int) -> None:
    image = Image.new("RGB", (896, 896))
    prompt_ids = CountingList(range(tokens))
    replay = drift_sim.types.SimpleNamespace(
        args=({"prompt_token_ids": prompt_ids}, {"image": [image]}), kwargs={}
    )
    CountingList.read = 0
    size = attempts.replay_size(replay)
    assert size == 896 * 896 * 3
    assert CountingList.read == 0  # token ids hold no buffer: never walked

    many = CountingList(object() for _ in range(tokens))
    CountingList.read = 0
    attempts.estimate_bytes(({"objects": many}, {"image": [image]}))
    assert CountingList.read <= attempts._SIZE_WALK_LIMIT
