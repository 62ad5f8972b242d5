"""What the drift guard's wrappers read and change: one state object (its flags, counters,
tables and tracked caches), one error book."""

from __future__ import annotations

import threading
import weakref
from typing import Any, NamedTuple

from ..core import log
from ..core.guard import InternalErrors, Site
from ..core.settings import DriftMode
from .attempts import AttemptTable
from .journal import Shadow
from .pending import PendingTable
from .stats import DriftStats

FIX_ID = "mm-drift-guard"
DRIFT_LOG_INTERVAL_S = 60.0


SITE_NAMES = {
    "sender_init": "sender.__init__",
    "evict_before": "sender.evict:before",
    "evict": "sender.evict",
    "is_cached": "sender.is_cached_item",
    "touch_before": "sender.touch_sender_cache_item:before",
    "touch_after": "sender.touch_sender_cache_item:after",
    "update_before": "sender.get_and_update_item:before",
    "update_after": "sender.get_and_update_item:after",
    "clear": "sender.clear_cache",
    "invalidate": "sender.invalidate",
    "apply": "processor.apply",
    "lookup": "processor._get_cache_missing_items",
    "merge_before": "processor._merge_mm_kwargs:before",
    "merge_after": "processor._merge_mm_kwargs:after",
    "merge_failed": "processor._merge_mm_kwargs:failed",
    "inputs_before": "process_inputs:before",
    "inputs_after": "process_inputs:after",
    "inputs_failed": "process_inputs:failed",
    "generate_start": "generate:start",
    "generate_first": "generate:first_output",
    "generate_retry": "generate:retry",
    "generate_result": "generate:retry_output",
}
"""Each guarded place of the drift guard's wrappers -> its name in the error book (counts,
``MMCACHE_FIX_FAIL_AT``). The hand-off around admission control shares the
``process_inputs`` places: it is where that request's journals resolve."""


class Sites(NamedTuple):
    """The drift guard's guarded places, one :class:`~..core.guard.Site` each."""

    sender_init: Site
    evict_before: Site
    evict: Site
    is_cached: Site
    touch_before: Site
    touch_after: Site
    update_before: Site
    update_after: Site
    clear: Site
    invalidate: Site
    apply: Site
    lookup: Site
    merge_before: Site
    merge_after: Site
    merge_failed: Site
    inputs_before: Site
    inputs_after: Site
    inputs_failed: Site
    generate_start: Site
    generate_first: Site
    generate_retry: Site
    generate_result: Site

    @property
    def merge(self) -> tuple[Site, Site, Site]:
        """``_merge_mm_kwargs``' places: before, after, failed."""
        return self.merge_before, self.merge_after, self.merge_failed

    @property
    def inputs(self) -> tuple[Site, Site, Site]:
        """``process_inputs``' places (the hand-off's too): before, after, failed."""
        return self.inputs_before, self.inputs_after, self.inputs_failed

    @classmethod
    def of(cls, errors: InternalErrors) -> Sites:
        return cls(**{attr: errors.site(name) for attr, name in SITE_NAMES.items()})


class GuardState:
    """The guard's state in this process (a plain class: built in every API server, where a
    dataclass would compile its methods at start-up)."""

    def __init__(self, fix: Any = None, errors: InternalErrors | None = None) -> None:
        self.mode: str | None = None
        self.installed = False
        self.tracking = False
        """A sender cache is tracked in this process (so this is the API server)."""
        self.switched_off: str | None = None
        """Why tracking was switched off for good (an internal error), or None."""
        self.patched: dict[str, str] = {}
        self.sender_types: tuple[type, ...] = ()
        self.lock = threading.RLock()
        self.fix = fix
        """The :class:`~.fix.DriftGuard` that owns this state (``fix.note``, ``fix.announce``)."""
        if errors is None:
            errors = InternalErrors(FIX_ID, lambda where, exc: None)
        self.errors: InternalErrors = errors
        """The fix's error book; ``sites`` are its entries."""
        self.sites = Sites.of(errors)
        self.stats = DriftStats()
        self.pending = PendingTable(self.stats)
        self.attempts = AttemptTable()
        self.drift_limiter = log.RateLimiter(DRIFT_LOG_INTERVAL_S)
        """One log line per interval for drifted requests (recovery)."""
        self.shadows: weakref.WeakSet[Shadow] = weakref.WeakSet()
        """The tracked sender caches: attached on whichever thread first uses one, read on the
        event loop; changed and copied under ``_shadows_lock`` only (:meth:`live_shadows`)."""
        self._shadows_lock = threading.Lock()

    def reset(self) -> None:
        """As built (the lock, the tables and the counters stay the same objects)."""
        self.drift_limiter = log.RateLimiter(DRIFT_LOG_INTERVAL_S)
        self.pending.reset()
        self.attempts.clear()
        self.clear_shadows()
        self.mode = None
        self.installed = False
        self.tracking = False
        self.switched_off = None
        self.patched = {}
        self.sender_types = ()
        self.stats.reset()

    def add_shadow(self, shadow: Shadow) -> None:
        with self._shadows_lock:
            self.shadows.add(shadow)

    def discard_shadow(self, shadow: Shadow) -> None:
        with self._shadows_lock:
            self.shadows.discard(shadow)

    def live_shadows(self) -> list[Shadow]:
        """A copy of the tracked shadows (iterating the set itself races with attaching)."""
        with self._shadows_lock:
            return list(self.shadows)

    def clear_shadows(self) -> None:
        with self._shadows_lock:
            self.shadows.clear()

    @property
    def live(self) -> bool:
        """Wrappers do their bookkeeping only while this holds."""
        return self.tracking and self.switched_off is None

    @property
    def prevent(self) -> bool:
        return self.mode == DriftMode.ON and "process_inputs" in self.patched

    @property
    def recovery(self) -> bool:
        return "generate" in self.patched
