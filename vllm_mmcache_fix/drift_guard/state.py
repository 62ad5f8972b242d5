"""What the drift guard's wrappers read and change: one state object (its flags, counters,
tables and tracked caches), one error book."""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

from ..core import log
from ..core.guard import InternalErrors
from ..core.settings import DriftMode
from .attempts import AttemptTable
from .journal import Shadow
from .pending import PendingTable
from .stats import DriftStats

FIX_ID = "mm-drift-guard"
DRIFT_LOG_INTERVAL_S = 60.0


@dataclass
class GuardState:
    mode: DriftMode | None = None
    installed: bool = False
    tracking: bool = False
    """A sender cache is tracked in this process (so this is the API server)."""
    switched_off: str | None = None
    """Why tracking was switched off for good (an internal error), or None."""
    patched: dict[str, str] = field(default_factory=dict)
    sender_types: tuple[type, ...] = ()
    lock: threading.RLock = field(default_factory=threading.RLock)
    fix: Any = None
    """The :class:`~.fix.DriftGuard` that owns this state."""
    stats: DriftStats = field(default_factory=DriftStats)
    pending: PendingTable = field(init=False)
    attempts: AttemptTable = field(default_factory=AttemptTable)
    drift_limiter: log.RateLimiter = field(
        default_factory=lambda: log.RateLimiter(DRIFT_LOG_INTERVAL_S)
    )
    """One log line per interval for drifted requests (recovery)."""
    shadows: weakref.WeakSet[Shadow] = field(default_factory=weakref.WeakSet)
    """The tracked sender caches: attached on whichever thread first uses one, read on the
    event loop; changed and copied under ``_shadows_lock`` only (:meth:`live_shadows`)."""
    _shadows_lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.pending = PendingTable(self.stats)

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
        return self.mode is DriftMode.ON and "process_inputs" in self.patched

    @property
    def recovery(self) -> bool:
        return "generate" in self.patched


STATE = GuardState()


def _on_error(where: str, exc: BaseException) -> None:
    fix = STATE.fix
    if fix is not None:
        fix.switch_off(where, exc)


ERRORS = InternalErrors(FIX_ID, _on_error)
