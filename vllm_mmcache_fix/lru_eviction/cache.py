"""An LRU whose eviction always makes progress.

vLLM's ``LRUCache`` keeps its eviction order in cachetools' private
``_LRUCache__order`` and its items in ``_Cache__data``. When the two disagree,
vLLM's ``popitem`` can pick a key that has no data, remove nothing, and let
cachetools' ``while currsize + size > maxsize: popitem()`` spin forever.

``FixedLRUMixin``'s methods are mixed into a direct subclass of vLLM's own
class (see :func:`fixed_lru_class`), so everything except ``touch``,
``popitem`` and ``clear`` stays the installed vLLM's; ``get`` and ``__setitem__`` keep
vLLM's behaviour and also count hits, misses, evictions and items too large
(:mod:`.stats`, for ``/metrics``). This module does not import vLLM: it
works with any ``cachetools.LRUCache`` subclass that has vLLM's ``pinned_items``
and ``pop`` behaviour, which keeps it testable on its own and on the released
sources of every vLLM version.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Any

from .stats import UNTRACKED, CacheStats, modality_of

_NO_VICTIM = object()

# Name of the attribute that marks a class built by this module.
MARKER = "__mmcache_fix__"
# On an instance: do not count or report its repairs (the behaviour probe).
QUIET_ATTR = "_mmcache_fix_quiet"
# On a fixed class: the vLLM class it was built from.
BASE_ATTR = "__mmcache_fix_base__"


class RepairStats:
    """How often this process had to repair a cache whose order and data disagreed.

    A plain class (not a dataclass): every process that builds a cache imports this module."""

    def __init__(self, ghost_keys_dropped: int = 0, orphans_restored: int = 0) -> None:
        self.ghost_keys_dropped = ghost_keys_dropped
        self.orphans_restored = orphans_restored
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return (
            f"RepairStats(ghost_keys_dropped={self.ghost_keys_dropped!r}, "
            f"orphans_restored={self.orphans_restored!r})"
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RepairStats):
            return NotImplemented
        return self.as_dict() == other.as_dict()

    __hash__ = None  # type: ignore[assignment]  # mutable, as the dataclass was

    def as_dict(self) -> dict[str, int]:
        return {
            "ghost_keys_dropped": self.ghost_keys_dropped,
            "orphans_restored": self.orphans_restored,
        }

    def total(self) -> int:
        return self.ghost_keys_dropped + self.orphans_restored


STATS = RepairStats()

# Called as listener(kind, count, cache) after each repair; set by the plugin to
# log. Kept as a plain hook so this module needs no logging set-up.
RepairListener = Callable[[str, int, Any], None]
_listeners: list[RepairListener] = []


def add_repair_listener(listener: RepairListener) -> None:
    if listener not in _listeners:
        _listeners.append(listener)


def remove_repair_listener(listener: RepairListener) -> None:
    if listener in _listeners:
        _listeners.remove(listener)


def _record(kind: str, count: int, cache: Any) -> None:
    if getattr(cache, QUIET_ATTR, False):
        return
    with STATS._lock:
        setattr(STATS, kind, getattr(STATS, kind) + count)
    for listener in list(_listeners):
        try:
            listener(kind, count, cache)
        except Exception:  # a broken listener must never break eviction
            pass


class FixedLRUMixin:
    """Overrides for vLLM's ``LRUCache`` that keep order and data in step.

    The methods are copied into ``type(name, (vllm_lru,), methods)`` rather
    than inherited: a second base class would change the instance layout, and
    CPython then refuses to switch a cache vLLM already built to the fixed
    class. So the methods reach vLLM's class through ``BASE_ATTR``, not
    ``super()``.

    - ``touch`` never adds a key that holds no data.
    - ``popitem`` drops order-only keys, restores order entries for data-only
      keys, and then removes a real item or raises: it never returns without
      removing something. Order and data also disagree for a moment while
      another thread is between the two halves of an insert or a delete: that
      thread is let finish first, and only what is still wrong after it is
      repaired and counted.
    - ``clear`` always terminates and leaves order and data empty.
    """

    # Private state of cachetools.Cache / cachetools.LRUCache, reached the way
    # vLLM itself reaches it. Declared for type checkers only.
    _Cache__data: dict[Hashable, Any]
    _LRUCache__order: Any
    pinned_items: set[Hashable]
    _hits: int
    _total: int
    _mmfix_stats: CacheStats

    def get(self, key: Hashable, default: Any = None, /) -> Any:
        # vLLM's own get, without its three nested __getitem__ calls, plus the hit's modality.
        # Anything unusual (an item with no order entry, one removed by another thread
        # meanwhile) goes to vLLM's own get, whose handling differs across cachetools releases.
        data = self._Cache__data
        if key in data:
            try:
                value = data[key]
                self._LRUCache__order.move_to_end(key)
            except KeyError:
                return getattr(type(self), BASE_ATTR).get(self, key, default)
            self._hits += 1
            self._total += 1
            # No call between the count's read and write: no thread switch there (stats).
            hits = self._mmfix_stats.hits  # metrics-only
            modality = modality_of(value)  # metrics-only
            try:  # metrics-only
                hits[modality] += 1  # metrics-only
            except KeyError:  # metrics-only
                hits.setdefault(modality, 0)  # metrics-only
                hits[modality] += 1  # metrics-only
            return value
        self._total += 1
        self._mmfix_stats.unfilled += 1  # metrics-only
        return default

    def touch(self, key: Hashable) -> None:
        # Membership first, as vLLM 0.24+ does: a missing key costs a dict lookup, not
        # a KeyError. A missing key is not added: vLLM <= 0.23 did, creating the ghost.
        if key in self._Cache__data:
            try:
                self._LRUCache__order.move_to_end(key)
            except KeyError:
                self._mmfix_touch_data_only(key)

    def _mmfix_touch_order_first(self, key: Hashable) -> None:
        # ``touch`` for a vLLM whose own touch moves first and adds on KeyError (<= 0.23):
        # a hit costs what vLLM's costs; a miss pays the KeyError vLLM's pays too, and
        # adds nothing. A key already order-only is moved, as vLLM does; popitem drops it.
        try:
            self._LRUCache__order.move_to_end(key)
        except KeyError:
            if key in self._Cache__data:
                self._mmfix_touch_data_only(key)

    def popitem(self, remove_pinned: bool = False) -> tuple[Hashable, Any]:
        order = self._LRUCache__order
        data = self._Cache__data
        pinned = self.pinned_items
        if len(order) == len(data):
            for key in order:
                if key not in data:
                    break  # an order-only key: vLLM's own popitem would stall on it
                if remove_pinned or key not in pinned:
                    self._mmfix_stats.evictions += 1  # metrics-only
                    return key, self.pop(key)  # type: ignore[attr-defined]
            else:
                # Order and data agree and nothing is evictable: vLLM's own popitem
                # raises the error it always raised for this case.
                return getattr(type(self), BASE_ATTR).popitem(self, remove_pinned=remove_pinned)
        self._mmfix_repair()
        victim = next(
            (k for k in order if k in data and (remove_pinned or k not in pinned)),
            _NO_VICTIM,
        )
        if victim is _NO_VICTIM:
            return getattr(type(self), BASE_ATTR).popitem(self, remove_pinned=remove_pinned)
        self._mmfix_stats.evictions += 1  # metrics-only
        return victim, self.pop(victim)  # type: ignore[attr-defined]

    def clear(self) -> None:
        data = self._Cache__data
        stats = self._mmfix_stats  # metrics-only
        evictions = stats.evictions  # metrics-only (what clear removes is not evicted)
        # Each call removes one real item, so this runs at most len(data) times.
        while data:
            self.popitem(remove_pinned=True)
        stats.evictions = evictions  # metrics-only
        if self._LRUCache__order:
            self._mmfix_repair()
        # A pin can outlive its item when cachetools' delete fails half-way.
        self.pinned_items.clear()
        # Nothing left to remove: vLLM's clear only resets its statistics now.
        getattr(type(self), BASE_ATTR).clear(self)

    def _mmfix_touch_data_only(self, key: Hashable) -> None:
        """``touch`` met a key with data and no order entry."""
        self._mmfix_wait_for_others()
        order = self._LRUCache__order
        if key not in self._Cache__data:
            return
        if key in order:
            # Another thread was inserting it and has given it its entry.
            order.move_to_end(key)
            return
        # Data without an order entry: give it one, as most recent.
        order[key] = None
        _record("orphans_restored", 1, self)

    def _mmfix_repair(self) -> None:
        """Make the order hold exactly the keys that have data.

        Order-only keys are dropped. Data-only keys go to the oldest end,
        keeping their relative order: they lost their place at some point, and
        evicting them first is the conservative choice (their data is intact,
        and P0's shadow of this cache evicts in the same order). Keys found out
        of step are looked at again once no other thread is inside cachetools'
        code on this cache: one that another thread was inserting or deleting
        is left to that thread, so only what would have stalled vLLM is
        repaired and counted.
        """
        order = self._LRUCache__order
        data = self._Cache__data
        ghosts = [key for key in order if key not in data]
        orphans = [key for key in data if key not in order]
        if not ghosts and not orphans:
            return
        self._mmfix_wait_for_others()
        ghosts = [key for key in ghosts if key in order and key not in data]
        for key in ghosts:
            order.pop(key, None)
        if ghosts:
            _record("ghost_keys_dropped", len(ghosts), self)
        orphans = [key for key in orphans if key in data and key not in order]
        for key in reversed(orphans):
            order[key] = None
            order.move_to_end(key, last=False)
        if orphans:
            _record("orphans_restored", len(orphans), self)

    def _mmfix_wait_for_others(self) -> None:
        """Let threads that are inside cachetools' own code on this cache finish.

        cachetools writes an item's data and its order entry in two steps (and
        removes them in two); a thread between the two leaves order and data apart
        for a moment. Waiting for it (at most about 0.1 s) tells that apart from
        a disagreement that stays. Only called when order and data disagree.
        """
        import sys
        import threading
        import time

        codes = {
            value.__code__
            for cls in type(self).__mro__
            if cls.__module__.split(".")[0] == "cachetools"
            for value in vars(cls).values()
            if hasattr(value, "__code__")
        }
        me = threading.get_ident()
        for _ in range(100):
            busy = False
            for ident, top in sys._current_frames().items():
                frame = top if ident != me else None
                while frame is not None and not busy:
                    busy = frame.f_code in codes and frame.f_locals.get("self") is self
                    frame = frame.f_back
            if not busy:
                return
            time.sleep(0.001)


def _counting_setitem(base_setitem: Callable[[Any, Hashable, Any], None]) -> Any:
    """``__setitem__`` that counts the item a lookup missed by modality, or an item too large."""

    def __setitem__(self: Any, key: Hashable, value: Any) -> None:
        stats = self._mmfix_stats
        try:
            base_setitem(self, key, value)
        except ValueError as exc:
            if str(exc) == TOO_LARGE:
                stats.too_large += 1
                _count_miss(stats, value)
            raise
        _count_miss(stats, value)

    return __setitem__


def _count_miss(stats: CacheStats, value: Any) -> None:
    if stats.gated:
        if stats.unfilled <= 0:
            return  # an insert no lookup missed: a put-back, not a miss
        stats.unfilled -= 1
    misses = stats.misses
    modality = modality_of(value)
    try:
        misses[modality] += 1  # no call between read and write: no thread switch there
    except KeyError:
        misses.setdefault(modality, 0)
        misses[modality] += 1


TOO_LARGE = "value too large"
"""cachetools' message for an item larger than the whole cache (5.x – 8.x)."""

