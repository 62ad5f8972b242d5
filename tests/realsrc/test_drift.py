"""P0/P1 multimodal cache drift: prevention (journal + rollback) and recovery (re-send).

On stand-ins of vLLM's classes around a released vLLM's real ``LRUCache``
(:mod:`harness.drift_sim`); vLLM's own classes: ``tests/installed/test_drift_real.py``.
"""

from __future__ import annotations

import asyncio
import gc
import random
import sys
from collections.abc import Iterator

import pytest

from harness import drift_sim
from vllm_mmcache_fix import drift_guard as drift
from vllm_mmcache_fix import plugin
from vllm_mmcache_fix.core import imports, log
from vllm_mmcache_fix.drift_guard import sender

LRU_VERSION = "0.24.0"  # touch() of a missing key adds nothing from here on


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


def statuses(world: drift_sim.World, plan: list[tuple[list[str], bool]]) -> list[int]:
    async def go() -> list[int]:
        return [await world.request(images, long) for images, long in plan]

    return run(go())


def in_step(world: drift_sim.World) -> bool:
    p0 = [k for k in world.p0_order() if k in world.p0_keys()]
    p1 = [k for k in world.p1_order() if k in world.p1_keys()]
    return p0 == p1


INCIDENT = [(["x"], True), (["x"], False), (["x"], False)]


@pytest.mark.parametrize("new_style", [False, True])
def test_simulation_shows_the_incident_without_the_fix(modules, new_style: bool) -> None:
    world = drift_sim.World(modules, new_style=new_style)
    got = statuses(world, INCIDENT)
    # <= 0.27: every retry fails; >= 0.28: one failure, then P0 has dropped the hash.
    assert got == ([400, 500, 500] if not new_style else [400, 500, 200])


@pytest.mark.parametrize("new_style", [False, True])
def test_rejected_request_is_undone(modules, new_style: bool) -> None:
    drift.install()
    assert set(drift.status()["patched"]) == {"sender", "processor", "process_inputs", "generate"}
    world = drift_sim.World(modules, new_style=new_style)
    assert statuses(world, INCIDENT) == [400, 200, 200]
    counts = drift.status()["counts"]
    assert counts["rollbacks"] == 1
    assert counts["rollback_keys_removed"] == 1
    assert counts["drift_events"] == 0
    assert in_step(world)


def test_rollback_restores_order_and_evicted_entries(modules) -> None:
    drift.install()
    world = drift_sim.World(modules, capacity=3)
    assert statuses(world, [(["a"], False), (["b"], False), (["c"], False)]) == [200] * 3
    before = world.p0_order()
    # Touches "a" (oldest -> newest) and inserts "d", which evicts "b".
    assert statuses(world, [(["a", "d"], True)]) == [400]
    assert world.p0_order() == before == ["a", "b", "c"]
    counts = drift.status()["counts"]
    assert counts["rollback_entries_restored"] == 1
    assert counts["rollback_reorders"] == 1
    # Next eviction picks the same victim in P0 and P1.
    assert statuses(world, [(["e"], False), (["b"], False)]) == [200, 200]
    assert in_step(world)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("new_style", [False, True])
def test_random_traffic_stays_in_step(modules, seed: int, new_style: bool) -> None:
    drift.install()
    rng = random.Random(seed)
    world = drift_sim.World(modules, capacity=4, new_style=new_style)
    pool = [f"img{i}" for i in range(9)]
    plan = []
    for _ in range(150):
        images = rng.sample(pool, rng.choice([1, 1, 2, 3]))
        plan.append((images, rng.random() < 0.3))
    got = statuses(world, plan)
    assert 500 not in got
    assert in_step(world)
    assert drift.status()["counts"]["drift_events"] == 0


