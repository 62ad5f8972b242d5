"""Keep the API server's multimodal sender cache in step with EngineCore's.

The API-server process (P0) keeps a metadata-only shadow of EngineCore's (P1)
receiver cache and sends ``data=None`` for items it believes P1 holds. When
the two disagree, P1 gets a request that names an item it does not have:
vLLM <= 0.27 fails an assertion (500 on every retry until P0 evicts the item),
vLLM >= 0.28 raises ``MultiModalCacheMissError`` (one 500, P0 drops the hashes).

The known cause: P0 updates the shadow while processing the multimodal items,
and a check that runs afterwards (the prompt length after placeholder
expansion, vllm#43941) rejects the request, so P1 never sees it. This module:

Prevention (``MMCACHE_FIX_DRIFT=on``, the default)
    Every change a request makes to the sender cache is journaled (keys it
    inserted, keys it moved to most-recent with their previous position, entries
    evicted to make room). The journal is committed when the request is turned
    into an ``EngineCoreRequest`` and rolled back when that step raises, or when
    the processed input is dropped without reaching it. A rollback restores
    membership and LRU order exactly as P1 has them: inserted keys leave,
    evicted entries come back, touched keys return to their old position (the
    shadow keeps an access counter per key, so order is restored by sorting on
    it). While a request is in flight, the keys it inserted or moved are
    "tentative": other requests see them as not cached and send the data
    themselves. A rollback that comes after later evictions (the processed
    input was only freed by the garbage collector) cannot know what P1 evicted
    instead; the keys it moves back are sent with their data the next time.

Recovery (``on`` and ``recover``)
    When the first output of a request that sent items as ``data=None`` is an
    error with no tokens, all of the request's items are dropped from the
    shadow, its multimodal items are processed again (they now carry data) and
    the request is re-submitted once, before anything reaches the client.

Nothing here imports vLLM; targets are found by feature detection among
modules that are already imported, or patched right after they are imported.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import functools
import itertools
import os
import sys
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from . import _log, importhook, registry

ENV_DRIFT = "MMCACHE_FIX_DRIFT"
LOG_INTERVAL_S = 60.0
MAX_ATTEMPTS = 4096

PATCH_PREFIX = "mm-drift"


class DriftMode(str, enum.Enum):
    ON = "on"
    """Undo the cache changes of rejected requests and recover from P1 misses."""
    RECOVER = "recover"
    """Only recover from P1 misses (re-send with data)."""
    OFF = "off"
    """Patch nothing for drift."""


def read_drift_mode(environ: Mapping[str, str] | None = None) -> tuple[DriftMode, str | None]:
    env = os.environ if environ is None else environ
    raw = (env.get(ENV_DRIFT) or "").strip().lower()
    if not raw:
        return DriftMode.ON, None
    for mode in DriftMode:
        if raw == mode.value:
            return mode, None
    allowed = "|".join(m.value for m in DriftMode)
    return DriftMode.ON, f"{ENV_DRIFT}={raw!r} is not one of {allowed}; using 'on'"


# --------------------------------------------------------------------------- statistics


@dataclass
class DriftStats:
    journals: int = 0
    commits: int = 0
    rollbacks: int = 0
    rollback_keys_removed: int = 0
    rollback_entries_restored: int = 0
    rollback_reorders: int = 0
    tentative_bypasses: int = 0
    engine_reported_misses: int = 0
    drift_events: int = 0
    recoveries: int = 0
    recovery_failures: int = 0
    recovery_unavailable: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, name: str, count: int = 1) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + count)

    def bump(self, name: str) -> None:
        """Unlocked increment for counters on the request path (may undercount under races)."""
        setattr(self, name, getattr(self, name) + 1)

    def as_dict(self) -> dict[str, int]:
        with self._lock:
            return {k: v for k, v in vars(self).items() if not k.startswith("_")}

    def reset(self) -> None:
        with self._lock:
            for name in list(vars(self)):
                if not name.startswith("_"):
                    setattr(self, name, 0)


STATS = DriftStats()
_drift_limiter = _log.RateLimiter(LOG_INTERVAL_S)
_rollback_limiter = _log.RateLimiter(LOG_INTERVAL_S)


# --------------------------------------------------------------------------- journals

PENDING, COMMITTED, ROLLED_BACK = 0, 1, 2

Hashable = Any  # cache keys are mm hashes (str); kept loose for test doubles

_tls = threading.local()


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
        self.epoch = shadow.epoch
        self.state = PENDING
        # key -> access counter before this request first touched it (key was present)
        self.prev_seq: dict[Hashable, int | None] = {}
        # key -> access counter this request gave it last
        self.my_seq: dict[Hashable, int] = {}
        self.inserted: list[Hashable] = []
        # key -> the pending journal that had inserted it before this one sent its data
        self.adopted: dict[Hashable, Journal] = {}
        # (key, value, access counter, pending owner) of entries evicted meanwhile
        self.evicted: list[tuple[Hashable, Any, int | None, Journal | None]] = []
        # The shadow's eviction count when this request's processing ended.
        self.evictions_mark: int | None = None
        self.sent_without_data = 0
        # doubtful keys whose data this request sent
        self.cleared: list[Hashable] = []


class Shadow:
    """Bookkeeping attached to one sender cache instance (``sender._cache`` is the LRU)."""

    def __init__(self, lru: Any) -> None:
        self.lru = lru
        self.lock = threading.RLock()
        self.epoch = 0
        self.seq: dict[Hashable, int] = {}
        self.owner: dict[Hashable, Journal] = {}
        # key -> pending journals that moved it to most-recent (it was cached already)
        self.touched: dict[Hashable, list[Journal]] = {}
        # keys P1 may have evicted while P0 kept them: sent with their data next time
        self.doubtful: set[Hashable] = set()
        self.evictions = 0
        order = lru._LRUCache__order
        self.counter = itertools.count(len(order))
        for index, key in enumerate(order):
            self.seq[key] = index

    # -- observation --------------------------------------------------------------

    def current(self) -> Journal | None:
        journal = getattr(_tls, "journal", None)
        if journal is not None and journal.shadow is self:
            return journal
        return None

    def on_evict(self, key: Hashable, value: Any) -> None:
        self.evictions += 1
        self.doubtful.discard(key)
        seq = self.seq.pop(key, None)
        owner = self.owner.pop(key, None)
        journal = self.current()
        if journal is not None:
            journal.evicted.append((key, value, seq, owner))

    def note_access(self, key: Hashable, journal: Journal | None, prev: int | None) -> int:
        stamp = next(self.counter)
        self.seq[key] = stamp
        if journal is not None:
            if key not in journal.my_seq:
                journal.prev_seq[key] = prev
                if prev is not None:
                    self.touched.setdefault(key, []).append(journal)
            journal.my_seq[key] = stamp
        return stamp

    def at_risk(self, key: Hashable, current: Journal | None) -> bool:
        """True when another request that has not reached P1 moved ``key``.

        P1 has not seen that move: it may evict ``key`` where P0 evicts others.
        """
        for journal in self.touched.get(key, ()):
            if journal is not current and journal.state == PENDING:
                return True
        return False

    def _release(self, journal: Journal) -> None:
        touched = self.touched
        for key in journal.prev_seq:
            holders = touched.get(key)
            if holders is None:
                continue
            try:
                holders.remove(journal)
            except ValueError:
                continue
            if not holders:
                del touched[key]

    def prune(self) -> None:
        data = self.lru._Cache__data
        if len(self.seq) > 2 * len(data) + 64:
            self.seq = {k: v for k, v in self.seq.items() if k in data}

    # -- resolution ---------------------------------------------------------------

    def commit(self, journal: Journal) -> None:
        with self.lock:
            if journal.state != PENDING:
                return
            journal.state = COMMITTED
            if journal.epoch != self.epoch:
                return
            self._release(journal)
            owner = self.owner
            for key in journal.inserted:
                if owner.get(key) is journal:
                    del owner[key]
            for key in journal.adopted:
                if owner.get(key) is journal:
                    del owner[key]
        STATS.bump("commits")

    def rollback(self, journal: Journal) -> tuple[int, int, bool]:
        """Undo ``journal``; returns (keys removed, entries restored, order changed)."""
        with self.lock:
            if journal.state != PENDING:
                return 0, 0, False
            journal.state = ROLLED_BACK
            if journal.epoch != self.epoch:
                return 0, 0, False
            self._release(journal)
            # Entries were evicted after this request was processed: those choices
            # were made with its moves in place, which P1 never saw.
            late = journal.evictions_mark not in (None, self.evictions)
            lru = self.lru
            data = lru._Cache__data
            owner, seq = self.owner, self.seq
            removed = restored = 0
            moved = False
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
                if before is None or key not in data:
                    continue
                if seq.get(key) == journal.my_seq.get(key):
                    seq[key] = before
                    moved = True
                    if late:
                        # P1 kept the key at its old place and may have evicted it
                        # where P0 evicted others.
                        self.doubtful.add(key)
            for key in journal.cleared:
                if key in data:
                    self.doubtful.add(key)
            # Entries this request evicted are still in P1. Put them back unless
            # later requests evicted more since: P1 then evicted these instead
            # (they are its oldest), and putting them back would not match it.
            # Most recently used first: when not all fit, the oldest stay out.
            evicted = []
            if journal.evictions_mark in (None, self.evictions):
                evicted = journal.evicted
            evicted = sorted(evicted, key=lambda e: -1 if e[2] is None else e[2], reverse=True)
            for key, value, stamp, previous_owner in evicted:
                if key in data:
                    continue
                if previous_owner is not None and previous_owner.state == ROLLED_BACK:
                    continue
                try:
                    size = lru.getsizeof(value)
                except Exception:
                    break
                if lru.currsize + size > lru.maxsize:
                    break
                lru[key] = value
                seq[key] = -1 if stamp is None else stamp
                if previous_owner is not None and previous_owner.state == PENDING:
                    owner[key] = previous_owner
                restored += 1
                moved = True
            if moved:
                moved = self._reorder()
            self.prune()
        STATS.add("rollbacks")
        if removed:
            STATS.add("rollback_keys_removed", removed)
        if restored:
            STATS.add("rollback_entries_restored", restored)
        if moved:
            STATS.add("rollback_reorders")
        return removed, restored, moved

    def invalidate(self, keys: Iterable[Hashable]) -> int:
        dropped = 0
        with self.lock:
            data = self.lru._Cache__data
            for key in keys:
                self.owner.pop(key, None)
                if key in data:
                    self._drop(key)
                    dropped += 1
                else:
                    self.seq.pop(key, None)
        return dropped

    def reset(self) -> None:
        with self.lock:
            self.epoch += 1
            self.owner.clear()
            self.touched.clear()
            self.doubtful.clear()
            self.seq.clear()
            for index, key in enumerate(self.lru._LRUCache__order):
                self.seq[key] = index
            self.counter = itertools.count(len(self.seq))

    def _drop(self, key: Hashable) -> None:
        self.doubtful.discard(key)
        self.seq.pop(key, None)
        self.lru.pop(key, None)

    def _reorder(self) -> bool:
        """Sort the LRU order by access counter; True when something moved."""
        order = self.lru._LRUCache__order
        seq = self.seq
        ranked: list[tuple[int, int, Hashable]] = []
        last = -(1 << 62)
        ordered = True
        for index, key in enumerate(order):
            stamp = seq.get(key)
            if stamp is None:
                stamp = last
            elif stamp < last:
                ordered = False
            last = max(last, stamp)
            ranked.append((stamp, index, key))
        if ordered:
            return False
        ranked.sort(key=lambda r: (r[0], r[1]))
        for _, _, key in ranked:
            order.move_to_end(key)
        return True


# --------------------------------------------------------------------------- records

_SHADOW_ATTR = "_mmcache_fix_drift"
_UNSUPPORTED = False  # stored in the instance when its cache cannot be tracked


@dataclass(eq=False)
class _Record:
    """A processed multimodal input on its way to an ``EngineCoreRequest``."""

    key: int
    journal: Journal | None
    replay: Callable[[], Any] | None


@dataclass
class _Attempt:
    hashes: list[Hashable]
    replay: Callable[[], Any] | None


# id(mm_kwargs) -> (weak reference to it, record)
_registry: dict[int, tuple[weakref.ref, _Record]] = {}
_registry_lock = threading.Lock()
_deferred: collections.deque[_Record] = collections.deque()
_attempts: collections.OrderedDict[Any, _Attempt] = collections.OrderedDict()
_attempts_lock = threading.Lock()
_shadows: weakref.WeakSet[Shadow] = weakref.WeakSet()


@dataclass
class _State:
    mode: DriftMode | None = None
    installed: bool = False
    tracking: bool = False  # a sender cache exists in this process
    patched: dict[str, str] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    hook: importhook.PostImportHook | None = None
    lock: threading.RLock = field(default_factory=threading.RLock)
    announced: bool = False
    recovery_announced: bool = False
    sender_types: tuple[type, ...] = ()


_state = _State()


def _prevent() -> bool:
    return _state.mode is DriftMode.ON and "process_inputs" in _state.patched


def _on_collected(record: _Record, _ref: weakref.ref) -> None:
    # Runs inside the garbage collector, possibly in the middle of a cache
    # operation: only queue the record, it is resolved at the next safe point.
    _deferred.append(record)


def _register(obj: Any, journal: Journal | None, replay: Callable[[], Any] | None) -> None:
    record = _Record(id(obj), journal, replay)
    try:
        ref = weakref.ref(obj, functools.partial(_on_collected, record))
    except TypeError:
        # Not weakly referenceable: nothing could tell when it is dropped.
        if journal is not None:
            journal.shadow.commit(journal)
        return
    with _registry_lock:
        # An older entry under the same id belongs to a dead object; its
        # callback has queued it already.
        _registry[record.key] = (ref, record)


def _take(obj: Any) -> _Record | None:
    with _registry_lock:
        entry = _registry.get(id(obj))
        if entry is None or entry[0]() is not obj:
            return None
        del _registry[id(obj)]
    return entry[1]


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
            _rollback(record.journal, "dropped before reaching the engine")


def _rollback(journal: Journal, why: str) -> None:
    removed, restored, moved = journal.shadow.rollback(journal)
    may_log, held = _rollback_limiter.ready()
    if may_log:
        _log.info(
            "undid the multimodal cache changes of a request that never reached EngineCore "
            "(%s): %d key(s) removed, %d evicted entr%s restored%s; totals: rollbacks=%d%s",
            why,
            removed,
            restored,
            "y" if restored == 1 else "ies",
            ", order restored" if moved else "",
            STATS.rollbacks,
            f"; {held} more since the last line" if held else "",
        )


# --------------------------------------------------------------------------- cache wrappers


def _check_lru(lru: Any) -> str | None:
    if lru is None:
        return "no _cache attribute"
    for name in ("_Cache__data", "_LRUCache__order"):
        if not hasattr(lru, name):
            return f"{type(lru).__name__} has no {name}"
    if not hasattr(lru._LRUCache__order, "move_to_end"):
        return f"{type(lru).__name__}._LRUCache__order is not an OrderedDict"
    for name in ("pop", "popitem", "getsizeof", "currsize", "maxsize"):
        if not hasattr(lru, name):
            return f"{type(lru).__name__} has no {name}"
    return None


def _attach(sender: Any) -> Shadow | None:
    lru = getattr(sender, "_cache", None)
    reason = _check_lru(lru)
    if reason is not None:
        sender.__dict__[_SHADOW_ATTR] = _UNSUPPORTED
        _note_problem(f"sender cache not tracked: {reason}")
        return None
    shadow = Shadow(lru)

    def popitem(*args: Any, **kwargs: Any) -> Any:
        key, value = type(lru).popitem(lru, *args, **kwargs)
        shadow.on_evict(key, value)
        return key, value

    lru.__dict__["popitem"] = popitem
    sender.__dict__[_SHADOW_ATTR] = shadow
    _shadows.add(shadow)
    _state.tracking = True
    return shadow


def _shadow_of(sender: Any) -> Shadow | None:
    try:
        shadow = sender.__dict__.get(_SHADOW_ATTR)
    except AttributeError:
        return None
    if shadow is None:
        # Only instances of the patched sender classes: a processor-only or
        # shared-memory cache passed to the same processor is left alone.
        if not _state.installed or not isinstance(sender, _state.sender_types):
            return None
        with _state.lock:
            shadow = sender.__dict__.get(_SHADOW_ATTR)
            if shadow is None:
                return _attach(sender)
    return shadow or None


def _wrap_init(orig: Callable[..., None]) -> Callable[..., None]:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        orig(self, *args, **kwargs)
        try:
            _shadow_of(self)
            with _state.lock:
                _announce()
        except Exception as exc:  # never break cache construction
            _note_problem(f"could not track a sender cache: {exc!r}")

    return __init__


def _wrap_is_cached_item(orig: Callable[[Any, Any], bool]) -> Callable[[Any, Any], bool]:
    def is_cached_item(self: Any, mm_hash: Any) -> bool:
        hit = orig(self, mm_hash)
        if hit:
            shadow = self.__dict__.get(_SHADOW_ATTR)
            if shadow:
                current = shadow.current()
                holder = shadow.owner.get(mm_hash)
                if holder is not None and holder is not current:
                    # Inserted by a request that has not reached EngineCore yet.
                    STATS.add("tentative_bypasses")
                    return False
                if mm_hash in shadow.doubtful or (
                    mm_hash in shadow.touched and shadow.at_risk(mm_hash, current)
                ):
                    STATS.add("tentative_bypasses")
                    return False
        return hit

    return is_cached_item


def _wrap_touch(orig: Callable[[Any, Any], None]) -> Callable[[Any, Any], None]:
    def touch_sender_cache_item(self: Any, mm_hash: Any) -> None:
        shadow = _shadow_of(self)
        if shadow is None:
            return orig(self, mm_hash)
        with shadow.lock:
            data = shadow.lru._Cache__data
            present = mm_hash in data
            prev = shadow.seq.get(mm_hash)
            orig(self, mm_hash)
            if present and mm_hash in data:
                shadow.note_access(mm_hash, shadow.current(), prev)
        return None

    return touch_sender_cache_item


def _wrap_get_and_update_item(orig: Callable[[Any, Any, Any], Any]) -> Callable[..., Any]:
    def get_and_update_item(self: Any, mm_item: Any, mm_hash: Any) -> Any:
        shadow = _shadow_of(self)
        if shadow is None:
            return orig(self, mm_item, mm_hash)
        with shadow.lock:
            data = shadow.lru._Cache__data
            present = mm_hash in data
            prev = shadow.seq.get(mm_hash)
            journal = shadow.current()
            result = orig(self, mm_item, mm_hash)
            if mm_hash in data:
                if mm_item is not None and mm_hash in shadow.doubtful:
                    shadow.doubtful.discard(mm_hash)
                    if journal is not None:
                        journal.cleared.append(mm_hash)
                shadow.note_access(mm_hash, journal, prev if present else None)
                owner = shadow.owner
                if journal is not None:
                    if not present:
                        journal.prev_seq.pop(mm_hash, None)
                        journal.inserted.append(mm_hash)
                        owner[mm_hash] = journal
                    elif mm_item is not None:
                        holder = owner.get(mm_hash)
                        if holder is not None and holder is not journal:
                            journal.adopted.setdefault(mm_hash, holder)
                            owner[mm_hash] = journal
                elif present and mm_item is not None:
                    owner.pop(mm_hash, None)
            if _sent_without_data(result):
                if mm_item is not None:
                    # The data is at hand: send it rather than rely on the shadow.
                    return mm_item
                if journal is not None:
                    journal.sent_without_data += 1
        return result

    return get_and_update_item


def _sent_without_data(result: Any) -> bool:
    return isinstance(result, tuple) and len(result) == 2 and result[0] is None


def _wrap_clear_cache(orig: Callable[[Any], None]) -> Callable[[Any], None]:
    def clear_cache(self: Any) -> None:
        shadow = self.__dict__.get(_SHADOW_ATTR)
        if not shadow:
            return orig(self)
        with shadow.lock:
            orig(self)
            shadow.reset()
        return None

    return clear_cache


def _wrap_invalidate(orig: Callable[[Any, Any], None]) -> Callable[[Any, Any], None]:
    def invalidate(self: Any, mm_hash: Any) -> None:
        shadow = self.__dict__.get(_SHADOW_ATTR)
        if not shadow:
            return orig(self, mm_hash)
        with shadow.lock:
            orig(self, mm_hash)
            shadow.owner.pop(mm_hash, None)
            shadow.seq.pop(mm_hash, None)
            shadow.doubtful.discard(mm_hash)
        STATS.add("engine_reported_misses")
        return None

    return invalidate


# --------------------------------------------------------------------------- processor wrappers


def _wrap_merge(orig: Callable[..., Any]) -> Callable[..., Any]:
    def _merge_mm_kwargs(self: Any, *args: Any, **kwargs: Any) -> Any:
        cache = args[0] if args else kwargs.get("cache")
        shadow = _shadow_of(cache) if cache is not None and _state.installed else None
        if shadow is None or getattr(_tls, "journal", None) is not None:
            return orig(self, *args, **kwargs)
        if _deferred:
            drain_deferred()
        journal: Journal | None = None
        if _prevent():
            journal = Journal(shadow)
            STATS.bump("journals")
            _tls.journal = journal
        try:
            out = orig(self, *args, **kwargs)
        except BaseException:
            _tls.journal = None
            if journal is not None:
                _rollback(journal, "multimodal processing failed")
            raise
        _tls.journal = None
        if journal is not None:
            journal.evictions_mark = shadow.evictions
        try:
            mm_kwargs = out[0]
        except Exception:
            mm_kwargs = None
        if mm_kwargs is None:
            if journal is not None:
                shadow.commit(journal)
            return out
        replay = None
        if "generate" in _state.patched:
            if journal.sent_without_data if journal is not None else _has_missing_data(mm_kwargs):
                replay = getattr(_tls, "apply_ctx", None)
        if journal is not None or replay is not None:
            _register(mm_kwargs, journal, replay)
        collector = getattr(_tls, "collector", None)
        if collector is not None:
            collector.append(mm_kwargs)
        return out

    return _merge_mm_kwargs


def _has_missing_data(mm_kwargs: Any) -> bool:
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


def _wrap_apply(orig: Callable[..., Any]) -> Callable[..., Any]:
    def apply(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not _state.tracking:
            return orig(self, *args, **kwargs)
        previous = getattr(_tls, "apply_ctx", None)
        _tls.apply_ctx = _Replay(apply, self, args, kwargs)
        try:
            return orig(self, *args, **kwargs)
        finally:
            _tls.apply_ctx = previous

    return apply


class _Replay:
    """Runs the multimodal processor again on the same inputs."""

    __slots__ = ("func", "processor", "args", "kwargs")

    def __init__(self, func: Callable[..., Any], processor: Any, args: tuple, kwargs: dict) -> None:
        self.func = func
        self.processor = processor
        self.args = args
        self.kwargs = kwargs

    def __call__(self) -> Any:
        return self.func(self.processor, *self.args, **self.kwargs)


def _mm_kwargs_objects(prompt: Any) -> list[Any]:
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


def _wrap_process_inputs(orig: Callable[..., Any]) -> Callable[..., Any]:
    def process_inputs(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not _state.tracking:
            return orig(self, *args, **kwargs)
        if _deferred:
            drain_deferred()
        prompt = kwargs["prompt"] if "prompt" in kwargs else (args[1] if len(args) > 1 else None)
        outer = getattr(_tls, "collector", None)
        collector: list[Any] = []
        _tls.collector = collector
        try:
            request = orig(self, *args, **kwargs)
        except BaseException:
            _tls.collector = outer
            for record in _records(prompt, collector):
                if record.journal is not None:
                    _rollback(record.journal, "rejected after multimodal processing")
            raise
        _tls.collector = outer
        replay = None
        for record in _records(prompt, collector):
            if record.journal is not None:
                record.journal.shadow.commit(record.journal)
            replay = replay or record.replay
        request_id = kwargs["request_id"] if "request_id" in kwargs else (args[0] if args else None)
        _note_attempt(request_id, request, replay)
        return request

    return process_inputs


def _records(prompt: Any, collector: list[Any]) -> list[_Record]:
    if not collector:
        objs = _mm_kwargs_objects(prompt)
        if len(objs) == 1:
            record = _take(objs[0])
            return [] if record is None else [record]
    records: list[_Record] = []
    seen: set[int] = set()
    for obj in itertools.chain(collector, _mm_kwargs_objects(prompt)):
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        record = _take(obj)
        if record is not None:
            records.append(record)
    return records


def _feature_key(feature: Any) -> Any:
    return getattr(feature, "mm_hash", None) or getattr(feature, "identifier", None)


def _note_attempt(request_id: Any, request: Any, replay: Callable[[], Any] | None) -> None:
    if request_id is None or "generate" not in _state.patched:
        return
    features = getattr(request, "mm_features", None)
    if not features:
        return
    if all(getattr(f, "data", None) is not None for f in features):
        return
    hashes = [k for k in (_feature_key(f) for f in features) if k is not None]
    with _attempts_lock:
        _attempts[request_id] = _Attempt(hashes, replay)
        while len(_attempts) > MAX_ATTEMPTS:
            _attempts.popitem(last=False)


def _pop_attempt(request_id: Any) -> _Attempt | None:
    with _attempts_lock:
        return _attempts.pop(request_id, None)


# --------------------------------------------------------------------------- recovery


def _request_id_of(args: tuple, kwargs: dict) -> Any:
    # generate(self, prompt, sampling_params, request_id, ...)
    if "request_id" in kwargs:
        return kwargs["request_id"]
    return args[1] if len(args) > 1 else None


def _may_need_recovery(prompt: Any) -> bool:
    if not isinstance(prompt, dict):
        return False
    mm_kwargs = prompt.get("mm_kwargs")
    if mm_kwargs is not None:
        entry = _registry.get(id(mm_kwargs))
        if entry is not None and entry[0]() is mm_kwargs:
            # Processed here: a replay was kept exactly when an item went without data.
            return entry[1].replay is not None
        return _has_missing_data(mm_kwargs)
    # A raw prompt: its items are processed inside add_request.
    return prompt.get("multi_modal_data") is not None


def _is_error_without_tokens(out: Any) -> bool:
    if not getattr(out, "finished", False):
        return False
    outputs = getattr(out, "outputs", None)
    if not outputs:
        return False
    for completion in outputs:
        if str(getattr(completion, "finish_reason", None)) != "error":
            return False
        if getattr(completion, "token_ids", None):
            return False
    return True


def _executor_of(engine: Any) -> Any:
    renderer = getattr(engine, "renderer", None)
    if renderer is None:
        renderer = getattr(getattr(engine, "input_processor", None), "renderer", None)
    for name in ("_mm_executor", "_executor"):
        executor = getattr(renderer, name, None)
        if executor is not None and callable(getattr(executor, "submit", None)):
            return executor
    return None


async def _prepare_retry(engine: Any, prompt: Any, attempt: _Attempt) -> Any:
    """The prompt to submit again, with its multimodal data, or None when impossible."""
    for shadow in list(_shadows):
        shadow.invalidate(attempt.hashes)
    if not (isinstance(prompt, dict) and "mm_kwargs" in prompt):
        return prompt  # processed again inside add_request
    if attempt.replay is None:
        return None
    executor = _executor_of(engine)
    if executor is not None:
        result = await asyncio.get_running_loop().run_in_executor(executor, attempt.replay)
    else:
        result = attempt.replay()
    if not isinstance(result, Mapping) or "mm_kwargs" not in result:
        return None
    if result.get("mm_hashes") != prompt.get("mm_hashes"):
        return None
    if list(result.get("prompt_token_ids") or ()) != list(prompt.get("prompt_token_ids") or ()):
        return None
    retry = dict(prompt)
    retry["mm_kwargs"] = result["mm_kwargs"]
    return retry


def _wrap_generate(orig: Callable[..., Any]) -> Callable[..., Any]:
    def generate(self: Any, prompt: Any, *args: Any, **kwargs: Any) -> Any:
        if not _state.tracking or not _may_need_recovery(prompt):
            return orig(self, prompt, *args, **kwargs)
        return _guarded(orig, self, prompt, args, kwargs)

    return generate


async def _guarded(
    orig: Callable[..., Any], engine: Any, prompt: Any, args: tuple, kwargs: dict
) -> AsyncIterator[Any]:
    request_id = _request_id_of(args, kwargs)
    attempt: _Attempt | None = None
    stream = orig(engine, prompt, *args, **kwargs)
    try:
        try:
            first = await stream.__anext__()
        except StopAsyncIteration:
            return
        finally:
            attempt = _pop_attempt(request_id)
        if attempt is None or not _is_error_without_tokens(first):
            yield first
            async for out in stream:
                yield out
            return
    finally:
        await stream.aclose()

    STATS.add("drift_events")
    retry_prompt = None
    try:
        retry_prompt = await _prepare_retry(engine, prompt, attempt)
    except Exception as exc:
        _note_problem(f"could not prepare a re-submission: {exc!r}")
    if retry_prompt is None:
        STATS.add("recovery_unavailable")
        _log_drift(request_id, attempt, "it could not be re-sent (inputs unavailable)")
        yield first
        return
    stream = orig(engine, retry_prompt, *args, **kwargs)
    try:
        try:
            again = await stream.__anext__()
        except StopAsyncIteration:
            return
        finally:
            _pop_attempt(request_id)
        if _is_error_without_tokens(again):
            STATS.add("recovery_failures")
            _log_drift(request_id, attempt, "it failed again after re-sending the data")
        else:
            STATS.add("recoveries")
            _log_drift(request_id, attempt, "recovered by re-sending the data")
        yield again
        async for out in stream:
            yield out
    finally:
        await stream.aclose()


def _log_drift(request_id: Any, attempt: _Attempt, outcome: str) -> None:
    may_log, held = _drift_limiter.ready()
    if not may_log:
        return
    totals = STATS.as_dict()
    _log.warning(
        "P0/P1 multimodal cache drift in %s: EngineCore had no data for request %s "
        "(%d item(s) were sent as already cached); %s. Totals: drift_events=%d "
        "recoveries=%d recovery_failures=%d rollbacks=%d%s",
        _process_label(),
        request_id,
        len(attempt.hashes),
        outcome,
        totals["drift_events"],
        totals["recoveries"],
        totals["recovery_failures"],
        totals["rollbacks"],
        f"; {held} more drift events since the last line" if held else "",
    )


# --------------------------------------------------------------------------- targets


@dataclass(frozen=True)
class _Target:
    name: str
    candidates: tuple[tuple[str, str], ...]
    required: tuple[str, ...]
    wrappers: tuple[tuple[str, Callable[[Any], Any]], ...]


TARGETS: tuple[_Target, ...] = (
    _Target(
        "sender",
        (
            ("vllm.multimodal.cache.lru", "LruKeyReplicatedSenderCache"),
            ("vllm.multimodal.cache", "MultiModalProcessorSenderCache"),
        ),
        ("get_and_update_item", "touch_sender_cache_item", "is_cached_item"),
        (
            ("__init__", _wrap_init),
            ("is_cached_item", _wrap_is_cached_item),
            ("touch_sender_cache_item", _wrap_touch),
            ("get_and_update_item", _wrap_get_and_update_item),
            ("clear_cache", _wrap_clear_cache),
            ("invalidate", _wrap_invalidate),
        ),
    ),
    _Target(
        "processor",
        (
            ("vllm.multimodal.processing.processor", "BaseMultiModalProcessor"),
            ("vllm.multimodal.processing", "BaseMultiModalProcessor"),
        ),
        ("_merge_mm_kwargs", "apply"),
        (("_merge_mm_kwargs", _wrap_merge), ("apply", _wrap_apply)),
    ),
    _Target(
        "process_inputs",
        (
            ("vllm.v1.engine.input_processor", "InputProcessor"),
            ("vllm.v1.engine.processor", "Processor"),
        ),
        ("process_inputs",),
        (("process_inputs", _wrap_process_inputs),),
    ),
    _Target(
        "generate",
        (("vllm.v1.engine.async_llm", "AsyncLLM"),),
        ("generate",),
        (("generate", _wrap_generate),),
    ),
)

WATCHED = tuple(sorted({module for t in TARGETS for module, _ in t.candidates}))


def _find(target: _Target) -> tuple[type | None, str | None]:
    """(class, None) when found; (None, reason) when a candidate module is loaded but unusable."""
    reasons = []
    for module_name, class_name in target.candidates:
        module: ModuleType | None = sys.modules.get(module_name)
        if module is None:
            continue
        cls = getattr(module, class_name, None)
        if not isinstance(cls, type) or cls.__module__ != module_name:
            reasons.append(f"{module_name}: no class {class_name} defined there")
            continue
        missing = [a for a in target.required if not callable(cls.__dict__.get(a))]
        if missing:
            reasons.append(f"{module_name}.{class_name}: no {', '.join(missing)}")
            continue
        return cls, None
    return None, "; ".join(reasons) or None


def _patch_available() -> None:
    with _state.lock:
        for target in TARGETS:
            if target.name in _state.patched:
                continue
            cls, reason = _find(target)
            if cls is None:
                if reason and reason not in _state.problems:
                    _note_problem(f"{target.name}: {reason}")
                continue
            for attr, make in target.wrappers:
                original = cls.__dict__.get(attr)
                if not callable(original):
                    continue
                registry.apply(f"{PATCH_PREFIX}-{target.name}", cls, attr, make(original))
            _state.patched[target.name] = f"{cls.__module__}.{cls.__qualname__}"
            if target.name == "sender":
                _state.sender_types = (cls,)
        _announce()


def _announce() -> None:
    needed = {"sender", "processor", "process_inputs"}
    if not needed <= set(_state.patched):
        return
    recovery = "generate" in _state.patched
    if not _log.has_destination():
        return  # vLLM's logging is not set up yet; the sender cache retries
    if not _state.announced:
        _state.announced = True
        _log.info(
            "drift guard active in %s (mode=%s): %s; recovery from EngineCore misses %s",
            _process_label(),
            _state.mode.value if _state.mode else "?",
            ", ".join(f"{k}={v}" for k, v in sorted(_state.patched.items())),
            "on" if recovery else "waits for vllm.v1.engine.async_llm",
        )
        _state.recovery_announced = recovery
    elif recovery and not _state.recovery_announced:
        _state.recovery_announced = True
        _log.info("drift recovery active in %s: %s", _process_label(), _state.patched["generate"])


def _note_problem(problem: str) -> None:
    with _state.lock:
        if problem in _state.problems:
            return
        _state.problems.append(problem)
    _log.info("drift guard: %s", problem)


def _process_label() -> str:
    from .startup import process_label

    return process_label()


def _on_import(name: str) -> None:
    try:
        _patch_available()
        if len(_state.patched) == len(TARGETS):
            _remove_hook()
    except Exception as exc:
        _note_problem(f"internal error after importing {name}: {exc!r}")


def _remove_hook() -> None:
    hook = _state.hook
    _state.hook = None
    if hook is not None:
        importhook.remove_hook(hook)


# --------------------------------------------------------------------------- public API


def install_drift_fix(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Patch what is imported now and the rest when it is imported; idempotent, never raises."""
    try:
        with _state.lock:
            if _state.installed or _state.mode is DriftMode.OFF:
                return status()
            mode, problem = read_drift_mode(environ)
            _state.mode = mode
            if problem:
                _note_problem(problem)
            if mode is DriftMode.OFF:
                return status()
            _state.installed = True
            _patch_available()
            if len(_state.patched) < len(TARGETS):
                _state.hook = importhook.when_imported(WATCHED, _on_import)
    except Exception as exc:
        try:
            _log.warning("drift guard not installed, internal error: %r", exc)
        except Exception:
            pass
    return status()


