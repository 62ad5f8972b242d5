"""The drift guard's algorithm (``drift_guard/journal.py``) on its own, over cachetools'
``LRUCache``: what a commit, a rollback, an eviction while pending, a reset and the
placement of far-away keys leave in the sender cache's order and in the shadow.

The sender cache here is what vLLM's sender does with it (``get_and_update_item``: a cached
key moves to most-recent, a new one is inserted, evicting the oldest), with the guard's
eviction hook; the realsrc tier runs the same algorithm inside the drift simulations.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from typing import Any

from cachetools import LRUCache

from vllm_mmcache_fix.drift_guard.journal import (
    COMMITTED,
    PENDING,
    PENDING_LEVEL,
    PLACE_SCAN,
    ROLLED_BACK,
    Journal,
    Shadow,
)


class Cache(LRUCache):  # type: ignore[type-arg]
    """The sender cache with the guard's eviction hook (``sender.py``)."""

    def __init__(self, maxsize: int) -> None:
        super().__init__(maxsize)
        self.shadow: Shadow | None = None
        self.journal: Journal | None = None

    def popitem(self) -> Any:
        shadow = self.shadow
        if shadow is not None:
            shadow.settle_front()
        key, value = super().popitem()
        if shadow is not None:
            shadow.on_evict(key, value, self.journal)
        return key, value


WIDE = tuple(f"k{i:03}" for i in range(3 * PLACE_SCAN))
"""Keys of a cache too wide to scan whole for a key's place."""


def sender(keys: str | list[str], maxsize: int = 16) -> tuple[Cache, Shadow]:
    cache = Cache(maxsize)
    for key in keys:
        cache[key] = key.upper()
    shadow = Shadow(cache)
    cache.shadow = shadow
    return cache, shadow


def send(
    cache: Cache, journal: Journal | None, keys: str | list[str], with_data: bool = True
) -> None:
    """One request's items through the sender cache, as ``get_and_update_item`` does."""
    shadow = cache.shadow
    assert shadow is not None
    cache.journal = journal
    for key in keys:
        present = key in cache._Cache__data
        prev = shadow.seq.get(key)
        if present:
            cache[key]
        else:
            cache[key] = key.upper()
        shadow.note_update(key, journal, present, prev, with_data)
    cache.journal = None
    if journal is not None:
        journal.evictions_mark = shadow.evictions


def order(cache: Cache) -> str:
    return "".join(cache._LRUCache__order)


# -- building and reading --------------------------------------------------------------


def test_the_shadow_starts_from_the_caches_order() -> None:
    cache, shadow = sender("abc")
    assert shadow.seq == {"a": 0, "b": 1, "c": 2} and shadow.base == shadow.seq
    assert shadow.seq is not shadow.base
    assert shadow.alive and shadow.epoch == 0 and shadow.evictions == 0
    # EngineCore's next access comes after the three it holds.
    assert shadow.note_access("a", None, 0) == 3
    assert shadow.seq["a"] == shadow.base["a"] == 3
    assert order(cache) == "abc"  # (note_access records; the cache moved it itself)


def test_a_pending_access_counts_above_every_enginecore_position() -> None:
    cache, shadow = sender("abc")
    first, second = Journal(shadow), Journal(shadow)
    assert list(shadow.pending) == [first, second]
    assert first.state == PENDING and first.epoch == 0
    # Nothing sent without its data yet: the processor keeps no replay for it.
    assert first.sent_without_data == 0
    send(cache, first, "a")
    send(cache, second, "b")
    assert shadow.seq["a"] == PENDING_LEVEL and shadow.seq["b"] == PENDING_LEVEL + 1
    assert shadow.base == {"a": 0, "b": 1, "c": 2}
    assert first.prev_seq == {"a": 0} and first.my_seq == {"a": PENDING_LEVEL}
    assert shadow.touched == {"a": {first: None}, "b": {second: None}}
    # A second touch by the same request keeps what it saw first.
    send(cache, first, "a")
    assert first.prev_seq == {"a": 0} and first.my_seq == {"a": PENDING_LEVEL + 2}
    assert list(shadow.touched["a"]) == [first]


# -- what other requests see while one is pending ---------------------------------------


def test_keys_a_pending_request_inserted_or_moved_look_uncached_to_others() -> None:
    cache, shadow = sender("ab")
    mine, other = Journal(shadow), Journal(shadow)
    send(cache, mine, "xa")
    assert mine.inserted == ["x"] and shadow.owner == {"x": mine}
    assert mine.prev_seq == {"a": 0}  # an inserted key has no position before
    for key in "xa":
        assert shadow.looks_uncached(key, other), key
        assert shadow.looks_uncached(key, None), key
        assert not shadow.looks_uncached(key, mine), key
    assert not shadow.looks_uncached("b", other)
    assert shadow.at_risk("a", other) and not shadow.at_risk("a", mine)
    assert shadow.commit(mine)
    assert mine.state == COMMITTED and mine not in shadow.pending
    assert shadow.owner == {} and shadow.touched == {}
    for key in "xa":
        assert not shadow.looks_uncached(key, other), key