@pytest.mark.parametrize("seed", range(6))
def test_random_traffic_drifts_without_the_fix(modules, seed: int) -> None:
    rng = random.Random(seed)
    world = drift_sim.World(modules, capacity=4)
    pool = [f"img{i}" for i in range(9)]
    plan = [(rng.sample(pool, rng.choice([1, 2])), rng.random() < 0.3) for _ in range(150)]
    assert 500 in statuses(world, plan)


@pytest.mark.parametrize("new_style", [False, True])
def test_recovery_resends_with_data(modules, monkeypatch, new_style: bool) -> None:
    monkeypatch.setenv(drift.ENV_DRIFT, "recover")
    drift.install()
    world = drift_sim.World(modules, new_style=new_style)
    # Without prevention the 400 leaves "x" in P0 only; the next request drifts and is
    # re-sent with the data before anything reaches the client.
    assert statuses(world, INCIDENT + [(["x", "y"], False)]) == [400, 200, 200, 200]
    counts = drift.status()["counts"]
    assert counts["drift_events"] == 1
    assert counts["recoveries"] == 1
    assert counts["recovery_failures"] == 0
    assert counts["rollbacks"] == 0
    assert in_step(world)
    # The re-sent request carried the data of every item.
    resent = world.engine.sent[-3]
    assert all(f.data is not None for f in resent.mm_features)


def test_recovery_of_a_two_image_request_with_one_drifted(modules, monkeypatch) -> None:
    monkeypatch.setenv(drift.ENV_DRIFT, "recover")
    drift.install()
    world = drift_sim.World(modules, capacity=4)
    plan = [(["a"], False), (["b"], True), (["a", "b"], False), (["b", "c"], False)]
    assert statuses(world, plan) == [200, 400, 200, 200]
    assert drift.status()["counts"]["recoveries"] == 1
    assert in_step(world)


def test_prevention_and_recovery_together_under_random_drift(modules) -> None:
    """Drift from another cause (P0 forgets an item P1 still has) is recovered."""
    drift.install()
    world = drift_sim.World(modules, capacity=3)
    assert statuses(world, [(["a"], False), (["b"], False)]) == [200, 200]
    # Simulate an unknown cause: P1 lost "a" while P0 still has it.
    world.receiver._cache.pop("a")
    assert statuses(world, [(["a"], False), (["a"], False)]) == [200, 200]
    counts = drift.status()["counts"]
    assert counts["drift_events"] == 1 and counts["recoveries"] == 1
    assert in_step(world)


def test_in_flight_insert_is_not_trusted_by_other_requests(modules) -> None:
    drift.install()
    world = drift_sim.World(modules)
    first = world.render(["x"], text_len=100)  # processed, not yet checked
    second = world.render(["x"])  # concurrent request with the same image
    assert second["mm_kwargs"]["image"][0] is not None  # sends the data itself
    assert drift.status()["counts"]["tentative_bypasses"] == 1

    async def go() -> None:
        outs = [o async for o in world.engine.generate(second, None, "second")]
        assert outs[-1].outputs[0].finish_reason == "length"
        with pytest.raises(ValueError):
            async for _ in world.engine.generate(first, None, "first"):
                pass

    run(go())
    # "x" stays: the second request sent it and P1 holds it.
    assert "x" in world.p0_keys() and "x" in world.p1_keys()
    assert in_step(world)


def test_input_dropped_before_the_engine_is_rolled_back(modules) -> None:
    drift.install()
    world = drift_sim.World(modules)
    world.render(["x"])  # e.g. the server rejected the request before generate()
    assert "x" in world.p0_keys()
    gc.collect()
    assert statuses(world, [(["y"], False)]) == [200]
    assert "x" not in world.p0_keys()
    assert drift.status()["pending"] == 0
    assert in_step(world)


def test_clear_cache_voids_pending_journals(modules) -> None:
    drift.install()
    world = drift_sim.World(modules)
    prompt = world.render(["x"], text_len=100)
    world.sender.clear_cache()
    world.receiver._cache.clear()
    with pytest.raises(ValueError):
        run(_consume(world.engine.generate(prompt, None, "r")))
    assert world.p0_keys() == set()
    assert statuses(world, [(["x"], False)]) == [200]


