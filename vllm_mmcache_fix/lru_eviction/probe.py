"""Behaviour probe: does this LRU class show the bug?

Version strings lie (``0.23.0+empty`` editable builds, ``.dev`` builds,
backports), so the plugin asks the class itself. Each probe builds a tiny
cache, plants one condition and makes a single call: it can never loop.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from ..core.records import frozen

_GHOST = "mmcache-fix-probe-ghost"


@frozen
class Exposure:
    """What a given LRU class does with keys that have no data."""

    touch_creates_ghost: bool
    """``touch(missing)`` adds the key to the order (vLLM <= 0.23)."""

    eviction_stalls_on_ghost: bool
    """``popitem()`` returns without removing anything when the oldest key has no data."""

    error: str | None = None
    """Set when the probe itself could not run; the other fields are then guesses."""

    @property
    def known_trigger(self) -> bool:
        """The 400-then-same-image sequence can freeze this class."""
        return self.touch_creates_ghost and self.eviction_stalls_on_ghost

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"known_trigger": self.known_trigger}


def _new(cls: type) -> Any:
    cache = cls(1000, getsizeof=lambda value: 1)
    # A fixed class repairs what the probe plants; that is not a real repair.
    cache._mmcache_fix_quiet = True
    return cache


def probe_touch(cls: type) -> bool:
    cache = _new(cls)
    cache.touch(_GHOST)
    return _GHOST in cache._LRUCache__order and _GHOST not in cache._Cache__data


def probe_popitem(cls: type) -> bool:
    cache = _new(cls)
    cache["real"] = 1
    order = cache._LRUCache__order
    order[_GHOST] = None
    order.move_to_end(_GHOST, last=False)
    try:
        cache.popitem()
    except Exception:
        # Raising is progress of a kind: the eviction loop ends.
        return False
    return "real" in cache._Cache__data and len(cache._Cache__data) == 1


def probe(cls: type) -> Exposure:
    try:
        return Exposure(
            touch_creates_ghost=probe_touch(cls),
            eviction_stalls_on_ghost=probe_popitem(cls),
        )
    except Exception as exc:
        # Assume the worst: the caller decides whether to warn.
        return Exposure(True, True, error=f"{type(exc).__name__}: {exc}")