def uninstall_drift_fix() -> None:
    """Undo everything :func:`install_drift_fix` did in this process (for tests)."""
    with _state.lock:
        _remove_hook()
        for applied in registry.applied():
            if applied.patch_id.startswith(PATCH_PREFIX):
                registry.revert(applied.owner, applied.attr)
        for shadow in list(_shadows):
            shadow.lru.__dict__.pop("popitem", None)
        _shadows.clear()
        with _registry_lock:
            _registry.clear()
        _deferred.clear()
        with _attempts_lock:
            _attempts.clear()
        _state.mode = None
        _state.installed = False
        _state.tracking = False
        _state.patched = {}
        _state.problems = []
        _state.announced = False
        _state.recovery_announced = False
        _state.sender_types = ()
        STATS.reset()


def forget_sender(sender: Any) -> None:
    """Stop tracking one sender cache instance (tests)."""
    shadow = sender.__dict__.pop(_SHADOW_ATTR, None)
    if shadow:
        shadow.lru.__dict__.pop("popitem", None)
        _shadows.discard(shadow)


def status() -> dict[str, Any]:
    with _state.lock:
        return {
            "mode": _state.mode.value if _state.mode else None,
            "installed": _state.installed,
            "patched": dict(_state.patched),
            "tracking": _state.tracking,
            "pending": len(_registry),
            "problems": list(_state.problems),
            "counts": STATS.as_dict(),
        }
