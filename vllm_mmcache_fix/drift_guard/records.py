"""Processed multimodal inputs on their way to EngineCore, and what to do when they are dropped.

A request's processed inputs (``mm_kwargs``) are registered with its journal
and the means to process them again. ``process_inputs`` takes the record
back and commits (or, when it raises, rolls back); an input the garbage
collector frees without reaching it is rolled back at the next safe point
(``drain_deferred``).

Recovery needs, for a request that sent items without data, their hashes and
the means to process its inputs again (which holds the decoded images or
frames). Only a request that can be recovered gets it: one inside the
``AsyncLLM.generate`` wrapper, which opens a :class:`Slot` for its prompt
before vLLM processes it; ``process_inputs`` fills the slot of that very prompt
object (never one found by the client's request id, which need not be
unique). Pooling requests (``encode``), streaming-input sessions and offline
engines open no slot, so nothing is kept for them. A slot lives as long as its
``generate`` call waits for the first output, however the request ends; the
decoded inputs of all open slots together are bounded in bytes
(:data:`MAX_REPLAY_BYTES`): past that, a request keeps only its hashes and a
drift of it reaches the client as vLLM's error.
"""

from __future__ import annotations

import collections
import functools
import itertools
import threading
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..core import log
from ..core.messages import ROLLBACK
from .journal import Journal, Key, Shadow
from .stats import STATS

LOG_INTERVAL_S = 60.0
MAX_REPLAY_BYTES = 256 * 2**20
"""Decoded inputs kept for re-sending, over all requests waiting for their first output."""
# Walking a request's inputs to size them stops after this many objects.
_SIZE_WALK_LIMIT = 4096


@dataclass(eq=False)
class Record:
    """A processed multimodal input on its way to an ``EngineCoreRequest``."""

    key: int
    journal: Journal | None
    replay: Callable[[], Any] | None


class Attempt:
    """What ``process_inputs`` saw of a recoverable request that sent items without data."""

    __slots__ = ("hashes", "replay", "_refund", "__weakref__")

    def __init__(self, hashes: list[Key], replay: Callable[[], Any] | None, size: int) -> None:
        self.hashes = hashes
        self.replay = replay
        self._refund = weakref.finalize(self, _replays.refund, size) if replay is not None else None

    def release(self) -> None:
        """Drop the inputs kept for re-sending (the hashes stay)."""
        self.replay = None
        if self._refund is not None:
            self._refund()


class Slot:
    """One ``generate`` call's place for the attempt of its prompt, open while vLLM adds it."""

    __slots__ = ("prompt", "attempt", "__weakref__")

    def __init__(self, prompt: Any) -> None:
        self.prompt = prompt
        self.attempt: Attempt | None = None


