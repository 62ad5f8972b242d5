"""The drift guard's counters in this process."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


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
