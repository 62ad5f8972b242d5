"""The drift guard's counters in this process."""

from __future__ import annotations

import threading

COUNTS = tuple(
    "journals commits rollbacks rollback_keys_removed rollback_entries_restored "
    "rollback_reorders tentative_bypasses engine_reported_misses drift_events recoveries "
    "recovery_failures recovery_unavailable".split()
)
"""Every count :class:`DriftStats` keeps, in the order ``status()`` lists them."""


class DriftStats:
    """:data:`COUNTS` by name; ``_lock`` is renewed in a forked child (``engine_liveness.fork``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(COUNTS, 0)

    def add(self, name: str, count: int = 1) -> None:
        with self._lock:
            self._counts[name] += count

    def bump(self, name: str) -> None:
        """Unlocked increment for counters on the request path (may undercount under races)."""
        self._counts[name] += 1

    def get(self, name: str) -> int:
        return self._counts[name]

    def as_dict(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def reset(self) -> None:
        with self._lock:
            self._counts = dict.fromkeys(COUNTS, 0)

    def __repr__(self) -> str:
        return f"DriftStats({self.as_dict()})"