def test_a_doubtful_key_looks_uncached_until_sent_with_its_data() -> None:
    cache, shadow = sender("ab")
    shadow.doubtful.add("a")
    assert shadow.looks_uncached("a", None)
    without = Journal(shadow)
    send(cache, without, "a", with_data=False)
    assert "a" in shadow.doubtful and without.cleared == []
    with_data = Journal(shadow)
    send(cache, with_data, "a")
    assert "a" not in shadow.doubtful and with_data.cleared == ["a"]
    # Rolled back, the request never delivered that data: doubtful again.
    assert shadow.rollback(with_data).done
    assert "a" in shadow.doubtful


def test_data_sent_outside_a_request_clears_doubt_and_ownership() -> None:
    cache, shadow = sender("ab")
    pending = Journal(shadow)
    send(cache, pending, "x")
    shadow.doubtful.add("b")
    send(cache, None, "xb")
    assert shadow.owner == {} and "b" not in shadow.doubtful
    assert shadow.base["x"] == shadow.seq["x"] and shadow.base["b"] == shadow.seq["b"]


# -- commit --------------------------------------------------------------------------------


def test_a_commit_orders_keys_as_enginecore_gets_them_whatever_the_processing_order() -> None:
    cache, shadow = sender("abcd")
    first, second = Journal(shadow), Journal(shadow)
    send(cache, first, "ab")
    send(cache, second, "c")
    assert order(cache) == "dabc"
    # The second request reaches EngineCore first: its key becomes the newest EngineCore
    # has, below the keys the first (still pending) moved.
    assert shadow.commit(second)
    assert shadow.base["c"] == 4 and shadow.seq["c"] == 4
    assert order(cache) == "dcab"
    assert shadow.commit(first)
    assert (shadow.base["a"], shadow.base["b"]) == (5, 6)
    assert shadow.seq == shadow.base
    assert order(cache) == "dcab"
    assert not shadow.commit(first) and not shadow.rollback(first).done


def test_a_commit_keeps_keys_that_pending_requests_moved_after_it_on_top() -> None:
    cache, shadow = sender("abc")
    first, second = Journal(shadow), Journal(shadow)
    send(cache, first, "a")
    send(cache, second, "b")
    send(cache, first, "c")
    assert order(cache) == "abc"
    assert shadow.commit(first)
    # a and c arrive at EngineCore; b (pending) stays above them.
    assert order(cache) == "acb"
    assert shadow.seq["a"] == 3 and shadow.seq["c"] == 4
    assert shadow.seq["b"] >= PENDING_LEVEL


def test_a_committed_key_moved_again_by_a_pending_request_keeps_the_later_place() -> None:
    cache, shadow = sender("abc")
    first, second = Journal(shadow), Journal(shadow)
    send(cache, first, "a")
    send(cache, second, "a")
    assert shadow.commit(first)
    assert shadow.base["a"] == 3
    assert shadow.seq["a"] == second.my_seq["a"]
    assert order(cache) == "bca"
    assert shadow.rollback(second).moved
    assert shadow.seq["a"] == 3 and order(cache) == "bca"


def test_a_key_evicted_while_pending_gets_its_enginecore_position_at_commit() -> None:
    cache, shadow = sender("ab", maxsize=2)
    journal = Journal(shadow)
    send(cache, journal, "ac")  # a moves up, c evicts b
    send(cache, None, "d")  # d evicts a (EngineCore will evict it later too)
    assert "a" not in cache._Cache__data
    assert shadow.commit(journal)
    # EngineCore gets a and c after d: a (gone here) keeps a position in case a rollback
    # brings it back; c becomes the newest.
    assert (shadow.base["d"], shadow.base["a"], shadow.base["c"]) == (2, 3, 4)
    assert "a" not in shadow.seq and shadow.seq["c"] == 4
    assert order(cache) == "dc"


# -- rollback ------------------------------------------------------------------------------


def test_a_rollback_removes_what_the_request_inserted_and_puts_moves_back() -> None:
    cache, shadow = sender("abcd")
    journal = Journal(shadow)
    send(cache, journal, "bx")
    assert order(cache) == "acdbx"
    undone = shadow.rollback(journal)
    assert (undone.done, undone.removed, undone.restored, undone.moved) == (True, 1, 0, True)
    assert journal.state == ROLLED_BACK and journal not in shadow.pending
    assert order(cache) == "abcd"
    assert shadow.seq == {"a": 0, "b": 1, "c": 2, "d": 3}
    assert shadow.owner == {} and shadow.touched == {} and shadow.doubtful == set()
    assert not shadow.rollback(journal).done and not shadow.commit(journal)


