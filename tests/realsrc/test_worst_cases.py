"""Worst cases of the fixed LRU on the real vLLM ``LRUCache`` classes.

Timings are printed by ``scripts/worst-cases`` (harness/programs/bench/worst_cases.py); here
only completion, results and operation counts are checked, never wall time.
"""

from __future__ import annotations

from typing import Any

import pytest

from harness import realsrc
from harness.programs.bench import worst_cases
from vllm_mmcache_fix.catalogue import NEWEST_SOURCES_CHECKED as NEWEST
from vllm_mmcache_fix.lru_eviction.cache import QUIET_ATTR, fixed_lru_class

VERSIONS: tuple[str, ...] = ("0.11.0", "0.23.0", "0.24.0", "0.29.0", NEWEST)
ALL_PINNED = "All items are pinned, cannot remove oldest from the cache."


def _classes(version: str) -> tuple[type, type]:
    base = realsrc.load_lru_module(version).LRUCache
    return base, fixed_lru_class(base)


def _consistent(cache: Any) -> bool:
    """Order and data hold the same keys and ``currsize`` is the sum of the sizes."""
    order, data = cache._LRUCache__order, cache._Cache__data
    return order.keys() == data.keys() and cache.currsize == sum(
        cache.getsizeof(v) for v in data.values()
    )


@pytest.mark.parametrize("version", VERSIONS)
def test_insert_behind_100k_order_only_keys(version: str) -> None:
    m = worst_cases.ghost_wall(_classes(version)[1], 100_000)
    assert m.popitem_calls == 1
    assert m.consistent


@pytest.mark.parametrize("version", VERSIONS)
def test_insert_with_100k_data_only_keys(version: str) -> None:
    m = worst_cases.orphan_wall(_classes(version)[1], 100_000)
    assert m.popitem_calls == 1
    assert m.consistent


@pytest.mark.parametrize("wall", ["ghost_wall", "orphan_wall"])
def test_repair_work_grows_linearly(wall: str) -> None:
    cls = _classes(NEWEST)[1]
    fn = getattr(worst_cases, wall)
    ops = {n: fn(cls, n, counting=True).operations for n in (1_000, 10_000, 100_000)}
    for n, count in ops.items():
        assert n <= count <= 4 * n + 16, ops
    # Ten times the bad keys, about ten times the work.
    assert 9 <= ops[10_000] / ops[1_000] <= 11, ops
    assert 9 <= ops[100_000] / ops[10_000] <= 11, ops


@pytest.mark.parametrize("ghosts", [0, 1000])
@pytest.mark.parametrize("version", VERSIONS)
def test_full_of_pinned_items_raises(version: str, ghosts: int) -> None:
    cache = _classes(version)[1](3)
    setattr(cache, QUIET_ATTR, True)
    for key in "abc":
        cache[key] = key
        cache.pin(key)
    order = cache._LRUCache__order
    for i in range(ghosts):
        order[("ghost", i)] = None
        order.move_to_end(("ghost", i), last=False)
    calls = []
    bound = cache.popitem

    def popitem(remove_pinned: bool = False) -> Any:
        calls.append(remove_pinned)
        return bound(remove_pinned=remove_pinned)

    cache.popitem = popitem
    with pytest.raises(RuntimeError, match=ALL_PINNED):
        cache["d"] = "d"
    assert calls == [False]
    assert list(order) == ["a", "b", "c"]
    assert "d" not in cache
    # The cache is still usable: unpinning one item makes room.
    cache.pop("a")
    cache["d"] = "d"
    assert list(cache.order) == ["b", "c", "d"]


class RemoveFault(Exception):
    pass


@pytest.mark.parametrize("after", [0, 1, 3, 6])
@pytest.mark.parametrize("variant", ["plain", "fixed"])
@pytest.mark.parametrize("version", VERSIONS)
def test_clear_interrupted_half_way(version: str, variant: str, after: int) -> None:
    """``_on_remove`` fails after ``after`` removals; the cache stays usable."""
    base, fixed = _classes(version)
    cache = (fixed if variant == "fixed" else base)(8)
    setattr(cache, QUIET_ATTR, True)
    for i in range(8):
        cache[i] = i
    cache.pin(7)
    assert cache.get(3) == 3
    removals = [0]

    def on_remove(key: Any, value: Any) -> None:
        removals[0] += 1
        if removals[0] == after + 1:
            raise RemoveFault(key)

    cache._on_remove = on_remove
    with pytest.raises(RemoveFault):
        cache.clear()
    assert len(cache) == 8 - (after + 1)
    assert _consistent(cache)
    assert tuple(cache.stat()) == (1, 1)  # not reset: clear did not finish

    # Keep using it: evictions, hits, pins, and a clear that completes.
    for i in range(100, 130):
        cache[i] = i
        assert cache.get(i) == i
        assert _consistent(cache)
    if 7 in cache:
        assert 7 in cache.pinned_items  # pinned items survive evictions
    cache.clear()
    assert len(cache) == 0 and not cache._LRUCache__order and cache.currsize == 0
    assert tuple(cache.stat()) == (0, 0)
