"""What a repair waits for, and what ``touch`` counts, on the real vLLM ``LRUCache``.

Before a repair (order and data apart) the fixed class lets threads that are inside
cachetools' own code on the same cache finish: they may be between the two steps of an
insert or a delete. It waits for other threads only, never for the repairing thread's own
call into cachetools, and at most about 0.1 s: a thread that stays inside (a slow
``getsizeof``) does not hold vLLM up for longer. The waits are read from ``time.sleep``
(recorded, not slept), so nothing here depends on how fast the machine is.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from harness import realsrc
from vllm_mmcache_fix.catalogue import NEWEST_SOURCES_CHECKED as NEWEST
from vllm_mmcache_fix.lru_eviction import cache as fixed_cache

# One release whose own touch adds missing keys to the order, one whose touch does not.
VERSIONS = ("0.23.0", NEWEST)
WAIT_BOUND_S = 0.2
"""The docstring's "at most about 0.1 s", with room."""


@pytest.fixture
def sleeps(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[float]]:
    """What this thread asks ``time.sleep`` for, instead of sleeping."""
    asked: list[float] = []
    me = threading.get_ident()
    real = time.sleep

    def sleep(seconds: float) -> None:
        if threading.get_ident() != me:
            real(seconds)
            return
        asked.append(seconds)

    monkeypatch.setattr(time, "sleep", sleep)
    yield asked


def _fixed(version: str, getsizeof: Any = len) -> Any:
    cls = fixed_cache.fixed_lru_class(realsrc.load_lru_module(version).LRUCache)
    return cls(4, getsizeof=getsizeof)


def _ghost_in_front(cache: Any) -> None:
    order = cache._LRUCache__order
    order["ghost"] = None
    order.move_to_end("ghost", last=False)


def _in_step(cache: Any) -> bool:
    return list(cache._LRUCache__order) == list(cache._Cache__data)


@pytest.mark.parametrize("version", VERSIONS)
def test_a_repair_does_not_wait_for_its_own_thread(version: str, sleeps: list[float]) -> None:
    """The eviction that meets the ghost runs inside cachetools' ``__setitem__`` in this
    very thread: that call is not another thread mid-insert."""
    from vllm_mmcache_fix.lru_eviction import stats

    cache = _fixed(version)
    for key in "abc":
        cache[key] = "x"
    _ghost_in_front(cache)
    cache._mmfix_stats = counts = stats.CacheStats()
    before = fixed_cache.STATS.ghost_keys_dropped
    cache["d"] = "xx"  # evicts: the ghost first
    assert fixed_cache.STATS.ghost_keys_dropped == before + 1
    assert sleeps == []
    # The ghost dropped is no eviction; the item evicted after the repair is one.
    assert counts.evictions == 1 and "a" not in cache
    assert _in_step(cache) and "ghost" not in cache._LRUCache__order


@pytest.mark.parametrize("version", VERSIONS)
def test_a_thread_that_stays_in_cachetools_holds_a_repair_up_briefly(
    version: str, sleeps: list[float]
) -> None:
    entered, release = threading.Event(), threading.Event()

    def getsizeof(value: str) -> int:
        if value == "slow":
            entered.set()
            release.wait(30)
        return len(value)

    cache = _fixed(version, getsizeof)
    cache["a"] = "x"
    cache["b"] = "x"
    inserting = threading.Thread(target=cache.__setitem__, args=("s", "slow"), daemon=True)
    inserting.start()
    try:
        assert entered.wait(10), "the insert never reached getsizeof"
        _ghost_in_front(cache)
        before = fixed_cache.STATS.ghost_keys_dropped
        cache["d"] = "xxx"  # evicts while the other thread is inside cachetools
        assert sleeps, "the repair did not wait for the thread inside cachetools"
        assert sum(sleeps) <= WAIT_BOUND_S, f"waited {sum(sleeps):.3f} s in {len(sleeps)} sleeps"
        assert fixed_cache.STATS.ghost_keys_dropped == before + 1
    finally:
        release.set()
        inserting.join(10)
    assert not inserting.is_alive()
    assert _in_step(cache)


@pytest.mark.parametrize("version", VERSIONS)
def test_touch_gives_a_key_without_an_order_entry_one_and_counts_it_once(version: str) -> None:
    cache = _fixed(version)
    for key in "abc":
        cache[key] = "x"
    del cache._LRUCache__order["a"]
    before = fixed_cache.STATS.orphans_restored
    cache.touch("a")
    assert fixed_cache.STATS.orphans_restored == before + 1
    assert list(cache._LRUCache__order) == ["b", "c", "a"]  # the most recent
    cache.touch("a")  # in step again: nothing more to restore
    assert fixed_cache.STATS.orphans_restored == before + 1


@pytest.mark.parametrize("where", ["vllm", "abc"])
@pytest.mark.parametrize("version", VERSIONS)
def test_a_thread_paused_outside_cachetools_own_code_is_not_waited_for(
    version: str, where: str, sleeps: list[float]
) -> None:
    """A thread at the start of vLLM's own ``stat`` or of ``MutableMapping.update`` on the
    cache has not begun an insert: the repair does not wait for it."""
    import collections.abc

    paused, go = threading.Event(), threading.Event()
    cache = _fixed(version)
    for key in "abc":
        cache[key] = "x"
    if where == "vllm":
        code = realsrc.load_lru_module(version).LRUCache.stat.__code__

        def call() -> None:
            cache.stat()
    else:
        code = collections.abc.MutableMapping.update.__code__

        def call() -> None:
            cache.update({"e": "x"})

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if event == "call" and frame.f_code is code:
            paused.set()
            go.wait(30)
        return None

    def paused_call() -> None:
        sys.settrace(tracer)
        try:
            call()
        finally:
            sys.settrace(None)

    thread = threading.Thread(target=paused_call, daemon=True)
    thread.start()
    try:
        assert paused.wait(10), f"the {where} call never started"
        _ghost_in_front(cache)
        before = fixed_cache.STATS.ghost_keys_dropped
        cache["d"] = "xx"
        assert sleeps == []
        assert fixed_cache.STATS.ghost_keys_dropped == before + 1
    finally:
        go.set()
        thread.join(10)
    assert not thread.is_alive()
    assert _in_step(cache)


@pytest.mark.parametrize("version", VERSIONS)
def test_a_base_whose_touch_cannot_be_probed_still_gets_the_fixed_class(version: str) -> None:
    """Whether vLLM's own ``touch`` adds missing keys is probed once per class; a probe
    that raises means "cannot be told": the class is fixed, with the plain fixed touch."""
    base = realsrc.load_lru_module(version).LRUCache

    class Odd(base):  # type: ignore[misc, valid-type]
        def touch(self, key: Any) -> None:
            raise RuntimeError("touch is not callable on this cache")

    cls = fixed_cache.fixed_lru_class(Odd)
    assert fixed_cache.is_fixed(cls) and cls.touch is fixed_cache.FixedLRUMixin.touch
    cache = cls(4, getsizeof=len)
    cache["a"] = "x"
    cache.touch("a")
    cache.touch("missing")  # adds nothing
    assert list(cache._LRUCache__order) == ["a"] and _in_step(cache)