def test_rollbacks_of_two_requests_that_moved_the_same_key_in_either_order() -> None:
    for first_back in (0, 1):
        cache, shadow = sender("abcd")
        journals = [Journal(shadow), Journal(shadow)]
        send(cache, journals[0], "b")
        send(cache, journals[1], "b")
        shadow.rollback(journals[first_back])
        assert order(cache) == "acdb", first_back  # the other one's move stands
        assert shadow.looks_uncached("b", None)
        shadow.rollback(journals[1 - first_back])
        assert order(cache) == "abcd", first_back
        assert shadow.seq["b"] == 1 and not shadow.looks_uncached("b", None)


def test_a_rollback_brings_back_what_the_request_evicted_newest_first() -> None:
    cache, shadow = sender("abc", maxsize=3)
    journal = Journal(shadow)
    send(cache, journal, "xy")  # evicts a, then b
    assert order(cache) == "cxy" and shadow.evictions == 2
    assert [e.key for e in journal.evicted] == ["a", "b"]
    assert [(e.seq, e.base, e.owner, e.doubtful) for e in journal.evicted] == [
        (0, 0, None, False),
        (1, 1, None, False),
    ]
    undone = shadow.rollback(journal)
    assert (undone.removed, undone.restored) == (2, 2)
    assert order(cache) == "abc"
    assert shadow.seq == {"a": 0, "b": 1, "c": 2} and shadow.base == shadow.seq


def test_a_rollback_restores_only_what_fits_the_most_recent_first() -> None:
    cache2, shadow2 = sender("abc", maxsize=3)
    j2 = Journal(shadow2)
    send(cache2, j2, "xy")
    shadow2.owner.pop("x")  # x stays: one slot left for the evicted a and b
    undone = shadow2.rollback(j2)
    assert (undone.removed, undone.restored) == (1, 1)
    assert "b" in cache2._Cache__data and "a" not in cache2._Cache__data
    assert order(cache2) == "bcx"


def test_a_late_rollback_restores_nothing_and_makes_its_moves_doubtful() -> None:
    cache, shadow = sender("abc", maxsize=3)
    journal = Journal(shadow)
    send(cache, journal, "bx")  # x evicts a
    send(cache, None, "y")  # a later eviction (c): EngineCore evicted its own choice
    assert shadow.evictions == 2
    undone = shadow.rollback(journal)
    assert undone.restored == 0 and undone.removed == 1
    assert "a" not in cache._Cache__data
    assert shadow.doubtful == {"b"}
    assert shadow.looks_uncached("b", None)


def test_an_entry_a_rolled_back_request_inserted_is_not_brought_back() -> None:
    cache, shadow = sender("a", maxsize=2)
    inserter, evicter = Journal(shadow), Journal(shadow)
    send(cache, inserter, "x")
    send(cache, evicter, "y")  # evicts a
    send(cache, evicter, "z")  # evicts x (inserter's)
    assert [(e.key, e.owner) for e in evicter.evicted] == [("a", None), ("x", inserter)]
    assert shadow.rollback(inserter).removed == 0  # x is gone already
    undone = shadow.rollback(evicter)
    assert "x" not in cache._Cache__data and "a" in cache._Cache__data
    assert undone.restored == 1


def test_an_evicted_entry_of_a_pending_request_comes_back_owned_by_it() -> None:
    cache, shadow = sender("a", maxsize=2)
    inserter, evicter = Journal(shadow), Journal(shadow)
    send(cache, inserter, "x")
    send(cache, evicter, "yz")  # evicts a, then x
    shadow.rollback(evicter)
    assert shadow.owner.get("x") is inserter
    assert shadow.looks_uncached("x", None)
    assert order(cache) == "ax"


def test_an_evicted_doubtful_entry_comes_back_doubtful() -> None:
    cache, shadow = sender("ab", maxsize=2)
    shadow.doubtful.add("a")
    journal = Journal(shadow)
    send(cache, journal, "x")
    assert journal.evicted[0].doubtful and "a" not in shadow.doubtful
    shadow.rollback(journal)
    assert "a" in cache._Cache__data and shadow.doubtful == {"a"}


