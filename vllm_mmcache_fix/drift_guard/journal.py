"""The drift guard's algorithm: per-request journals over a shadow of the sender cache.

Pure: this module imports nothing else of the package and nothing of vLLM. It
works on any object with cachetools' private ``_Cache__data`` and
``_LRUCache__order`` (the sender cache's ``LRUCache``), so it is tested on its
own and on the real ``LRUCache`` of released vLLM sources.

Every change a request makes to the sender cache is journaled: keys it
inserted, keys it moved to most-recent with their previous position, entries
evicted to make room. The shadow keeps an access counter per key: the
position EngineCore gives it (``base``: the last access by a request that
reached EngineCore) and the moves of requests still pending. A commit (the
request reached EngineCore) moves the request's keys to most-recent in the
order it touched them, as EngineCore does when the request arrives, whatever
the order the requests were processed in. A rollback (it never will) restores
membership and LRU order as EngineCore has them: inserted keys leave, evicted
entries come back, and a touched key goes back to the newest of its position
in EngineCore and the moves of the requests still pending (order is restored
by sorting on the counter), whatever the order the rejections come in. While a
request is pending,
the keys it inserted or moved look uncached to other requests
(:meth:`Shadow.looks_uncached`). A rollback that comes after later evictions
cannot know what EngineCore evicted instead; the keys it moves back become
"doubtful" and are sent with their data the next time.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Iterable
from typing import Any, NamedTuple

PENDING, COMMITTED, ROLLED_BACK = 0, 1, 2
PENDING_LEVEL = 1 << 62
"""Positions of moves by pending requests start here: above every position EngineCore has
(those count up from 0 in the order requests reach it)."""
PLACE_SCAN = 64
"""A rollback looks this many keys in from either end of the order for a key's place."""

Key = Any  # cache keys are mm hashes (str); kept loose for test doubles


class Evicted(NamedTuple):
    """An entry evicted from the sender cache while a request was processed."""

    key: Key
    value: Any
    seq: int | None
    """Its position in the sender cache's order then."""
    base: int | None
    """Its position in EngineCore's order then."""
    owner: Journal | None
    """The pending request that had inserted it."""
    doubtful: bool


class Journal:
    """What one request changed in one sender cache while it was processed."""

    __slots__ = (
        "shadow",
        "epoch",
        "state",
        "prev_seq",
        "my_seq",
        "inserted",
        "adopted",
        "evicted",
        "evictions_mark",
        "sent_without_data",
        "cleared",
    )

    def __init__(self, shadow: Shadow) -> None:
        self.shadow = shadow
        self.state = PENDING
        # key -> access counter before this request first touched it (key was present)
        self.prev_seq: dict[Key, int | None] = {}
        # key -> access counter this request gave it last
        self.my_seq: dict[Key, int] = {}
        self.inserted: list[Key] = []
        # key -> the pending journal that had inserted it before this one sent its data
        self.adopted: dict[Key, Journal] = {}
        # entries evicted while this request was processed
        self.evicted: list[Evicted] = []
        # The shadow's eviction count when this request's processing ended.
        self.evictions_mark: int | None = None
        self.sent_without_data = 0
        # doubtful keys whose data this request sent
        self.cleared: list[Key] = []
        # Registered last, under the shadow's lock: the journal is opened on vLLM's
        # multimodal executor thread while the event loop commits others (whose
        # commit walks ``pending``).
        with shadow.lock:
            self.epoch = shadow.epoch
            shadow.pending[self] = None

    def resolved(self) -> None:
        """Committed or rolled back (under the shadow's lock): what only its own resolution
        reads goes. An entry it evicted names the pending request that had inserted it, which
        names the one before: kept, every journal since the server started stayed alive."""
        self.evicted = []
        self.adopted = {}


class Rollback:
    """What a rollback did."""

    __slots__ = ("done", "removed", "restored", "moved")

    def __init__(self, done: bool, removed: int = 0, restored: int = 0, moved: bool = False):
        self.done = done
        self.removed = removed
        self.restored = restored
        self.moved = moved


