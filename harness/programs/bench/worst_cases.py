"""Worst cases of the fixed LRU's repair, on the real vLLM ``LRUCache``.

* order-only keys: N keys in the eviction order with no data, in front of one real
  item, then an insert that has to evict;
* data-only keys: N items whose order entries are gone, then an insert that has to
  evict (every one of them is given its order entry back first).

Prints N, the seconds of that one insert, the cost per bad key, and how many order
entries the repair looked at or touched (the count the tests check for linearity).

Usage::

    scripts/worst-cases                 # the newest release checked, N = 1e3 .. 1e5
    scripts/worst-cases --vllm 0.23.0 --sizes 1000 100000
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from harness import realsrc
from vllm_mmcache_fix.catalogue import NEWEST_SOURCES_CHECKED
from vllm_mmcache_fix.lru_eviction.cache import QUIET_ATTR, fixed_lru_class

SIZES = (1_000, 3_000, 10_000, 30_000, 100_000)


class CountingOrder(OrderedDict[Any, Any]):
    """An ``OrderedDict`` that counts entries iterated over, looked up, written, removed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reset()

    def __iter__(self) -> Iterator[Any]:
        for key in super().__iter__():
            self.visited += 1
            yield key

    def pop(self, key: Any, *default: Any) -> Any:
        self.removed += 1
        return super().pop(key, *default)

    def __delitem__(self, key: Any) -> None:
        self.removed += 1
        super().__delitem__(key)

    def __setitem__(self, key: Any, value: Any) -> None:
        self.written += 1
        super().__setitem__(key, value)

    def move_to_end(self, key: Any, last: bool = True) -> None:
        self.written += 1
        super().move_to_end(key, last)

    def __contains__(self, key: object) -> bool:
        self.looked_up += 1
        return super().__contains__(key)

    def reset(self) -> None:
        self.visited = 0
        self.removed = 0
        self.written = 0
        self.looked_up = 0

    @property
    def operations(self) -> int:
        return self.visited + self.removed + self.written + self.looked_up


@dataclass
class Measurement:
    n: int
    seconds: float
    operations: int
    popitem_calls: int
    consistent: bool


def fixed_class(version: str) -> type:
    return fixed_lru_class(realsrc.load_lru_module(version).LRUCache)


def new_cache(cls: type, capacity: int, counting: bool) -> Any:
    cache = cls(capacity)
    setattr(cache, QUIET_ATTR, True)
    if counting:
        cache._LRUCache__order = CountingOrder()
    return cache


def _count_popitems(cache: Any) -> list[int]:
    calls = [0]
    bound = cache.popitem

    def popitem(remove_pinned: bool = False) -> Any:
        calls[0] += 1
        return bound(remove_pinned=remove_pinned)

    cache.popitem = popitem
    return calls


def _measure(cache: Any, n: int, key: str) -> Measurement:
    order = cache._LRUCache__order
    calls = _count_popitems(cache)
    if isinstance(order, CountingOrder):
        order.reset()
    start = time.perf_counter()
    cache[key] = key
    seconds = time.perf_counter() - start
    operations = order.operations if isinstance(order, CountingOrder) else -1
    consistent = list(order) == list(cache._Cache__data)
    return Measurement(n, seconds, operations, calls[0], consistent)


def ghost_wall(cls: type, n: int, counting: bool = False) -> Measurement:
    """N order-only keys in front of one real item; then an insert that evicts it."""
    cache = new_cache(cls, 1, counting)
    cache["real"] = "real"
    order = cache._LRUCache__order
    for i in range(n):
        order[("ghost", i)] = None
    order.move_to_end("real")
    return _measure(cache, n, "new")


def orphan_wall(cls: type, n: int, counting: bool = False) -> Measurement:
    """N items without order entries; then an insert that has to evict one."""
    cache = new_cache(cls, n, counting)
    for i in range(n):
        cache[("item", i)] = i
    cache._LRUCache__order.clear()
    return _measure(cache, n, "new")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm", default=NEWEST_SOURCES_CHECKED)
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    args = parser.parse_args(argv)
    cls = fixed_class(args.vllm)
    print(f"vLLM {args.vllm}, fixed class; one insert that has to evict")
    print(
        f"{'case':12} {'N':>8} {'seconds':>10} {'us/key':>8} {'ops':>9} {'ops/N':>6} "
        f"{'popitem':>7} {'order==data':>11}"
    )
    for name, fn in (("order-only", ghost_wall), ("data-only", orphan_wall)):
        for n in args.sizes:
            best: Measurement | None = None
            for _ in range(3):
                m = fn(cls, n)
                if best is None or m.seconds < best.seconds:
                    best = m
            assert best is not None
            best.operations = fn(cls, n, counting=True).operations
            print(
                f"{name:12} {n:>8} {best.seconds:>10.5f} {best.seconds / n * 1e6:>8.3f} "
                f"{best.operations:>9} {best.operations / n:>6.2f} {best.popitem_calls:>7} "
                f"{str(best.consistent):>11}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
