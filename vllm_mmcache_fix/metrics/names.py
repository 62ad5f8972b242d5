"""Every metric the plugin exports (README: "Metrics"), gathered from the fixes' declarations.

Each metric's name, type, labels and description are declared by the fix that counts it
(``<fix>/owns.py``); the names are re-exported here for the tools and the harness.

No name contains ``vllm``: vLLM's stat logger unregisters collectors whose name starts
with ``vllm:`` (0.23.0: whose name contains ``vllm`` anywhere).
"""

from __future__ import annotations

from collections.abc import Iterable

from ..core.declaration import (
    INTERNAL_ERRORS,
    INTERNAL_ERRORS_COUNT,
    INTERNAL_ERRORS_METRIC,
    Count,
    Declaration,
    MetricSpec,
    lazy_attribute,
)
from ..drift_guard.owns import DRIFT_EVENTS, RECOVERIES, RECOVERY_FAILURES, ROLLBACKS
from ..engine_liveness.owns import (
    DEPRECATED_ROUND_TRIPS_FAILED,
    ENGINE_LAST_ANSWER_AGE,
    ROUND_TRIP_SECONDS,
    STUCK_ABORTS,
    STUCK_HEALTH_CHECKS,
)
from ..lru_eviction.owns import (
    CACHE_LABELS,
    CACHE_REPAIRS,
    MM_CACHE_BYTES,
    MM_CACHE_CAPACITY,
    MM_CACHE_ENTRIES,
    MM_CACHE_EVICTIONS,
    MM_CACHE_HITS,
    MM_CACHE_MISSES,
    MM_CACHE_TOO_LARGE,
    PROTECTED_PROCESSES,
    REPAIR_GHOST,
    REPAIR_ORPHAN,
)
from ..stall_sentinel.owns import CAUSE_BUSY, CAUSE_CACHE_EVICTION, STALLS
from .owns import BUILD_INFO

TYPE_CHECKING = False

__all__ = [
    "BUILD_INFO",
    "CACHE_LABELS",
    "CACHE_REPAIRS",
    "CAUSE_BUSY",
    "CAUSE_CACHE_EVICTION",
    "DEPRECATED_ROUND_TRIPS_FAILED",
    "DRIFT_EVENTS",
    "ENGINE_LAST_ANSWER_AGE",
    "INTERNAL_ERRORS",
    "MM_CACHE_BYTES",
    "MM_CACHE_CAPACITY",
    "MM_CACHE_ENTRIES",
    "MM_CACHE_EVICTIONS",
    "MM_CACHE_HITS",
    "MM_CACHE_MISSES",
    "MM_CACHE_TOO_LARGE",
    "PROTECTED_PROCESSES",
    "RECOVERIES",
    "RECOVERY_FAILURES",
    "REPAIR_GHOST",
    "REPAIR_ORPHAN",
    "ROLLBACKS",
    "ROUND_TRIP_SECONDS",
    "STALLS",
    "STUCK_ABORTS",
    "STUCK_HEALTH_CHECKS",
    "MetricSpec",
    "all_counts",
    "all_metrics",
]

PREFIX = "mmcache_fix_"

# Label values.
KIND_API_SERVER = "api_server"
KIND_ENGINE_CORE = "engine_core"


def all_metrics(declarations: Iterable[Declaration] | None = None) -> tuple[MetricSpec, ...]:
    """Every metric: the plugin's internal errors, then each fix's declared metrics (``None``:
    every fix of ``plugin.py``)."""
    if declarations is None:
        from .. import plugin

        declarations = plugin.declarations()
    return (INTERNAL_ERRORS_METRIC, *(spec for d in declarations for spec in d.metrics))


def all_counts(declarations: Iterable[Declaration] | None = None) -> tuple[Count, ...]:
    """Every count that feeds a metric, as :func:`all_metrics`."""
    if declarations is None:
        from .. import plugin

        declarations = plugin.declarations()
    counts = (c for d in declarations for c in d.counts)
    return (INTERNAL_ERRORS_COUNT, *(c for c in counts if c.metric))


__getattr__ = lazy_attribute(__name__, "METRICS", all_metrics)


if TYPE_CHECKING:
    METRICS: tuple[MetricSpec, ...]
    """Every metric the plugin exports (:func:`all_metrics`)."""


ROUND_TRIP_BUCKETS: tuple[float, ...] = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)


def alias_help(spec: MetricSpec) -> str:
    """The description of ``spec``'s deprecated former name (exporter and docs alike)."""
    return f"Deprecated: the former name of {spec.name} (same value). {spec.help}"


_MERGED = {"livesum": "summed", "livemin": "the smallest", "livemax": "the largest"}


def markdown_table(declarations: Iterable[Declaration] | None = None) -> str:
    """The metrics table of ``docs/health.md``: one row per metric, its description the one
    its ``/metrics`` HELP line carries (``python -m harness.fix_tables --write``)."""
    rows = ["| metric | type | labels | meaning |", "|---|---|---|---|"]
    for spec in all_metrics(declarations):
        kind = spec.kind
        if kind == "gauge":
            kind += (
                f" ({_MERGED.get(spec.multiprocess_mode, spec.multiprocess_mode)} over API servers)"
            )
        labels = ", ".join(f"`{label}`" for label in spec.labels)
        rows.append(f"| `{spec.name}` | {kind} | {labels} | {spec.help} |")
        if spec.deprecated_alias:
            rows.append(f"| `{spec.deprecated_alias}` | {kind} | {labels} | {alias_help(spec)} |")
    return "\n".join(rows)