class Shadow:
    """Bookkeeping attached to one sender cache's ``LRUCache`` (``lru``).

    Shared by vLLM's threads: journals open and the cache changes on the
    multimodal executor thread (``_merge_mm_kwargs``) while the event loop
    commits and rolls back. Every method that reads or changes this state takes
    ``lock`` (re-entrant: the sender wrappers hold it across vLLM's call).
    """

    def __init__(self, lru: Any) -> None:
        self.lru = lru
        self.lock = threading.RLock()
        self.alive = True
        """False once tracking of this cache was switched off; never set back."""
        self.epoch = 0
        self.seq: dict[Key, int] = {}
        """key -> its position in the sender cache's order (access counter)."""
        self.base: dict[Key, int] = {}
        """key -> its position in EngineCore's order: the last access that is not pending."""
        self.owner: dict[Key, Journal] = {}
        # key -> pending journals that moved it to most-recent (it was cached already)
        self.touched: dict[Key, dict[Journal, None]] = {}
        # keys EngineCore may have evicted while P0 kept them: sent with their data next time
        self.doubtful: set[Key] = set()
        self.pending: dict[Journal, None] = {}
        """Journals of requests processed here and not resolved yet, in processing order
        (every journal is resolved: committed, rolled back, or dropped with a reset)."""
        self.evictions = 0
        self.misplaced: dict[Key, int] = {}
        """Keys a rollback left later in the order than their counter says (see ``_place``)."""
        self._misplaced_heap: list[tuple[int, int, Key]] = []
        self._ties = itertools.count()
        self._oldest: list[tuple[int, int, Journal]] = []
        """Heap of each pending journal's lowest position (its first access): the oldest
        pending move, in O(log n) (resolved journals leave it when they reach the top)."""
        self.tail_mixed = False
        """An access outside any request's processing moved a key above pending moves: the
        pending moves are not known to be the sorted top of the order until a commit puts
        them there (see ``_arrive``)."""
        order = lru._LRUCache__order
        self.counter = itertools.count()
        """Positions of pending moves (above ``PENDING_LEVEL``), in processing order."""
        self.arrivals = itertools.count(len(order))
        """Positions of accesses EngineCore has, in the order they reach it."""
        for index, key in enumerate(order):
            self.seq[key] = index
        self.base.update(self.seq)

    # -- observation --------------------------------------------------------------

    def on_evict(self, key: Key, value: Any, journal: Journal | None) -> None:
        with self.lock:
            self.evictions += 1
            self._unmark(key)
            doubtful = key in self.doubtful
            self.doubtful.discard(key)
            seq = self.seq.pop(key, None)
            base = self.base.pop(key, None)
            owner = self.owner.pop(key, None)
            if journal is not None and journal.shadow is self:
                journal.evicted.append(Evicted(key, value, seq, base, owner, doubtful))

    def note_access(self, key: Key, journal: Journal | None, prev: int | None) -> int:
        with self.lock:
            self._unmark(key)  # (every access moves the key to the end)
            if journal is None:
                stamp = self.base[key] = next(self.arrivals)
                self.seq[key] = stamp
                if self.pending:
                    self.tail_mixed = True
            else:
                stamp = self.seq[key] = PENDING_LEVEL + next(self.counter)
                if not journal.my_seq:
                    self._note_first(journal, stamp)
                if key not in journal.my_seq:
                    journal.prev_seq[key] = prev
                    if prev is not None:
                        self.touched.setdefault(key, {})[journal] = None
                journal.my_seq[key] = stamp
            return stamp

    def _note_first(self, journal: Journal, stamp: int) -> None:
        heap = self._oldest
        heapq.heappush(heap, (stamp, next(self._ties), journal))
        if len(heap) > 2 * len(self.pending) + 64:
            # Journals resolved out of order wait in the heap until they reach the top.
            self._oldest = [
                (min(j.my_seq.values(), default=stamp), next(self._ties), j)
                for j in self.pending
                if j.my_seq or j is journal
            ]
            heapq.heapify(self._oldest)

    def _oldest_pending(self) -> int | None:
        """The lowest position a pending request's move may have (None: no pending move)."""
        heap = self._oldest
        while heap:
            stamp, _, journal = heap[0]
            if journal.state == PENDING and journal.epoch == self.epoch:
                return stamp
            heapq.heappop(heap)
        return None

    def note_update(
        self, key: Key, journal: Journal | None, present: bool, prev: int | None, with_data: bool
    ) -> None:
        """``get_and_update_item(key)`` left ``key`` in the cache.

        ``present``: it was there before the call; ``prev``: its access counter
        then; ``with_data``: the caller passed the item's data.
        """
        with self.lock:
            if with_data and key in self.doubtful:
                self.doubtful.discard(key)
                if journal is not None:
                    journal.cleared.append(key)
            self.note_access(key, journal, prev if present else None)
            owner = self.owner
            if journal is not None:
                if not present:
                    journal.prev_seq.pop(key, None)
                    journal.inserted.append(key)
                    owner[key] = journal
                elif with_data:
                    holder = owner.get(key)
                    if holder is not None and holder is not journal:
                        journal.adopted.setdefault(key, holder)
                        owner[key] = journal
            elif present and with_data:
                owner.pop(key, None)

    def looks_uncached(self, key: Key, current: Journal | None) -> bool:
        """True when ``key`` is cached here but EngineCore may not hold it yet.

        Inserted by another request that has not reached EngineCore, moved by
        one (EngineCore has not seen that move and may evict ``key`` where P0
        evicts others), or doubtful after a late rollback.
        """
        with self.lock:
            holder = self.owner.get(key)
            if holder is not None and holder is not current:
                return True
            if key in self.doubtful:
                return True
            return key in self.touched and self.at_risk(key, current)

    def at_risk(self, key: Key, current: Journal | None) -> bool:
        for journal in self.touched.get(key, ()):
            if journal is not current and journal.state == PENDING:
                return True
        return False

    def forget(self, key: Key) -> None:
        """EngineCore reported ``key`` missing and vLLM dropped it from the cache."""
        with self.lock:
            self.owner.pop(key, None)
            self.seq.pop(key, None)
            self.base.pop(key, None)
            self.doubtful.discard(key)
            self._unmark(key)

    def _release(self, journal: Journal) -> None:
        touched = self.touched
        for key in journal.prev_seq:
            holders = touched.get(key)
            if holders is None or journal not in holders:
                continue
            del holders[journal]
            if not holders:
                del touched[key]

    def prune(self) -> None:
        """Forget positions of keys that left the cache once they outnumber the cached ones.

        A key evicted while its request was pending gets a position when the
        request commits (a rollback of another pending request may bring it
        back); without a rollback it would stay forever. Amortized O(1) per call:
        the bound doubles with the cache, and a prune halves what it keeps.
        """
        with self.lock:
            data = self.lru._Cache__data
            limit = 2 * len(data) + 64
            if len(self.seq) <= limit and len(self.base) <= limit:
                if len(self.doubtful) <= len(data) + 64:
                    return
            wanted: set[Key] = set()
            for journal in self.pending:
                wanted.update(journal.my_seq)
                wanted.update(entry.key for entry in journal.evicted)
            if len(self.seq) > limit:
                self.seq = {k: v for k, v in self.seq.items() if k in data or k in wanted}
            if len(self.base) > limit:
                self.base = {k: v for k, v in self.base.items() if k in data or k in wanted}
            if len(self.doubtful) > len(data) + 64:
                self.doubtful = {k for k in self.doubtful if k in data}

    def _position(self, key: Key) -> int | None:
        """Where ``key`` belongs in the order: EngineCore's position or a pending move."""
        best = self.base.get(key)
        holder = self.owner.get(key)
        if holder is not None and holder.state == PENDING and holder.epoch == self.epoch:
            stamp = holder.my_seq.get(key)
            if stamp is not None and (best is None or stamp > best):
                best = stamp
        holders = self.touched.get(key)
        if not holders:
            return best
        # A pending move that is the key's last access is the newest there is (pending
        # moves count up; an access that reached EngineCore since may be below them).
        latest = self.seq.get(key)
        for journal in reversed(holders):  # (the last to touch it first)
            if best is not None and best == latest and best >= PENDING_LEVEL:
                break
            stamp = journal.my_seq.get(key)
            if journal.state == PENDING and stamp is not None and (best is None or stamp > best):
                best = stamp
        return best

    # -- resolution ---------------------------------------------------------------

    def commit(self, journal: Journal) -> bool:
        """The request reached EngineCore; True when this resolved ``journal`` in this epoch."""
        with self.lock:
            if journal.state != PENDING:
                return False
            journal.state = COMMITTED
            self.pending.pop(journal, None)
            try:
                if journal.epoch != self.epoch:
                    return False
                self._release(journal)
                owner = self.owner
                for key in journal.inserted:
                    if owner.get(key) is journal:
                        del owner[key]
                for key in journal.adopted:
                    if owner.get(key) is journal:
                        del owner[key]
                self._arrive(journal)
                self.prune()
            finally:
                journal.resolved()
        return True

    def _arrive(self, journal: Journal) -> None:
        """EngineCore gets ``journal``'s accesses now, after every request that reached it
        before: its keys become the most recent of what EngineCore holds, in the order the
        request touched them; keys that requests still pending moved stay above them."""
        data = self.lru._Cache__data
        order = self.lru._LRUCache__order
        base, seq = self.base, self.seq
        mine = journal.my_seq
        others = bool(self.pending)
        # In place: the order's top is the pending moves sorted, and this request's are the
        # oldest of them (a burst of commits in processing order: a batch endpoint renders
        # every input first). They are then already where EngineCore's newest keys go,
        # above every position it has and below the other pending moves: nothing moves.
        in_place = not self.tail_mixed and not self.misplaced
        oldest_other = self._oldest_pending() if in_place and others else None
        newest: list[Key] = []
        for key in sorted(mine, key=mine.__getitem__):
            stamp = base[key] = next(self.arrivals)
            if key not in data:
                # Evicted here while pending; a rollback may put it back: at this place.
                continue
            before = seq.get(key)
            position = self._position(key) if others else None
            now = seq[key] = stamp if position is None else position
            if key not in order:
                continue
            if now == stamp:
                newest.append(key)
                if before != mine[key] or (oldest_other is not None and before >= oldest_other):
                    in_place = False
            elif now != before:
                in_place = False
        if in_place:
            return
        for key in newest:
            order.move_to_end(key)
        self.tail_mixed = False
        if not others:
            return
        above: dict[Key, int] = {}
        for other in self.pending:
            for key in other.my_seq:
                position = seq.get(key)
                if position is not None and position >= PENDING_LEVEL and key in order:
                    above[key] = position
        for key in sorted(above, key=above.__getitem__):
            order.move_to_end(key)

    def rollback(self, journal: Journal) -> Rollback:
        """Undo ``journal`` (the request will never reach EngineCore)."""
        with self.lock:
            if journal.state != PENDING:
                return Rollback(False)
            journal.state = ROLLED_BACK
            self.pending.pop(journal, None)
            try:
                return self._undo(journal)
            finally:
                journal.resolved()

    def _undo(self, journal: Journal) -> Rollback:
        """The work of :meth:`rollback` (under the lock)."""
        if journal.epoch != self.epoch:
            return Rollback(False)
        self._release(journal)
        # Entries were evicted after this request was processed: those choices
        # were made with its moves in place, which EngineCore never saw.
        late = journal.evictions_mark not in (None, self.evictions)
        lru = self.lru
        data = lru._Cache__data
        owner, seq = self.owner, self.seq
        removed = restored = 0
        changed: list[Key] = []  # keys whose place in the order changed
        for key in journal.inserted:
            if owner.get(key) is journal:
                del owner[key]
                if key in data:
                    self._drop(key)
                    removed += 1
        for key, previous in journal.adopted.items():
            if owner.get(key) is not journal:
                continue
            if previous.state == PENDING and previous.epoch == self.epoch:
                owner[key] = previous
            elif previous.state == COMMITTED:
                del owner[key]
            else:
                del owner[key]
                if key in data:
                    self._drop(key)
                    removed += 1
        for key, before in journal.prev_seq.items():
            if before is None:
                continue
            if late:
                # EngineCore kept the key at its old place and may have evicted
                # it where P0 evicted others (even if a later request moved it
                # too, or evicted it since: a rollback may bring it back).
                self.doubtful.add(key)
            if key not in data:
                continue
            position = self._position(key)
            if position is None or seq.get(key) == position:
                continue
            seq[key] = position
            changed.append(key)
        for key in journal.cleared:
            if key in data:
                self.doubtful.add(key)
        # Entries this request evicted are still in EngineCore. Put them back
        # unless later requests evicted more since: EngineCore then evicted
        # these instead (they are its oldest), and putting them back would not
        # match it. Most recently used first: when not all fit, the oldest
        # stay out.
        evicted: list[Evicted] = []
        if journal.evictions_mark in (None, self.evictions):
            evicted = journal.evicted
        evicted = sorted(evicted, key=lambda e: -1 if e.seq is None else e.seq, reverse=True)
        for entry in evicted:
            key, previous_owner = entry.key, entry.owner
            if key in data:
                continue
            if previous_owner is not None and previous_owner.state == ROLLED_BACK:
                continue
            try:
                size = lru.getsizeof(entry.value)
            except Exception:
                break
            if lru.currsize + size > lru.maxsize:
                break
            lru[key] = entry.value
            if entry.base is not None:
                # (a request that reached EngineCore since may have moved it)
                self.base[key] = max(entry.base, self.base.get(key, entry.base))
            if previous_owner is not None and previous_owner.state == PENDING:
                owner[key] = previous_owner
            if entry.doubtful:
                self.doubtful.add(key)  # (one that is doubtful now stays so)
            position = self._position(key)
            seq[key] = -1 if position is None else position
            restored += 1
            changed.append(key)
        moved = self._place(changed) if changed else False
        self.prune()
        return Rollback(True, removed, restored, moved)

    def invalidate(self, keys: Iterable[Key]) -> int:
        """A drifted request's items are sent with their data again: they become doubtful
        (they look uncached to every request processed from now on), and stay in the
        cache. A request being processed meanwhile that already found one cached reads it
        again when it merges its items; taken out, vLLM's sender would fail that request
        (``Expected a cached item``, a 500). Returns how many are cached here."""
        marked = 0
        with self.lock:
            data = self.lru._Cache__data
            for key in keys:
                self.owner.pop(key, None)
                if key in data:
                    self.doubtful.add(key)
                    marked += 1
                else:
                    self.seq.pop(key, None)
        return marked

    def reset(self) -> None:
        """The cache was cleared: pending journals no longer apply (new epoch)."""
        with self.lock:
            self.epoch += 1
            self.owner.clear()
            self.touched.clear()
            self._oldest = []
            self.tail_mixed = False
            self.doubtful.clear()
            self.pending.clear()
            self.misplaced.clear()
            self._misplaced_heap = []
            self.seq.clear()
            for index, key in enumerate(self.lru._LRUCache__order):
                self.seq[key] = index
            self.base = dict(self.seq)
            self.arrivals = itertools.count(len(self.seq))

    def _drop(self, key: Key) -> None:
        self._unmark(key)
        self.doubtful.discard(key)
        self.seq.pop(key, None)
        self.base.pop(key, None)
        lru = self.lru
        order = lru._LRUCache__order
        if key not in order and key in lru._Cache__data:
            # Data without an order entry: cachetools 7+ no longer gives it one on
            # reading, so vLLM's pop would remove the data and then raise KeyError.
            order[key] = None
        lru.pop(key, None)

    def _place(self, keys: Iterable[Key]) -> bool:
        """Put ``keys`` (their access counter changed) where their counter says in the order.

        The rest of the order is sorted by counter, but for keys in ``misplaced``
        (which may sit later than their counter says, never earlier). A key goes
        to the front or the end, or next to the first key a scan of at most
        ``PLACE_SCAN`` keys from either end finds; past that it is left where it
        is and recorded as misplaced, and the eviction that reaches its counter
        takes it first (:meth:`settle_front`). So a rollback costs what the
        request touched, whatever the cache's size. True when something moved.
        """
        order = self.lru._LRUCache__order
        seq = self.seq
        moved = False
        ranked = sorted(
            ((seq[k], i, k) for i, k in enumerate(keys) if k in seq and k in order), reverse=True
        )
        # Until placed, each of them is out of place: no scan may stop at one.
        for target, _, key in ranked:
            self.misplaced[key] = target
        for target, _, key in ranked:
            del self.misplaced[key]
            self._place_one(order, key, target)
            moved = True
        return moved

    def _place_one(self, order: Any, key: Key, target: int) -> None:
        seq, misplaced = self.seq, self.misplaced
        # From the front: the keys before the first one that belongs after ``key``
        # (misplaced keys newer than ``key`` end up after it, where they belong).
        before: list[Key] = []
        newer: list[Key] = []
        for other in order:
            if other == key:
                continue
            stamp = seq.get(other)
            if stamp is not None and stamp > target:
                if other not in misplaced:
                    order.move_to_end(key, last=False)
                    for earlier in reversed(before):
                        order.move_to_end(earlier, last=False)
                    return
                newer.append(other)
            else:
                before.append(other)
            if len(before) + len(newer) >= PLACE_SCAN:
                break
        else:
            order.move_to_end(key)  # it belongs after every key in place
            for later in newer:
                order.move_to_end(later)
            return
        # From the end: the keys after the last one in place that belongs before ``key``.
        after: list[Key] = []
        for other in reversed(order):
            if other == key:
                continue
            stamp = seq.get(other)
            if stamp is not None and stamp < target and other not in misplaced:
                order.move_to_end(key)
                for later in reversed(after):
                    order.move_to_end(later)
                return
            after.append(other)
            if len(after) >= PLACE_SCAN:
                break
        # Far from both ends: left where it is, behind keys newer than it.
        misplaced[key] = target
        heapq.heappush(self._misplaced_heap, (target, next(self._ties), key))
        if len(self._misplaced_heap) > 2 * len(misplaced) + 64:
            self._misplaced_heap = [(stamp, next(self._ties), k) for k, stamp in misplaced.items()]
            heapq.heapify(self._misplaced_heap)

    def _unmark(self, key: Key) -> None:
        """``key`` is where its counter says now (moved, accessed or gone)."""
        if self.misplaced:
            self.misplaced.pop(key, None)

    def settle_front(self) -> None:
        """Before an eviction: bring the misplaced key that is oldest of all to the front."""
        with self.lock:
            if not self.misplaced:
                return
            order = self.lru._LRUCache__order
            heap, misplaced, seq = self._misplaced_heap, self.misplaced, self.seq
            while heap:
                target, _, key = heap[0]
                if misplaced.get(key) != target or seq.get(key) != target or key not in order:
                    heapq.heappop(heap)
                    if misplaced.get(key) == target:
                        del misplaced[key]
                    continue
                front = next(iter(order), None)
                stamp = seq.get(front) if front is not None else None
                if stamp is not None and target < stamp:
                    heapq.heappop(heap)
                    del misplaced[key]
                    order.move_to_end(key, last=False)
                return

    def logical_order(self) -> list[Key]:
        """The order as EngineCore has it: the LRU order with misplaced keys where they belong
        (for checks and tests; sorts the whole order)."""
        with self.lock:
            order = list(self.lru._LRUCache__order)
            if not self.misplaced:
                return order
            rest = [k for k in order if k not in self.misplaced]
            result: list[Key] = []
            pending = sorted(self.misplaced.items(), key=lambda kv: kv[1])
            i = 0
            for key in rest:
                stamp = self.seq.get(key)
                while i < len(pending) and stamp is not None and pending[i][1] < stamp:
                    result.append(pending[i][0])
                    i += 1
                result.append(key)
            result.extend(k for k, _ in pending[i:])
            return result
