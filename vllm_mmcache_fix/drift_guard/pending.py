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
from dataclasses import dataclass
from typing import Any

from ..core import log
from ..core.messages import ROLLBACK
from .journal import Journal
from .stats import STATS

LOG_INTERVAL_S = 60.0


@dataclass(eq=False)
class Record:
    """A processed multimodal input on its way to an ``EngineCoreRequest``."""

    key: int
    journal: Journal | None
    replay: Callable[[], Any] | None


# id(mm_kwargs) -> (weak reference to it, record)
_registry: dict[int, tuple[weakref.ref[Any], Record]] = {}
_registry_lock = threading.Lock()
_deferred: collections.deque[Record] = collections.deque()
_rollback_limiter = log.RateLimiter(LOG_INTERVAL_S)


def pending() -> int:
    with _registry_lock:
        return len(_registry)


def has_deferred() -> bool:
    return bool(_deferred)


def clear() -> None:
    with _registry_lock:
        _registry.clear()
    _deferred.clear()


def _on_collected(record: Record, _ref: weakref.ref[Any]) -> None:
    # Runs inside the garbage collector, possibly in the middle of a cache
    # operation: only queue the record, it is resolved at the next safe point.
    _deferred.append(record)


def register(obj: Any, journal: Journal | None, replay: Callable[[], Any] | None) -> None:
    record = Record(id(obj), journal, replay)
    try:
        ref = weakref.ref(obj, functools.partial(_on_collected, record))
    except TypeError:
        # Not weakly referenceable: nothing could tell when it is dropped.
        if journal is not None:
            commit(journal)
        return
    with _registry_lock:
        # An older entry under the same id belongs to a dead object; its
        # callback has queued it already.
        _registry[record.key] = (ref, record)


def take(obj: Any) -> Record | None:
    with _registry_lock:
        entry = _registry.get(id(obj))
        if entry is None or entry[0]() is not obj:
            return None
        del _registry[id(obj)]
    return entry[1]


def lookup(obj: Any) -> Record | None:
    with _registry_lock:
        entry = _registry.get(id(obj))
    if entry is not None and entry[0]() is obj:
        return entry[1]
    return None


def drain_deferred() -> None:
    """Roll back journals whose processed input was dropped before reaching the engine."""
    while _deferred:
        try:
            record = _deferred.popleft()
        except IndexError:
            return
        with _registry_lock:
            entry = _registry.get(record.key)
            if entry is not None and entry[1] is record:
                del _registry[record.key]
        if record.journal is not None:
            rollback(record.journal, "dropped before reaching the engine")


def commit(journal: Journal) -> None:
    if journal.shadow.commit(journal):
        STATS.bump("commits")


def rollback(journal: Journal, why: str) -> None:
    done = journal.shadow.rollback(journal)
    if not done.done:
        return
    STATS.add("rollbacks")
    if done.removed:
        STATS.add("rollback_keys_removed", done.removed)
    if done.restored:
        STATS.add("rollback_entries_restored", done.restored)
    if done.moved:
        STATS.add("rollback_reorders")
    may_log, held = _rollback_limiter.ready()
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
            STATS.rollbacks,
            f"; {held} more since the last line" if held else "",
        )


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


def records_of(prompt: Any, collector: list[Any]) -> list[Record]:
    """The records of a request: its prompt's processed inputs and those made inside it."""
    if not collector:
        objs = mm_kwargs_objects(prompt)
        if len(objs) == 1:
            record = take(objs[0])
            return [] if record is None else [record]
    records: list[Record] = []
    seen: set[int] = set()
    for obj in itertools.chain(collector, mm_kwargs_objects(prompt)):
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        record = take(obj)
        if record is not None:
            records.append(record)
    return records


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