def test_adopted_keys_go_back_to_their_first_owner_or_leave() -> None:
    # The first owner still pending: it owns the key again.
    cache, shadow = sender("a")
    first, second = Journal(shadow), Journal(shadow)
    send(cache, first, "x")
    send(cache, second, "x")
    assert second.adopted == {"x": first} and shadow.owner["x"] is second
    assert shadow.rollback(second).removed == 0
    assert shadow.owner["x"] is first and "x" in cache._Cache__data
    # The first owner committed: EngineCore holds it, nobody owns it.
    cache, shadow = sender("a")
    first, second = Journal(shadow), Journal(shadow)
    send(cache, first, "x")
    send(cache, second, "x")
    assert shadow.commit(first)
    assert shadow.owner["x"] is second  # (the commit leaves what it no longer owns)
    assert shadow.rollback(second).removed == 0
    assert "x" not in shadow.owner and "x" in cache._Cache__data
    # The first owner rolled back: nobody sent it to EngineCore, it leaves.
    cache, shadow = sender("a")
    first, second = Journal(shadow), Journal(shadow)
    send(cache, first, "x")
    send(cache, second, "x")
    assert shadow.rollback(first).removed == 0  # adopted: not the first's to remove
    assert "x" in cache._Cache__data
    assert shadow.rollback(second).removed == 1
    assert "x" not in cache._Cache__data and "x" not in shadow.owner
    # Sent again without data it is not adopted.
    cache, shadow = sender("a")
    first, second = Journal(shadow), Journal(shadow)
    send(cache, first, "x")
    send(cache, second, "x", with_data=False)
    assert second.adopted == {} and shadow.owner["x"] is first


def test_a_commit_releases_adopted_keys() -> None:
    cache, shadow = sender("a")
    first, second = Journal(shadow), Journal(shadow)
    send(cache, first, "x")
    send(cache, second, "x")
    assert shadow.commit(second)
    assert "x" not in shadow.owner
    assert shadow.rollback(first).removed == 0 and "x" in cache._Cache__data


# -- reset, invalidate, forget, prune -------------------------------------------------------


def test_a_reset_starts_a_new_epoch_and_old_journals_no_longer_apply() -> None:
    cache, shadow = sender("abc")
    journal = Journal(shadow)
    send(cache, journal, "bx")
    shadow.doubtful.add("a")
    shadow.misplaced["c"] = 1
    cache.clear()
    for key in "pq":
        cache[key] = key
    shadow.reset()
    assert shadow.epoch == 1
    assert (shadow.owner, shadow.touched, shadow.doubtful, shadow.pending) == ({}, {}, set(), {})
    assert shadow.misplaced == {} and shadow._misplaced_heap == []
    assert shadow.seq == {"p": 0, "q": 1} and shadow.base == shadow.seq
    assert shadow.base is not shadow.seq
    assert shadow.note_access("p", None, 0) == 2
    assert not shadow.commit(journal) and journal.state == COMMITTED
    late = Journal(shadow)
    assert late.epoch == 1
    old = Journal(shadow)
    shadow.reset()
    assert not shadow.rollback(old).done and old.state == ROLLED_BACK
    assert order(cache) == "pq"


def test_invalidate_makes_cached_keys_doubtful_and_forgets_positions_of_gone_ones() -> None:
    cache, shadow = sender("abc")
    journal = Journal(shadow)
    send(cache, journal, "x")
    shadow.seq["gone"] = 7
    assert shadow.invalidate(["a", "x", "gone"]) == 2
    # Still cached (a request that found them cached reads them again), sent with data
    # by every request processed from now on.
    assert order(cache) == "abcx" and shadow.doubtful == {"a", "x"}
    assert shadow.looks_uncached("a", None) and shadow.looks_uncached("x", journal)
    assert "gone" not in shadow.seq and shadow.owner == {}
    send(cache, None, "a")  # sent with its data: EngineCore has it again
    assert shadow.doubtful == {"x"} and not shadow.looks_uncached("a", None)


def test_forget_drops_every_trace_of_a_key() -> None:
    cache, shadow = sender("abc")
    journal = Journal(shadow)
    send(cache, journal, "x")
    shadow.doubtful.add("x")
    shadow.misplaced["x"] = 3
    del cache["x"]
    shadow.forget("x")
    assert "x" not in shadow.owner and "x" not in shadow.seq and "x" not in shadow.base
    assert "x" not in shadow.doubtful and "x" not in shadow.misplaced


def test_an_eviction_forgets_the_key_and_tells_only_its_own_journal() -> None:
    cache, shadow = sender("ab", maxsize=2)
    shadow.misplaced["a"] = 0
    stranger = Journal(sender("z")[1])
    cache.journal = stranger
    cache["c"] = "C"
    assert shadow.evictions == 1 and stranger.evicted == []
    assert "a" not in shadow.seq and "a" not in shadow.base and "a" not in shadow.misplaced