_MIXED_IN = (
    "get",
    "touch",
    "popitem",
    "clear",
    "_mmfix_touch_data_only",
    "_mmfix_repair",
    "_mmfix_wait_for_others",
)
_fixed_classes: dict[type, type] = {}
_fixed_classes_lock = threading.Lock()


def _touch_adds_missing_keys(base: type) -> bool:
    """Whether ``base``'s own ``touch`` moves a key first and adds it when missing (vLLM
    <= 0.23, the ghost's origin); False when that cannot be told."""
    from .probe import probe_touch

    try:
        return probe_touch(base)
    except Exception:
        return False


def fixed_lru_class(base: type) -> type:
    """Return the fixed subclass of ``base`` (one per base class, built once)."""
    if getattr(base, MARKER, False):
        return base
    with _fixed_classes_lock:
        cls = _fixed_classes.get(base)
        if cls is None:
            untyped: Any = base
            namespace: dict[str, Any] = {
                name: value for name, value in FixedLRUMixin.__dict__.items() if name in _MIXED_IN
            }
            namespace.update(
                {
                    MARKER: True,
                    BASE_ATTR: base,
                    "__module__": __name__,
                    "__doc__": base.__doc__,
                    "__setitem__": _counting_setitem(untyped.__setitem__),
                    "_mmfix_stats": UNTRACKED,
                }
            )
            if _touch_adds_missing_keys(base):
                # Same behaviour, the base's cost on a hit (see _mmfix_touch_order_first).
                namespace["touch"] = FixedLRUMixin._mmfix_touch_order_first
            cls = type("Fixed" + base.__name__, (base,), namespace)
            _fixed_classes[base] = cls
        return cls


