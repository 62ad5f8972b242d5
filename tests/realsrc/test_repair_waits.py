"""What a repair waits for, and what ``touch`` counts, on the real vLLM ``LRUCache``.

Before a repair (order and data apart) the fixed class lets threads that are inside
cachetools' own code on the same cache finish: they may be between the two steps of an
insert or a delete. It waits for other threads only, never for the repairing thread's own
call into cachetools, and at most about 0.1 s: a thread that stays inside (a slow
``getsizeof``) does not hold vLLM up for longer. The waits are read from ``time.sleep``
(recorded, not slept), so nothing here depends on how fast the machine is.
"""

from __future__ import annotations

import contextlib
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
    """What the repair's wait asks ``time.sleep`` for, from any thread, instead of sleeping;
    any other caller (a thread another test left running) sleeps as usual."""
    asked: list[float] = []
    real = time.sleep

    def sleep(seconds: float) -> None:
        if sys._getframe(1).f_code.co_name != "_mmfix_wait_for_others":
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


def _size(value: str) -> int:
    """``getsizeof`` as a Python function: a thread can be paused on entering it, inside
    cachetools' ``Cache.__setitem__``."""
    return len(value)


@contextlib.contextmanager
def _paused_at(code: Any, call: Any) -> Iterator[None]:
    """``call()`` in a thread that stops on entering ``code`` and is held there while the
    block runs; the thread must end once let go."""
    paused, go = threading.Event(), threading.Event()

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if event == "call" and frame.f_code is code:
            paused.set()
            go.wait(30)
        return None

    def run() -> None:
        sys.settrace(tracer)
        try:
            call()
        finally:
            sys.settrace(None)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        assert paused.wait(10), f"{code.co_name} was never entered"
        yield
    finally:
        go.set()
        thread.join(10)
    assert not thread.is_alive()


def _evict_past_ghost(cache: Any, value: str) -> None:
    """Plant a ghost at the oldest end, insert ``value`` so that it is evicted: one ghost
    key dropped."""
    _ghost_in_front(cache)
    before = fixed_cache.STATS.ghost_keys_dropped
    cache["d"] = value
    assert fixed_cache.STATS.ghost_keys_dropped == before + 1


@pytest.mark.parametrize("version", VERSIONS)
def test_a_repair_does_not_wait_for_its_own_thread(version: str, sleeps: list[float]) -> None:
    """The eviction that meets the ghost runs inside cachetools' ``__setitem__`` in this
    very thread: that call is not another thread mid-insert."""
    from vllm_mmcache_fix.lru_eviction import stats

    cache = _fixed(version)
    for key in "abc":
        cache[key] = "x"
    cache._mmfix_stats = counts = stats.CacheStats()
    _evict_past_ghost(cache, "xx")
    assert sleeps == []
    # The ghost dropped is no eviction; the item evicted after the repair is one.
    assert counts.evictions == 1 and "a" not in cache
    assert _in_step(cache) and "ghost" not in cache._LRUCache__order