def test_prune_keeps_positions_of_cached_and_pending_keys_once_they_outnumber() -> None:
    cache, shadow = sender("ab")
    journal = Journal(shadow)
    send(cache, journal, "a")
    for i in range(70):
        shadow.seq[f"old{i}"] = i
        shadow.base[f"old{i}"] = i
    shadow.prune()  # 72 positions for 2 cached keys: at most 2 * 2 + 64 = 68 are kept
    assert set(shadow.seq) == {"a", "b"} and set(shadow.base) == {"a", "b"}
    for i in range(67):
        shadow.seq[f"old{i}"] = i
    shadow.prune()  # 69 > 68: still pruned
    assert set(shadow.seq) == {"a", "b"}
    for i in range(66):
        shadow.seq[f"old{i}"] = i
    shadow.prune()  # 68: kept
    assert len(shadow.seq) == 68
    shadow.doubtful = {f"d{i}" for i in range(67)} | {"a"}
    shadow.prune()  # 68 doubtful keys for 2 cached: over 2 + 64
    assert shadow.doubtful == {"a"} and len(shadow.seq) == 68
    shadow.doubtful = {f"d{i}" for i in range(66)}
    shadow.prune()
    assert len(shadow.doubtful) == 66


def test_prune_keeps_the_positions_of_keys_a_pending_request_evicted() -> None:
    cache, shadow = sender("ab", maxsize=2)
    journal = Journal(shadow)
    send(cache, journal, "c")  # evicts a
    assert "a" not in shadow.seq
    shadow.seq["a"] = 0
    shadow.base["a"] = 0
    for i in range(70):
        shadow.seq[f"old{i}"] = i
        shadow.base[f"old{i}"] = i
    shadow.prune()
    assert set(shadow.seq) == {"a", "b", "c"} and set(shadow.base) == {"a", "b"}


# -- placing keys far from both ends --------------------------------------------------------