def is_fixed(obj: Any) -> bool:
    cls = obj if isinstance(obj, type) else type(obj)
    return bool(getattr(cls, MARKER, False))


def upgrade(cache: Any) -> Any:
    """Turn an existing vLLM ``LRUCache`` instance into its fixed class, in place."""
    if not is_fixed(cache):
        cache.__class__ = fixed_lru_class(type(cache))
    return cache


def downgrade(cache: Any) -> Any:
    """Give an upgraded instance its vLLM class back (used when unpatching)."""
    base = getattr(type(cache), BASE_ATTR, None)
    if base is not None and is_fixed(cache):
        cache.__class__ = base
    return cache


def check_compatible(cache: Any) -> str | None:
    """Why ``cache`` cannot be fixed, or None when it can.

    The mixin relies on cachetools' private names and on vLLM's pinning API;
    a cachetools or vLLM that renamed them gets the reason instead of a patch.
    """
    for name in ("_Cache__data", "_LRUCache__order"):
        if not hasattr(cache, name):
            return f"{type(cache).__name__} has no {name} (cachetools layout changed)"
    order = cache._LRUCache__order
    if not (hasattr(order, "move_to_end") and hasattr(order, "pop")):
        return f"{type(cache).__name__}._LRUCache__order is not an OrderedDict"
    if not isinstance(getattr(cache, "pinned_items", None), set):
        return f"{type(cache).__name__} has no pinned_items set (vLLM layout changed)"
    for name in ("popitem", "pop", "touch", "clear"):
        if not callable(getattr(cache, name, None)):
            return f"{type(cache).__name__} has no {name}()"
    return None