async def _consume(stream) -> list:
    return [o async for o in stream]


def test_other_sender_classes_are_left_alone(modules) -> None:
    drift.install()
    cache_mod = modules["vllm.multimodal.cache"]
    shm = cache_mod.ShmObjectStoreSenderCache(4)
    assert "get_and_update_item" in type(shm).__dict__
    assert getattr(type(shm).get_and_update_item, "__mmcache_fix_patch__", None) is None
    processing = modules["vllm.multimodal.processing"]
    proc = processing.BaseMultiModalProcessor(shm)
    out = proc.apply(processing.ProcessorInputs([("x", 1)], 4))
    out2 = proc.apply(processing.ProcessorInputs([("x", 1)], 4))
    assert out2["mm_kwargs"]["image"][0] == ("addr", "x")
    assert drift.status()["pending"] == 0
    del out


def test_off_mode_patches_nothing(modules, monkeypatch) -> None:
    monkeypatch.setenv(drift.ENV_DRIFT, "off")
    st = drift.install()
    assert st["patched"] == {} and st["mode"] == "off"


def test_bad_mode_falls_back_to_on(modules, monkeypatch) -> None:
    monkeypatch.setenv(drift.ENV_DRIFT, "sometimes")
    st = drift.install()
    assert st["mode"] == "on"
    assert any("sometimes" in p for p in st["problems"])


def test_unknown_layout_applies_nothing_for_that_target(modules) -> None:
    del modules["vllm.v1.engine.input_processor"].InputProcessor.process_inputs
    st = drift.install()
    assert "process_inputs" not in st["patched"]
    assert any("process_inputs" in p for p in st["problems"])
    # Without a commit point no journal is kept: the cache behaves as vLLM's own.
    cache_mod = modules["vllm.multimodal.cache"]
    processing = modules["vllm.multimodal.processing"]
    proc = processing.BaseMultiModalProcessor(cache_mod.MultiModalProcessorSenderCache(4))
    out = proc.apply(processing.ProcessorInputs([("x", 1)], 4))
    assert out["mm_kwargs"]["image"][0] is not None
    counts = drift.status()["counts"]
    assert counts["journals"] == 0 and drift.status()["pending"] == 0


def test_patch_when_module_is_imported_later(modules) -> None:
    later = sys.modules.pop("vllm.v1.engine.async_llm")
    st = drift.install()
    assert "generate" not in st["patched"]
    assert plugin.DRIFT_GUARD.waiting_for_import
    # What the import hook does once the module has executed:
    sys.modules["vllm.v1.engine.async_llm"] = later
    imports._notify("vllm.v1.engine.async_llm")
    assert "generate" in drift.status()["patched"]
    assert not plugin.DRIFT_GUARD.waiting_for_import


def test_uninstall_restores_vllm(modules) -> None:
    cls = modules["vllm.multimodal.cache"].MultiModalProcessorSenderCache
    original = cls.__dict__["get_and_update_item"]
    drift.install()
    assert cls.__dict__["get_and_update_item"] is not original
    world = drift_sim.World(modules)
    statuses(world, [(["x"], False)])
    drift.uninstall()
    assert cls.__dict__["get_and_update_item"] is original
    assert "popitem" not in world.sender._cache.__dict__


def test_drift_is_logged_rate_limited(modules, monkeypatch, caplog) -> None:
    monkeypatch.setenv(drift.ENV_DRIFT, "recover")
    monkeypatch.setattr(drift.GUARD.state, "drift_limiter", log.RateLimiter(3600))
    drift.install()
    world = drift_sim.World(modules)
    with caplog.at_level("INFO", logger="vllm.mmcache_fix"):
        statuses(world, INCIDENT + [(["z"], True), (["z"], False)])
    lines = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(lines) == 1
    assert lines[0].startswith("vllm-mmcache-fix: P0/P1 multimodal cache drift")
    assert drift.status()["counts"]["drift_events"] == 2