def test_a_key_far_from_both_ends_is_left_misplaced_and_settled_before_an_eviction() -> None:
    keys = list(WIDE)
    cache, shadow = sender(keys, maxsize=len(keys))
    middle = keys[PLACE_SCAN + PLACE_SCAN // 2]
    journal = Journal(shadow)
    cache.journal = journal
    cache[middle]
    shadow.note_update(middle, journal, True, shadow.seq[middle], True)
    cache.journal = None
    assert list(cache._LRUCache__order)[-1] == middle
    assert shadow.rollback(journal).moved
    # Too far from both ends to scan for: left at the end, recorded where it belongs.
    assert list(cache._LRUCache__order)[-1] == middle
    assert shadow.misplaced == {middle: keys.index(middle)}
    assert shadow.logical_order() == keys
    # Evictions take the oldest as EngineCore does; the misplaced key when its turn comes.
    cache["new0"] = "x"
    cache["new1"] = "y"
    assert keys[0] not in cache and keys[1] not in cache
    assert middle in cache and shadow.misplaced == {middle: keys.index(middle)}
    for _ in range(keys.index(middle) - 2):
        cache[f"more{_}"] = "z"
    assert middle in cache
    cache["last"] = "w"
    assert middle not in cache and shadow.misplaced == {}


def test_a_key_near_either_end_is_put_in_place() -> None:
    keys = list(WIDE)
    for index in (3, len(keys) - 3):
        cache, shadow = sender(keys, maxsize=len(keys) + 1)
        key = keys[index]
        journal = Journal(shadow)
        send(cache, journal, [key])
        assert list(cache._LRUCache__order)[-1] == key
        shadow.rollback(journal)
        assert list(cache._LRUCache__order) == keys, index
        assert shadow.misplaced == {}


def test_the_logical_order_puts_misplaced_keys_where_their_counter_says() -> None:
    cache, shadow = sender("abcd")
    assert shadow.logical_order() == list("abcd")
    shadow.misplaced["d"] = shadow.seq["d"] = 1  # d belongs between a and b...
    shadow.seq["b"], shadow.seq["c"] = 2, 3
    shadow.seq["a"] = 0
    assert shadow.logical_order() == list("adbc")
    shadow.misplaced["a"] = shadow.seq["a"] = 9  # ...and a after every key
    assert shadow.logical_order() == list("dbca")
    assert order(cache) == "abcd"


def test_settle_front_moves_the_oldest_misplaced_key_only_when_it_is_oldest() -> None:
    cache, shadow = sender("abcd")
    shadow.settle_front()  # nothing misplaced: nothing to do
    assert order(cache) == "abcd"
    # d sits last but belongs before a: it goes to the front.
    shadow.seq["d"] = -1
    shadow.misplaced["d"] = -1
    shadow._misplaced_heap = [(-1, 0, "d")]
    shadow.settle_front()
    assert order(cache) == "dabc" and shadow.misplaced == {}
    assert shadow._misplaced_heap == []
    # c belongs after a: it stays where it is, still misplaced.
    shadow.seq["c"] = 1
    shadow.misplaced["c"] = 1
    shadow._misplaced_heap = [(1, 1, "c")]
    shadow.seq["d"] = 0
    shadow.settle_front()
    assert order(cache) == "dabc" and shadow.misplaced == {"c": 1}
    # A stale heap entry (the key moved since) is dropped, and its mark with it.
    shadow.seq["c"] = 5
    shadow.settle_front()
    assert shadow._misplaced_heap == [] and shadow.misplaced == {}


def test_settle_front_takes_the_oldest_of_several_misplaced_keys() -> None:
    cache, shadow = sender("abcd")
    for target, key in ((-2, "d"), (-1, "c")):
        shadow.seq[key] = target
        shadow.misplaced[key] = target
    shadow._misplaced_heap = [(-2, 0, "d"), (-1, 1, "c")]
    shadow.settle_front()
    assert order(cache) == "dabc" and shadow.misplaced == {"c": -1}
    shadow.settle_front()  # c belongs after d, the front now: it stays
    assert order(cache) == "dabc" and shadow.misplaced == {"c": -1}
    assert shadow.logical_order() == list("dcab")


def test_a_rollback_puts_a_key_at_the_newest_move_of_the_requests_still_pending() -> None:
    # Requests processed side by side: the first moves b again after the second moved b
    # and c. Undoing a third move of b puts b back after c (the first's last move).
    cache, shadow = sender("abcd")
    first, second, third = Journal(shadow), Journal(shadow), Journal(shadow)
    send(cache, first, "b")
    send(cache, second, "bc")
    send(cache, first, "b")
    send(cache, third, "b")
    assert list(shadow.touched["b"]) == [first, second, third]
    assert shadow.rollback(third).done
    assert shadow.seq["b"] == first.my_seq["b"]
    assert order(cache) == "adcb"


def test_a_pending_move_stays_newest_in_a_cache_past_many_accesses() -> None:
    keys = [f"k{i:03}" for i in range(100)]
    cache, shadow = sender(keys, maxsize=len(keys))
    first, second = Journal(shadow), Journal(shadow)
    send(cache, first, ["k090"])
    send(cache, second, ["k090"])
    shadow.rollback(second)
    # The first request's move (pending) is newer than any position EngineCore has.
    assert list(cache._LRUCache__order)[-1] == "k090"
    assert shadow.seq["k090"] == first.my_seq["k090"]


def test_a_rollback_after_enginecore_saw_the_key_keeps_a_pending_move_newest() -> None:
    cache, shadow = sender("abcd")
    first, second = Journal(shadow), Journal(shadow)
    send(cache, first, "b")
    send(cache, second, "b")
    send(cache, None, "b")  # an access that reached EngineCore at once
    assert shadow.base["b"] == shadow.seq["b"] == 4
    assert shadow.rollback(first).moved
    assert shadow.seq["b"] == second.my_seq["b"]
    assert order(cache) == "acdb"


def test_an_evicted_entry_the_shadow_never_placed_counts_as_the_oldest() -> None:
    cache, shadow = sender("a", maxsize=3)
    cache["z"] = "Z"  # in the cache without a position in the shadow
    journal = Journal(shadow)
    send(cache, journal, "xyw")  # y evicts a, w evicts z
    assert [(e.key, e.seq) for e in journal.evicted] == [("a", 0), ("z", None)]
    shadow.owner.pop("y")
    shadow.owner.pop("w")  # y and w stay: one slot for the two evicted entries
    undone = shadow.rollback(journal)
    assert (undone.removed, undone.restored) == (1, 1)
    assert "a" in cache and "z" not in cache


def test_an_access_without_data_outside_a_request_leaves_a_pending_insert_uncached() -> None:
    cache, shadow = sender("a")
    pending = Journal(shadow)
    send(cache, pending, "x")
    send(cache, None, "x", with_data=False)
    assert shadow.owner == {"x": pending} and shadow.looks_uncached("x", None)


def test_a_commit_leaves_alone_a_key_with_data_and_no_place_in_the_order() -> None:
    cache, shadow = sender("abc")
    journal = Journal(shadow)
    send(cache, journal, "b")
    del cache._LRUCache__order["b"]  # (cachetools 7+ may keep data without an order entry)
    assert shadow.commit(journal)
    assert order(cache) == "ac" and "b" in cache._Cache__data


def test_the_heap_of_misplaced_keys_stays_within_twice_their_number_plus_64() -> None:
    keys = list(WIDE)
    cache, shadow = sender(keys, maxsize=len(keys))
    for count in (1, 2):
        middle = keys[len(keys) // 2 : len(keys) // 2 + count]
        largest = 0
        for _ in range(150):
            journal = Journal(shadow)
            send(cache, journal, middle)
            shadow.rollback(journal)
            assert shadow.misplaced == {key: keys.index(key) for key in middle}
            largest = max(largest, len(shadow._misplaced_heap))
        assert largest == 2 * count + 64, count
        assert shadow.logical_order() == keys


def test_the_scan_for_a_keys_place_looks_at_most_place_scan_keys_from_either_end() -> None:
    keys = list(WIDE)
    last = len(keys) - 1
    for index, placed in (
        (PLACE_SCAN - 1, True),  # PLACE_SCAN - 1 keys before it
        (PLACE_SCAN, False),
        (last - PLACE_SCAN + 1, True),  # PLACE_SCAN - 1 keys after it
        (last - PLACE_SCAN, False),
    ):
        cache, shadow = sender(keys, maxsize=len(keys))
        journal = Journal(shadow)
        send(cache, journal, [keys[index]])
        shadow.rollback(journal)
        assert (shadow.misplaced == {}) is placed, index
        assert (list(cache._LRUCache__order) == keys) is placed, index
        assert shadow.logical_order() == keys, index


def test_settle_front_drops_the_heap_entry_of_a_key_no_longer_misplaced() -> None:
    cache, shadow = sender("abcd")
    shadow.seq["d"] = -1
    shadow.misplaced["d"] = -1
    shadow.seq["c"] = 5  # misplaced too, but newer than the front
    shadow.misplaced["c"] = 5
    shadow._misplaced_heap = [(-1, 0, "d"), (5, 1, "c")]
    send(cache, None, "d")  # accessed: where its counter says now
    assert shadow.misplaced == {"c": 5}
    shadow.settle_front()
    assert shadow._misplaced_heap == [(5, 1, "c")] and shadow.misplaced == {"c": 5}
    assert order(cache) == "abcd"


# -- commits in a burst ---------------------------------------------------------------


class _CountingOrder(OrderedDict):  # type: ignore[type-arg]
    moves = 0

    def move_to_end(self, key: Any, last: bool = True) -> None:
        type(self).moves += 1
        super().move_to_end(key, last)


def test_a_burst_of_commits_in_processing_order_moves_nothing_in_the_order() -> None:
    # A batch endpoint (embeddings, chat batches) renders every input before the first
    # reaches EngineCore: each commit then has all the others pending.
    cache, shadow = sender("", maxsize=10_000)
    journals = [Journal(shadow) for _ in range(600)]
    for index, journal in enumerate(journals):
        send(cache, journal, [f"r{index}-{j}" for j in range(3)] + ["logo"])
    cache._LRUCache__order = _CountingOrder(cache._LRUCache__order)
    _CountingOrder.moves = 0
    expected = list(cache._LRUCache__order)
    for journal in journals:
        assert shadow.commit(journal)
    # Each request's keys were already the oldest pending moves: where EngineCore has them.
    assert _CountingOrder.moves == 0
    assert list(cache._LRUCache__order) == expected
    assert shadow.pending == {} and shadow.touched == {} and len(shadow._oldest) <= 1
    assert [shadow.seq[k] for k in expected] == sorted(shadow.seq[k] for k in expected)


def test_the_heap_of_oldest_pending_moves_stays_within_twice_the_pending_plus_64() -> None:
    cache, shadow = sender("abc", maxsize=8)
    oldest = Journal(shadow)
    send(cache, oldest, "a")  # pending all along: the resolved ones stay below it
    largest = 0
    for index in range(500):
        journal = Journal(shadow)
        send(cache, journal, [f"x{index}"])
        assert shadow.commit(journal)
        largest = max(largest, len(shadow._oldest))
    assert largest == 2 * 2 + 64  # (two pending at each push)
    assert shadow._oldest_pending() == oldest.my_seq["a"]


def test_a_commit_out_of_processing_order_moves_the_other_pending_keys_above_it() -> None:
    cache, shadow = sender("ab")
    first, second = Journal(shadow), Journal(shadow)
    send(cache, first, "x")
    send(cache, second, "y")
    assert shadow.commit(second)
    # EngineCore has y now; x (pending) stays the newest.
    assert order(cache) == "abyx"
    send(cache, None, "a")  # an access outside a request: above the pending move
    assert order(cache) == "byxa" and shadow.tail_mixed
    third = Journal(shadow)
    send(cache, third, "z")
    assert shadow.commit(first)
    assert order(cache) == "byaxz" and not shadow.tail_mixed


def test_a_commit_that_hands_a_key_back_to_an_older_pending_move_reorders_the_pending_keys() -> (
    None
):
    cache, shadow = sender("kc")
    mine, other = Journal(shadow), Journal(shadow)
    send(cache, mine, "a")
    send(cache, other, "kb")  # k: the other request moved it first
    send(cache, mine, "k")  # ... then this one
    assert order(cache) == "cabk"
    assert shadow.commit(mine)
    # k goes back to the other request's move, which is older than b.
    assert order(cache) == "cakb"
    assert shadow.seq["k"] == other.my_seq["k"] < shadow.seq["b"]


def test_a_commit_with_a_misplaced_key_in_the_order_moves_its_keys_to_the_end() -> None:
    keys = list(WIDE)
    cache, shadow = sender(keys, maxsize=len(keys) + 1)
    mine = Journal(shadow)
    send(cache, mine, ["x"])
    rejected = Journal(shadow)
    send(cache, rejected, [keys[PLACE_SCAN]])
    shadow.rollback(rejected)
    # Too far from either end to be put back: left at the end, behind x.
    assert shadow.misplaced == {keys[PLACE_SCAN]: PLACE_SCAN}
    assert list(cache._LRUCache__order)[-2:] == ["x", keys[PLACE_SCAN]]
    assert shadow.commit(mine)
    assert list(cache._LRUCache__order)[-1] == "x"


class _Moving(Shadow):
    """The reference: every commit moves the request's keys and then every other pending
    key to the end, and a key's place is the newest of all its pending moves."""

    def _arrive(self, journal: Journal) -> None:
        self.tail_mixed = True
        super()._arrive(journal)

    def _position(self, key: Any) -> int | None:
        stamps = [self.base.get(key)]
        holder = self.owner.get(key)
        if holder is not None and holder.state == PENDING and holder.epoch == self.epoch:
            stamps.append(holder.my_seq.get(key))
        for journal in self.touched.get(key, ()):
            if journal.state == PENDING:
                stamps.append(journal.my_seq.get(key))
        return max((s for s in stamps if s is not None), default=None)


def _reference(keys: str, maxsize: int) -> tuple[Cache, Shadow]:
    cache = Cache(maxsize)
    for key in keys:
        cache[key] = key.upper()
    cache.shadow = _Moving(cache)
    return cache, cache.shadow


def test_commits_leave_the_order_as_moving_every_pending_key_would() -> None:
    """The commit that moves nothing (its keys already in place) and the early end of the
    search for a key's place, against moving every pending key and searching them all:
    seeded random traffic of up to four pending requests over eight keys, compared after
    every step."""
    for seed in range(3000):
        rng = random.Random(seed)
        maxsize = rng.randint(3, 9)
        worlds = [sender("abcd", maxsize=maxsize), _reference("abcd", maxsize)]
        open_journals: list[list[Journal]] = [[], []]
        for _ in range(40):
            op = rng.choice(("open", "send", "commit", "rollback", "access"))
            pick, keys = rng.randint(0, 3), rng.sample("abcdefgh", rng.randint(1, 3))
            for side, (cache, shadow) in enumerate(worlds):
                journals = open_journals[side]
                if op == "open":
                    journals.append(Journal(shadow))
                elif op == "access":
                    send(cache, None, keys)
                elif journals:
                    journal = journals.pop(pick % len(journals))
                    if op == "send":
                        send(cache, journal, keys)
                        journals.insert(pick % (len(journals) + 1), journal)
                    elif op == "commit":
                        shadow.commit(journal)
                    else:
                        shadow.rollback(journal)
            (fast_cache, fast), (ref_cache, ref) = worlds
            assert list(fast_cache._LRUCache__order) == list(ref_cache._LRUCache__order), seed
            assert (fast.seq, fast.base, fast.misplaced) == (ref.seq, ref.base, ref.misplaced)
            assert fast_cache._Cache__data == ref_cache._Cache__data, seed


def test_resolved_journals_keep_no_other_alive_under_eviction_pressure() -> None:
    # Six requests in flight over a cache of four: each new image evicts one a request still
    # pending inserted, so each journal names the one before it. Kept past their resolution,
    # every journal since the first stayed alive (4,000 after 4,000 requests).
    import gc

    cache, shadow = sender("", maxsize=4)
    in_flight: list[Journal] = []
    for n in range(2000):
        journal = Journal(shadow)
        send(cache, journal, [f"img{n}"])
        in_flight.append(journal)
        if len(in_flight) > 6:
            first = in_flight.pop(0)
            assert (shadow.commit if n % 3 else shadow.rollback)(first)
    del journal, first
    gc.collect()
    alive = sum(1 for o in gc.get_objects() if type(o) is Journal)
    # The pending ones, and resolved ones waiting in the heap of oldest moves (bounded).
    assert alive <= len(in_flight) + 2 * len(shadow.pending) + 64, alive
    assert len(shadow.pending) == len(in_flight)
