"""The pending table: processed multimodal inputs on their way to EngineCore, and what to do
when they are dropped.

A request's processed inputs (``mm_kwargs``) are registered with its journal
and the means to process them again. ``process_inputs`` takes the record
back and commits (or, when it raises, rolls back); an input the garbage
collector frees without reaching it is rolled back at the next safe point
(``drain_deferred``).
"""

from __future__ import annotations

import collections
import functools
import itertools
import threading
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

from ..core import log
from ..core.messages import ROLLBACK
from .journal import Journal
from .stats import DriftStats

LOG_INTERVAL_S = 60.0


class Record:
    """A processed multimodal input on its way to an ``EngineCoreRequest``."""

    __slots__ = ("key", "journal", "replay")

    def __init__(self, key: int, journal: Journal | None, replay: Callable[[], Any] | None) -> None:
        self.key = key
        self.journal = journal
        self.replay = replay

    def __repr__(self) -> str:
        return f"Record(key={self.key!r}, journal={self.journal!r}, replay={self.replay!r})"


class Entry(NamedTuple):
    """A registered processed input: a weak reference to it, and its record."""

    ref: weakref.ref[Any]
    record: Record


class PendingTable:
    """The processed inputs on their way to EngineCore, by ``id(mm_kwargs)``, and the
    records the garbage collector dropped before they got there."""

    def __init__(self, stats: DriftStats) -> None:
        self.stats = stats
        self._entries: dict[int, Entry] = {}
        self._lock = threading.Lock()
        self._deferred: collections.deque[Record] = collections.deque()
        self._rollback_limiter = log.RateLimiter(LOG_INTERVAL_S)

    def pending(self) -> int:
        with self._lock:
            return len(self._entries)

    def has_deferred(self) -> bool:
        return bool(self._deferred)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
        self._deferred.clear()

    def reset(self) -> None:
        """As built: empty, and the next rollback logged at once."""
        self.clear()
        self._rollback_limiter = log.RateLimiter(LOG_INTERVAL_S)

    def _on_collected(self, record: Record, _ref: weakref.ref[Any]) -> None:
        # Runs inside the garbage collector, possibly in the middle of a cache
        # operation: only queue the record, it is resolved at the next safe point.
        self._deferred.append(record)

    def register(self, obj: Any, journal: Journal | None, replay: Callable[[], Any] | None) -> None:
        record = Record(id(obj), journal, replay)
        try:
            ref = weakref.ref(obj, functools.partial(self._on_collected, record))
        except TypeError:
            # Not weakly referenceable: nothing could tell when it is dropped.
            if journal is not None:
                self.commit(journal)
            return
        with self._lock:
            # An older entry under the same id belongs to a dead object; its
            # callback has queued it already.
            self._entries[record.key] = Entry(ref, record)

    def take(self, obj: Any) -> Record | None:
        with self._lock:
            entry = self._entries.get(id(obj))
            if entry is None or entry.ref() is not obj:
                return None
            del self._entries[id(obj)]
        return entry.record

    def lookup(self, obj: Any) -> Record | None:
        with self._lock:
            entry = self._entries.get(id(obj))
        if entry is not None and entry.ref() is obj:
            return entry.record
        return None

    def drain_deferred(self) -> None:
        """Roll back journals whose processed input was dropped before reaching the engine."""
        while self._deferred:
            try:
                record = self._deferred.popleft()
            except IndexError:
                return
            with self._lock:
                entry = self._entries.get(record.key)
                if entry is not None and entry.record is record:
                    del self._entries[record.key]
            if record.journal is not None:
                self.rollback(record.journal, "dropped before reaching the engine")

    def commit(self, journal: Journal) -> None:
        if journal.shadow.commit(journal):
            self.stats.bump("commits")

    def rollback(self, journal: Journal, why: str) -> None:
        done = journal.shadow.rollback(journal)
        if not done.done:
            return
        stats = self.stats
        stats.add("rollbacks")
        if done.removed:
            stats.add("rollback_keys_removed", done.removed)
        if done.restored:
            stats.add("rollback_entries_restored", done.restored)
        if done.moved:
            stats.add("rollback_reorders")
        may_log, held = self._rollback_limiter.ready()
        if may_log:
            log.info(
                "%s of a request that never reached EngineCore (%s): %d key(s) removed, "
                "%d evicted entr%s restored%s; totals: rollbacks=%d%s",
                ROLLBACK,
                why,
                done.removed,
                done.restored,
                "y" if done.restored == 1 else "ies",
                ", order restored" if done.moved else "",
                stats.get("rollbacks"),
                f"; {held} more since the last line" if held else "",
            )

    def records_of(self, prompt: Any, collector: list[Any]) -> list[Record]:
        """The records of a request: its prompt's processed inputs and those made inside it."""
        if not collector:
            objs = mm_kwargs_objects(prompt)
            if len(objs) == 1:
                record = self.take(objs[0])
                return [] if record is None else [record]
        records: list[Record] = []
        seen: set[int] = set()
        for obj in itertools.chain(collector, mm_kwargs_objects(prompt)):
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            record = self.take(obj)
            if record is not None:
                records.append(record)
        return records


def mm_kwargs_objects(prompt: Any) -> list[Any]:
    if not isinstance(prompt, dict):
        return []
    value = prompt.get("mm_kwargs")
    if value is not None:
        return [value]
    found = []
    for key in ("encoder", "decoder", "encoder_prompt", "decoder_prompt"):
        sub = prompt.get(key)
        if isinstance(sub, dict):
            value = sub.get("mm_kwargs")
            if value is not None:
                found.append(value)
    return found


def has_missing_data(mm_kwargs: Any) -> bool:
    # MultiModalKwargsItems is a UserDict: read its plain dict directly.
    data = getattr(mm_kwargs, "data", mm_kwargs)
    try:
        for items in data.values():
            for item in items:
                if item is None:
                    return True
    except Exception:
        return False
    return False