def test_late_rollback_after_other_evictions_keeps_p0_within_p1(modules) -> None:
    """A rejected request resolved after later evictions restores nothing stale."""
    drift.install()
    world = drift_sim.World(modules, capacity=3)
    assert statuses(world, [(["a"], False), (["b"], False), (["c"], False)]) == [200] * 3
    pending = world.render(["d"], text_len=100)  # evicts "a"; not checked yet
    assert statuses(world, [(["e"], False), (["f"], False)]) == [200, 200]
    with pytest.raises(ValueError):
        run(_consume(world.engine.generate(pending, None, "late")))
    assert world.p0_keys() <= world.p1_keys()
    assert statuses(world, [([k], False) for k in "abcdef"]) == [200] * 6
    assert in_step(world)


@pytest.mark.parametrize("order", ["first-rejected-first", "second-rejected-first"])
def test_two_interleaved_rejections(modules, order: str) -> None:
    drift.install()
    world = drift_sim.World(modules, capacity=4)
    assert statuses(world, [(["a"], False), (["b"], False)]) == [200, 200]
    first = world.render(["a", "x"], text_len=100)
    second = world.render(["b", "x"], text_len=100)  # x is tentative: sent with data
    pair = [("p1", first), ("p2", second)]
    if order == "second-rejected-first":
        pair.reverse()
    for name, prompt in pair:
        with pytest.raises(ValueError):
            run(_consume(world.engine.generate(prompt, None, name)))
    assert world.p0_order() == ["a", "b"]
    assert statuses(world, [(["x"], False), (["a", "b"], False)]) == [200, 200]
    assert in_step(world)


def test_a_processor_only_cache_is_not_tracked(modules) -> None:
    drift.install()
    world = drift_sim.World(modules)
    statuses(world, [(["x"], False)])

    class ProcessorOnlyCache(modules["vllm.multimodal.cache"].ShmObjectStoreSenderCache):
        def __init__(self) -> None:
            super().__init__(4)
            self._cache = modules["vllm.multimodal.cache"]._lru(4)

    other = ProcessorOnlyCache()
    processing = modules["vllm.multimodal.processing"]
    processing.BaseMultiModalProcessor(other).apply(processing.ProcessorInputs([("y", 1)], 4))
    assert sender.SHADOW_ATTR not in other.__dict__
    assert "popitem" not in other._cache.__dict__


@pytest.mark.parametrize("resolved", ["after-reuse", "before-reuse"])
def test_late_rejection_that_moved_a_cached_key(modules, resolved: str) -> None:
    """A rejected request resolved late moved "a" in P0 only; P1 evicted "a" meanwhile."""
    drift.install()
    world = drift_sim.World(modules, capacity=3)
    assert statuses(world, [(["a"], False), (["b"], False), (["c"], False)]) == [200] * 3
    pending = world.render(["a"], text_len=100)  # moves "a" to most-recent in P0 only
    assert statuses(world, [(["d"], False)]) == [200]
    assert "a" in world.p0_keys() and "a" not in world.p1_keys()
    if resolved == "before-reuse":
        with pytest.raises(ValueError):
            run(_consume(world.engine.generate(pending, None, "late")))
    assert statuses(world, [(["a"], False)]) == [200]
    if resolved == "after-reuse":
        with pytest.raises(ValueError):
            run(_consume(world.engine.generate(pending, None, "late")))
    assert drift.status()["counts"]["drift_events"] == 0
    assert world.p0_keys() <= world.p1_keys()
    assert statuses(world, [([k], False) for k in "abcde"]) == [200] * 5
    assert drift.status()["counts"]["drift_events"] == 0