class ReplayBudget:
    """Bytes of decoded inputs held by attempts, against :data:`MAX_REPLAY_BYTES`."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self.count = 0
        self.refused = 0
        self._lock = threading.Lock()

    def admit(self, size: int) -> bool:
        with self._lock:
            if self.held + size > self.limit:
                self.refused += 1
                return False
            self.held += size
            self.count += 1
            return True

    def refund(self, size: int) -> None:
        with self._lock:
            self.held -= size
            self.count -= 1


# id(mm_kwargs) -> (weak reference to it, record)
_registry: dict[int, tuple[weakref.ref[Any], Record]] = {}
_registry_lock = threading.Lock()
_deferred: collections.deque[Record] = collections.deque()
# id(prompt) -> slots of the generate calls adding that prompt object now
_slots: dict[int, list[Slot]] = {}
_slots_lock = threading.Lock()
_replays = ReplayBudget(MAX_REPLAY_BYTES)
shadows: weakref.WeakSet[Shadow] = weakref.WeakSet()
"""The tracked sender caches: attached on whichever thread first uses one, read on the
event loop; changed and copied under ``_shadows_lock`` only (:func:`live_shadows`)."""
_shadows_lock = threading.Lock()
_rollback_limiter = log.RateLimiter(LOG_INTERVAL_S)


def add_shadow(shadow: Shadow) -> None:
    with _shadows_lock:
        shadows.add(shadow)


def discard_shadow(shadow: Shadow) -> None:
    with _shadows_lock:
        shadows.discard(shadow)


def live_shadows() -> list[Shadow]:
    """A copy of the tracked shadows (iterating the set itself races with attaching)."""
    with _shadows_lock:
        return list(shadows)


def clear_shadows() -> None:
    with _shadows_lock:
        shadows.clear()


def pending() -> int:
    with _registry_lock:
        return len(_registry)


def has_deferred() -> bool:
    return bool(_deferred)


def clear() -> None:
    with _registry_lock:
        _registry.clear()
    _deferred.clear()
    with _slots_lock:
        slots = [slot for group in _slots.values() for slot in group]
        _slots.clear()
    for slot in slots:
        if slot.attempt is not None:
            slot.attempt.release()
            slot.attempt = None


def attempts() -> dict[str, int]:
    """Open slots, and the attempts holding decoded inputs with their bytes."""
    with _slots_lock:
        open_slots = sum(len(group) for group in _slots.values())
    return {
        "open": open_slots,
        "holding_inputs": _replays.count,
        "input_bytes": _replays.held,
        "refused_for_size": _replays.refused,
    }


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


def feature_key(feature: Any) -> Any:
    return getattr(feature, "mm_hash", None) or getattr(feature, "identifier", None)


def open_slot(prompt: Any) -> Slot:
    """A recoverable ``generate`` call is about to have ``prompt`` added."""
    slot = Slot(prompt)
    with _slots_lock:
        _slots.setdefault(id(prompt), []).append(slot)
    return slot


def close_slot(slot: Slot) -> Attempt | None:
    """The call has its first output (or ended): its attempt, which nothing else holds now."""
    with _slots_lock:
        group = _slots.get(id(slot.prompt))
        if group is not None:
            try:
                group.remove(slot)
            except ValueError:
                pass
            if not group:
                del _slots[id(slot.prompt)]
    attempt, slot.attempt = slot.attempt, None
    return attempt


def _slot_for(prompt: Any) -> Slot | None:
    with _slots_lock:
        for slot in _slots.get(id(prompt), ()):
            if slot.prompt is prompt and slot.attempt is None:
                return slot
    return None


def note_attempt(prompt: Any, request: Any, replay: Callable[[], Any] | None) -> None:
    """``process_inputs`` built ``request`` from ``prompt``: fill its slot, if it has one."""
    if not _slots:
        return
    features = getattr(request, "mm_features", None)
    if not features:
        return
    if all(getattr(f, "data", None) is not None for f in features):
        return
    slot = _slot_for(prompt)
    if slot is None:
        return  # not a request recovery can re-send
    hashes = [k for k in (feature_key(f) for f in features) if k is not None]
    size = 0
    if replay is not None:
        size = replay_size(replay)
        if not _replays.admit(size):
            replay = None
    slot.attempt = Attempt(hashes, replay, size)


def replay_size(replay: Any) -> int:
    """Bytes of the inputs a replay holds (images, frames, arrays, raw bytes), estimated.

    Inputs that cannot be sized count as too large to keep.
    """
    try:
        return estimate_bytes((getattr(replay, "args", ()), getattr(replay, "kwargs", {})))
    except Exception:
        return MAX_REPLAY_BYTES + 1


def estimate_bytes(root: Any) -> int:
    """The sizes of the buffers reachable from ``root`` through containers and attributes.

    Counted: ``nbytes`` (numpy arrays, torch tensors), PIL images (width x height x
    bands), bytes and strings. Caches met on the way (anything named ``cache``, any
    cachetools cache) are not entered, nor sequences of numbers (token ids: a prompt's
    length must not set the cost). Every object looked at counts toward
    ``_SIZE_WALK_LIMIT``, after which the walk stops: the cost is bounded whatever the
    request holds.
    """
    total = 0
    seen: set[int] = set()
    stack = [root]
    budget = _SIZE_WALK_LIMIT
    while stack and budget > 0:
        obj = stack.pop()
        budget -= 1
        if obj is None or isinstance(obj, _SCALARS) or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, (bytes, bytearray, str)):
            total += len(obj)
            continue
        nbytes = getattr(obj, "nbytes", None)
        if isinstance(nbytes, int):
            total += nbytes
            continue
        size = getattr(obj, "size", None)
        if callable(getattr(obj, "getbands", None)) and isinstance(size, tuple) and len(size) == 2:
            total += int(size[0]) * int(size[1]) * len(obj.getbands())
            continue
        if hasattr(obj, "_Cache__data"):
            continue
        if isinstance(obj, Mapping):
            try:
                values = (v for k, v in obj.items() if k not in _NOT_WALKED)
                stack.extend(itertools.islice(values, budget))
            except Exception:
                pass
            continue
        if isinstance(obj, (list, tuple)):
            if obj and isinstance(obj[0], _SCALARS) and isinstance(obj[-1], _SCALARS):
                continue  # numbers (token ids, offsets): no buffers in there
            stack.extend(itertools.islice(obj, budget))
            continue
        if isinstance(obj, (set, frozenset)):
            stack.extend(itertools.islice(obj, budget))
            continue
        fields = getattr(obj, "__dict__", None)
        if isinstance(fields, dict):
            stack.extend(
                itertools.islice((v for k, v in fields.items() if k not in _NOT_WALKED), budget)
            )
        slots = getattr(type(obj), "__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name not in _NOT_WALKED and not name.startswith("__"):
                stack.append(getattr(obj, name, None))
    return total


_SCALARS = (bool, int, float)
_NOT_WALKED = frozenset({"cache", "_cache"})


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
