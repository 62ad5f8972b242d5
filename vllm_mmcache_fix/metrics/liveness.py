"""Engine liveness metrics: net progress, empty steps, step durations, verdicts by class.

Everything about these four series is in this one module (names, specs, buckets, the
updates), so it can move as a block; ``names.METRICS`` and the exporter each take it in one
marked line. The figures come with every heartbeat answer of the first API server
(``Liveness.progress_figures``), as the other EngineCore series do.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ..engine_liveness.progress import STEP_BOUNDS
from .names import MetricSpec

STALLED_SECONDS = "mmcache_fix_engine_seconds_without_progress"
EMPTY_STEPS = "mmcache_fix_engine_empty_steps_total"
STEP_SECONDS = "mmcache_fix_engine_step_seconds"
VERDICTS = "mmcache_fix_engine_verdicts_total"

SPECS: tuple[MetricSpec, ...] = (
    MetricSpec(
        STALLED_SECONDS,
        "gauge",
        ("engine",),
        "Seconds since the EngineCore last made net progress (a request finished or was "
        "aborted, or computed past its high-water mark) while eligible work waited; 0 when "
        "idle; NaN once the engine's check is off or no longer runs. /health fails past "
        "MMCACHE_FIX_PROGRESS_TIMEOUT.",
        multiprocess_mode="livemax",
    ),
    MetricSpec(
        EMPTY_STEPS,
        "counter",
        ("engine",),
        "EngineCore steps that made no net progress while eligible work waited (a zero-token "
        "livelock or a preemption cascade makes many).",
    ),
    MetricSpec(
        STEP_SECONDS,
        "histogram",
        ("engine",),
        "Duration of each EngineCore busy-loop step (schedule, execute, update).",
    ),
    MetricSpec(
        VERDICTS,
        "counter",
        ("engine", "class"),
        "Stall episodes that failed /health, per verdict class (silent: input thread "
        "silent; loop: one step/add/abort past its bound; no_progress: no net progress).",
    ),
)

BUCKETS: dict[str, tuple[float, ...]] = {STEP_SECONDS: STEP_BOUNDS}
"""Histogram buckets of this block (the exporter's default is the round-trip one)."""

Labels = tuple[tuple[str, str], ...]


def _num(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def plan(
    increase: Any, figures: Iterable[Mapping[str, Any]] | None
) -> tuple[list[tuple[str, Labels, str, float]], list[tuple[Labels, list[float], float]]]:
    """The gauge/counter updates (as the exporter's plan gives them) and the step histogram's
    bucket increases (labels, per-bucket increase, sum increase) for ``figures``.
    ``increase(metric, labels, value)`` turns a cumulative value into its increase."""
    updates: list[tuple[str, Labels, str, float]] = []
    histograms: list[tuple[Labels, list[float], float]] = []
    for figure in figures or ():
        engine = figure.get("engine")
        if not isinstance(engine, str):
            continue
        labels: Labels = (("engine", engine),)
        stalled = _num(figure.get("stalled_s"))
        if stalled is not None:
            updates.append((STALLED_SECONDS, labels, "set", stalled))
        empty = _num(figure.get("empty_steps"))
        if empty is not None:
            updates.append((EMPTY_STEPS, labels, "inc", increase(EMPTY_STEPS, labels, empty)))
        verdicts = figure.get("verdicts")
        for kind, count in sorted((verdicts or {}).items()):
            number = _num(count)
            if number is not None:
                by_class = (*labels, ("class", str(kind)))
                updates.append((VERDICTS, by_class, "inc", increase(VERDICTS, by_class, number)))
        counts = figure.get("step_counts")
        total = _num(figure.get("step_sum"))
        if (
            isinstance(counts, list)
            and len(counts) == len(STEP_BOUNDS) + 1
            and all(_num(c) is not None for c in counts)
            and total is not None
        ):
            grown = [
                increase(STEP_SECONDS, (*labels, ("le", str(i))), float(c))
                for i, c in enumerate(counts)
            ]
            histograms.append((labels, grown, increase(STEP_SECONDS, labels, total)))
    return updates, histograms


def add_to_histogram(child: Any, per_bucket: list[float], total: float) -> None:
    """Add counts to a ``prometheus_client`` histogram child bucket by bucket.

    prometheus_client has no public call for observations counted elsewhere (EngineCore
    counts them, the API server exports them): its child keeps one value per bucket
    (``_buckets``, non-cumulative) and ``_sum``, each with ``inc``, in every version vLLM
    pins and in multiprocess mode too. Without them, one observation per step at the
    bucket's bound (at most 1,000 per call)."""
    buckets = getattr(child, "_buckets", None)
    sums = getattr(child, "_sum", None)
    if isinstance(buckets, list) and len(buckets) == len(per_bucket) and sums is not None:
        for value, amount in zip(buckets, per_bucket):
            if amount > 0:
                value.inc(amount)
        if total > 0:
            sums.inc(total)
        return
    bounds = (*STEP_BOUNDS, STEP_BOUNDS[-1] * 2)
    budget = 1000
    for bound, amount in zip(bounds, per_bucket):
        for _ in range(min(int(amount), budget)):
            child.observe(bound)
            budget -= 1