def _in_thread(func: Any) -> None:
    """``func()`` in a thread started now, re-raising what it raised."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            func()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(30)
    assert not thread.is_alive()
    if errors:
        raise errors[0]


@pytest.mark.parametrize("repairing", ["main thread", "a thread started later"])
@pytest.mark.parametrize("version", VERSIONS)
def test_a_thread_that_stays_in_cachetools_holds_a_repair_up_briefly(
    version: str, repairing: str, sleeps: list[float]
) -> None:
    """Thread identities are compared for equality only: the repair waits for the thread
    inside cachetools whether its identity is above or below the repairing thread's (a
    thread started later usually gets a lower one)."""
    cache = _fixed(version, _size)
    cache["a"] = "x"
    cache["b"] = "x"
    with _paused_at(_size.__code__, lambda: cache.__setitem__("s", "slow")):
        # The eviction runs while the other thread is inside cachetools' insert.
        if repairing == "main thread":
            _evict_past_ghost(cache, "xxx")
        else:
            _in_thread(lambda: _evict_past_ghost(cache, "xxx"))
        assert sleeps, "the repair did not wait for the thread inside cachetools"
        assert sum(sleeps) <= WAIT_BOUND_S, f"waited {sum(sleeps):.3f} s in {len(sleeps)} sleeps"
    assert _in_step(cache)


@pytest.mark.parametrize("version", VERSIONS)
def test_a_thread_inside_another_cache_with_the_same_items_is_not_waited_for(
    version: str, sleeps: list[float]
) -> None:
    """The thread to wait for is one inside cachetools on this very cache (identity): an
    equal cache (the same items) is another cache."""
    cache, other = _fixed(version), _fixed(version, _size)
    for key in "abc":
        cache[key] = other[key] = "x"
    with _paused_at(_size.__code__, lambda: other.__setitem__("s", "slow")):
        assert dict(cache.items()) == dict(other.items())
        _evict_past_ghost(cache, "xx")
        assert sleeps == []
    assert _in_step(cache)


@pytest.mark.parametrize("version", VERSIONS)
def test_a_cache_whose_order_cannot_pop_is_refused(version: str) -> None:
    cache = _fixed(version)
    assert fixed_cache.check_compatible(cache) is None

    class MoveOnly:
        def move_to_end(self, key: Any, last: bool = True) -> None:
            pass

    cache._LRUCache__order = MoveOnly()
    reason = fixed_cache.check_compatible(cache)
    assert reason is not None and "is not an OrderedDict" in reason


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

    cache = _fixed(version)
    for key in "abc":
        cache[key] = "x"
    if where == "vllm":
        code, call = realsrc.load_lru_module(version).LRUCache.stat.__code__, cache.stat
    else:
        code = collections.abc.MutableMapping.update.__code__

        def call() -> None:
            cache.update({"e": "x"})

    with _paused_at(code, call):
        _evict_past_ghost(cache, "xx")
        assert sleeps == []
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


@pytest.mark.parametrize("version", VERSIONS)
def test_a_listener_that_raises_does_not_break_the_repair(version: str) -> None:
    """The plugin logs repairs through a listener; one that raises is skipped, the ones
    after it still hear of the repair and the eviction goes on."""
    heard: list[tuple[str, int]] = []

    def broken(kind: str, count: int, cache: Any) -> None:
        raise RuntimeError("listener failed")

    def listening(kind: str, count: int, cache: Any) -> None:
        heard.append((kind, count))

    cache = _fixed(version)
    for key in "abc":
        cache[key] = "x"
    _ghost_in_front(cache)
    fixed_cache.add_repair_listener(broken)
    fixed_cache.add_repair_listener(listening)
    try:
        cache["d"] = "xx"
    finally:
        fixed_cache.remove_repair_listener(broken)
        fixed_cache.remove_repair_listener(listening)
    assert heard == [("ghost_keys_dropped", 1)]
    assert _in_step(cache) and "d" in cache


@pytest.mark.parametrize("version", VERSIONS)
def test_an_eviction_from_a_large_cache_in_step_does_not_look_for_repairs(
    version: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The repair scans the whole cache; an eviction whose order and data agree (the
    usual case, and caches hold thousands of items) goes straight to the oldest item."""
    scans: list[int] = []
    cls = fixed_cache.fixed_lru_class(realsrc.load_lru_module(version).LRUCache)
    repair = cls._mmfix_repair

    def counted(self: Any) -> None:
        scans.append(len(self))
        repair(self)

    monkeypatch.setattr(cls, "_mmfix_repair", counted)
    cache = cls(1000, getsizeof=len)
    for n in range(1000):
        cache[f"k{n}"] = "x"
    for n in range(1000, 1010):
        cache[f"k{n}"] = "x"  # one eviction each
    assert scans == []
    assert len(cache) == 1000 and "k9" not in cache and "k10" in cache and _in_step(cache)
