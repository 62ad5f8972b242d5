"""Counters of this API server and of EngineCore as prometheus_client metrics.

The plugin's counters are plain cumulative numbers in each process. A small daemon
thread (and each heartbeat answer) turns them into metric updates: the increase
since the last sync for counters, the value for gauges. :func:`plan` is that pure step;
:class:`Exporter` applies it to ``prometheus_client`` objects, created lazily.

EngineCore's counters reach every API server with each heartbeat answer (every 2 s, no
``/health`` needed). With several API servers they would be counted once per API server,
so only the first one (``client_index`` 0) exports them; each API server exports its own
counters, and the multiprocess collector adds them up.

A sync that fails (the plugin's own counters read in a race, say) is retried at the next
interval; only :data:`MAX_FAILED_SYNCS` failures in a row stop the thread.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..core.declaration import ENGINE_NAME_KEY, Count, Declaration
from ..lru_eviction import stats as cache_stats
from . import liveness as liveness_metrics
from . import names as n

SYNC_INTERVAL_S = 1.0
MAX_FAILED_SYNCS = 30
"""Consecutive failed syncs (30 s) that make the exporter give up: a persistent error."""

Labels = tuple[tuple[str, str], ...]
Update = tuple[str, Labels, str, float]
"""(metric name, labels, ``"inc"`` or ``"set"``, amount)."""

_CACHE_GAUGES = {
    "bytes": n.MM_CACHE_BYTES,
    "capacity_bytes": n.MM_CACHE_CAPACITY,
    "entries": n.MM_CACHE_ENTRIES,
}
_CACHE_COUNTERS = {"evictions": n.MM_CACHE_EVICTIONS, "too_large": n.MM_CACHE_TOO_LARGE}
_CACHE_BY_MODALITY = {"hits": n.MM_CACHE_HITS, "misses": n.MM_CACHE_MISSES}


@dataclass
class Deltas:
    """The cumulative values already exported, per (metric, labels)."""

    seen: dict[tuple[str, Labels], float] = field(default_factory=dict)
    gauges: set[tuple[str, Labels]] = field(default_factory=set)
    """The cache gauges set by the last plan: one no longer reported (its engine left) is set
    to 0 once."""

    parts: dict[tuple[str, Labels], tuple[tuple[str, Labels], ...]] = field(default_factory=dict)
    """The entries of ``seen`` behind one summed series (one per engine), by that series."""

    engines: set[tuple[str, Labels]] = field(default_factory=set)
    """The per-engine liveness gauges (last answer's age, seconds without progress) set by
    the last sync: one no longer reported (its engine left, or the heartbeat stopped) reads
    NaN from then on, as an engine whose check is off does, not its last figure for the
    server's life."""

    def vanished(self, metric: str, now: set[tuple[str, Labels]]) -> list[Update]:
        """The NaN updates of ``metric``'s engine gauges no longer reported, ``now`` those
        that are (kept for the next sync)."""
        before = {key for key in self.engines if key[0] == metric}
        self.engines = (self.engines - before) | now
        return [(m, labels, "set", math.nan) for m, labels in sorted(before - now)]

    def entries_of(self, metric: str, labels: Labels) -> tuple[tuple[str, Labels], ...]:
        """The entries of ``seen`` one update of ``(metric, labels)`` moved."""
        return self.parts.get((metric, labels), ((metric, labels),))

    def increase(self, metric: str, labels: Labels, value: float) -> float:
        key = (metric, labels)
        before = self.seen.get(key, 0.0)
        self.seen[key] = value
        if value >= before:
            return value - before
        return value  # the source restarted (a new EngineCore, or the plugin re-installed)


_ENGINE_KEY = "\0engine"
"""The label of the per-engine entries in ``Deltas`` (never exported)."""


def _num(counts: Mapping[str, Any], key: str) -> float:
    value = counts.get(key, 0)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def plan(
    deltas: Deltas,
    local: Mapping[str, Any],
    engines: Iterable[Mapping[str, Any]] | None,
    ages: Mapping[str, float] | None = None,
    declarations: Sequence[Declaration] | None = None,
) -> list[Update]:
    """The updates that bring the metrics to ``local`` (this API server's counts),
    ``engines`` (EngineCore's counts, one mapping per engine; None when this API server does
    not export them) and ``ages`` (seconds since each engine last answered, by name).
    Each declared count feeds its metric's series (``declarations``: every fix's by default)."""
    updates: list[Update] = []
    table = n.all_counts(declarations)
    gauge_names = {spec.name for spec in n.all_metrics(declarations) if spec.kind == "gauge"}

    def counter(metric: str, labels: Labels, value: float) -> None:
        # An increase of 0 still creates the series, so /metrics shows it at 0.
        updates.append((metric, labels, "inc", deltas.increase(metric, labels, value)))

    def export(count: Count, labels: Labels, value: float) -> None:
        if count.metric in gauge_names:
            updates.append((count.metric, labels, "set", value))
        else:
            counter(count.metric, labels, value)

    for count in table:
        if count.process_label:
            labels = ((count.process_label, n.KIND_API_SERVER), *count.labels)
        else:
            labels = count.labels
        export(count, labels, _num(local, count.key))
    engines = list(engines) if engines is not None else None
    names = engine_labels(engines or ())
    if engines is not None:
        for count in table:
            if not count.process_label:
                continue
            labels = ((count.process_label, n.KIND_ENGINE_CORE), *count.labels)
            if count.metric in gauge_names:
                updates.append(
                    (count.metric, labels, "set", sum(_num(e, count.key) for e in engines))
                )
                continue
            # One series for all engines, fed by each engine's own increase: an engine that
            # leaves takes nothing back (a drop in the sum would read as a counter reset, and
            # increase() over it as a jump), one that restarts counts again from 0.
            parts = tuple((count.metric, (*labels, (_ENGINE_KEY, name))) for name in names)
            rise = sum(
                deltas.increase(*part, _num(e, count.key)) for part, e in zip(parts, engines)
            )
            deltas.parts[(count.metric, labels)] = parts
            updates.append((count.metric, labels, "inc", rise))
    answered: set[tuple[str, Labels]] = set()
    for engine, age in sorted((ages or {}).items()):
        answered.add((n.ENGINE_LAST_ANSWER_AGE, (("engine", engine),)))
        updates.append((n.ENGINE_LAST_ANSWER_AGE, (("engine", engine),), "set", float(age)))
    updates += deltas.vanished(n.ENGINE_LAST_ANSWER_AGE, answered)
    gauges: set[tuple[str, Labels]] = set()
    _cache_updates(local, "", counter, updates, gauges)
    for counts, name in zip(engines or (), names):
        _cache_updates(counts, name, counter, updates, gauges)
    for metric, labels in sorted(deltas.gauges - gauges):
        updates.append((metric, labels, "set", 0.0))
    deltas.gauges = gauges
    return updates


def engine_labels(engines: Sequence[Mapping[str, Any]]) -> list[str]:
    """Each engine's ``engine`` label: its process name as it reports it (vLLM's
    ``EngineCore``/``EngineCore_DP<N>``, the names of the engine's other series), else the
    name the heartbeat gives it. Never the same for two engines (processes that share a
    name, as Ray actors may, take the heartbeat's names): two engines in one slot would
    read each other's counts as resets, and their counters would climb at every sync."""
    reported = [_reported_name(counts) for counts in engines]
    heartbeat = [_heartbeat_name(counts, i, len(engines)) for i, counts in enumerate(engines)]
    names = [mine or theirs for mine, theirs in zip(reported, heartbeat)]
    if len(set(names)) < len(names):
        names = heartbeat
    if len(set(names)) < len(names):
        names = [f"{name}#{index}" for index, name in enumerate(names)]
    return names


def _reported_name(counts: Mapping[str, Any]) -> str | None:
    for key in counts:
        if isinstance(key, str) and key.startswith(cache_stats.KEY_PROCESS):
            return key[len(cache_stats.KEY_PROCESS) :]
    return None


def _heartbeat_name(counts: Mapping[str, Any], index: int, count: int) -> str:
    name = counts.get(ENGINE_NAME_KEY)
    if isinstance(name, str) and name:
        return name
    return "EngineCore" if count == 1 else f"EngineCore_DP{index}"


def _cache_updates(
    counts: Mapping[str, Any],
    engine: str,
    counter: Callable[[str, Labels, float], None],
    updates: list[Update],
    gauges: set[tuple[str, Labels]],
) -> None:
    """The multimodal cache series of one process's counts (``mmcache|role|field[|modality]``)."""
    for key in sorted(k for k in counts if isinstance(k, str)):
        if not key.startswith(cache_stats.KEY_PREFIX) or key.startswith(cache_stats.KEY_PROCESS):
            continue
        parts = key.split("|")
        if len(parts) < 3:
            continue
        labels: Labels = (("role", parts[1]), ("engine", engine))
        value = _num(counts, key)
        if len(parts) == 3 and parts[2] in _CACHE_GAUGES:
            metric = _CACHE_GAUGES[parts[2]]
            updates.append((metric, labels, "set", value))
            gauges.add((metric, labels))
        elif len(parts) == 3 and parts[2] in _CACHE_COUNTERS:
            counter(_CACHE_COUNTERS[parts[2]], labels, value)
        elif len(parts) == 4 and parts[2] in _CACHE_BY_MODALITY:
            counter(_CACHE_BY_MODALITY[parts[2]], (*labels, ("modality", parts[3])), value)


class Exporter:
    """The prometheus_client side; everything here runs in a serving API server only."""

    def __init__(
        self,
        local: Callable[[], Mapping[str, Any]],
        engines: Callable[[], list[Mapping[str, Any]] | None],
        on_error: Callable[[BaseException], None],
        ages: Callable[[], Mapping[str, float] | None] = lambda: None,
        declarations: Sequence[Declaration] | None = None,
        progress: Callable[[], list[Mapping[str, Any]] | None] = lambda: None,
    ) -> None:
        self.local = local
        self.declarations = declarations
        """The fixes whose counts and metrics are exported (None: every fix of ``plugin``)."""
        self.aliases: dict[str, str] = {}
        """Metric -> its deprecated former name, exported with the same value."""
        self.engines = engines
        self.ages = ages
        self.progress = progress
        """Per-engine liveness figures (``metrics.liveness``), or None."""
        self.on_error = on_error
        """Called once, with the last error, when the exporter gives up."""
        self.failed_syncs = 0
        self.failures_in_a_row = 0
        self.last_failure: str | None = None
        self.deltas = Deltas()
        self.metrics: dict[str, Any] = {}
        self.started = False
        self.multiprocess = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- set-up --------------------------------------------------------------------

    def start(self) -> None:
        """Create the metrics and the sync thread; idempotent."""
        with self._lock:
            if self.started:
                return
            self._create()
            self.started = True
            self._stop.clear()
            self._thread = threading.Thread(
                target=self._run, name="mmcache-fix-metrics", daemon=True
            )
            self._thread.start()
        self.sync()

    def _create(self) -> None:
        import os

        import prometheus_client as prom

        self.multiprocess = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
        made: dict[str, Any] = {}
        for spec in n.all_metrics(self.declarations):
            names = [(spec.name, spec.help)]
            if spec.deprecated_alias:
                help_text = n.alias_help(spec)
                names.append((spec.deprecated_alias, help_text))
                self.aliases[spec.name] = spec.deprecated_alias
            for name, help_text in names:
                if spec.kind == "counter":
                    made[name] = prom.Counter(name, help_text, list(spec.labels))
                elif spec.kind == "gauge":
                    mode: Any = spec.multiprocess_mode
                    made[name] = prom.Gauge(
                        name, help_text, list(spec.labels), multiprocess_mode=mode
                    )
                else:
                    made[name] = prom.Histogram(
                        name, help_text, list(spec.labels), buckets=n.ROUND_TRIP_BUCKETS
                    )
        # -- engine liveness metrics (metrics.liveness: one block, moves as one) --
        for spec in liveness_metrics.SPECS:
            if spec.kind == "histogram":
                made[spec.name] = prom.Histogram(
                    spec.name,
                    spec.help,
                    list(spec.labels),
                    buckets=liveness_metrics.BUCKETS[spec.name],
                )
            elif spec.kind == "counter":
                made[spec.name] = prom.Counter(spec.name, spec.help, list(spec.labels))
            else:
                made[spec.name] = prom.Gauge(
                    spec.name,
                    spec.help,
                    list(spec.labels),
                    multiprocess_mode=spec.multiprocess_mode,  # type: ignore[arg-type]
                )
        # -- end of the engine liveness metrics --
        self.metrics = made
        from .. import __version__
        from ..core.process import vllm_version

        made[n.BUILD_INFO].labels(version=__version__, vllm_version=vllm_version()).set(1)

    def stop(self) -> None:
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=2.0)

    def unregister(self) -> None:
        """Take the metrics out of prometheus_client's default registry (tests, uninstall)."""
        self.stop()
        with self._lock:
            if not self.metrics:
                self.started = False
                return
            try:
                import prometheus_client as prom

                for metric in self.metrics.values():
                    try:
                        prom.REGISTRY.unregister(metric)
                    except KeyError:
                        pass
            finally:
                self.metrics = {}
                self.deltas = Deltas()
                self.started = False

    # -- updates -------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.wait(SYNC_INTERVAL_S):
            self.sync()

    def sync(self) -> None:
        """One sync; never raises. A failure is retried at the next interval (a counter's
        increase is kept as exported only once applied); a long run of them stops the
        exporter."""
        try:
            with self._lock:
                if not self.started or self._stop.is_set():
                    return  # not started, or stopped (given up, switched off): no more syncs
                local, engines, ages = self.local(), self.engines(), self.ages()
                before = self.deltas
                planned = Deltas(dict(before.seen), set(before.gauges), engines=set(before.engines))
                updates = plan(planned, local, engines, ages, self.declarations)
                for metric, labels, op, amount in updates:
                    for child in self._children(metric, labels):
                        if op == "inc":
                            child.inc(amount)
                        else:
                            child.set(amount)
                    if op == "inc":
                        for key in planned.entries_of(metric, labels):
                            self.deltas.seen[key] = planned.seen[key]
                self.deltas.gauges = planned.gauges
                self._sync_liveness(planned)
                self.deltas.engines = planned.engines
                self.failures_in_a_row = 0
        except Exception as exc:
            self._failed(exc)

    def _sync_liveness(self, planned: Deltas) -> None:
        """The engine liveness metrics (``metrics.liveness``); under the sync's lock."""
        updates, histograms = liveness_metrics.plan(planned.increase, self.progress())
        stalled = liveness_metrics.STALLED_SECONDS
        updates += planned.vanished(stalled, {(m, lb) for m, lb, _, _ in updates if m == stalled})
        for metric, labels, op, amount in updates:
            child = self._child(metric, labels)
            if op == "inc":
                child.inc(amount)
            else:
                child.set(amount)
        for labels, per_bucket, total in histograms:
            child = self._child(liveness_metrics.STEP_SECONDS, labels)
            liveness_metrics.add_to_histogram(child, per_bucket, total)
        self.deltas.seen = planned.seen

    def _failed(self, exc: BaseException) -> None:
        self.failed_syncs += 1
        self.failures_in_a_row += 1
        self.last_failure = repr(exc)
        if self.failures_in_a_row >= MAX_FAILED_SYNCS:
            self._stop.set()
            self.on_error(exc)

    def _child(self, metric: str, labels: Labels) -> Any:
        obj = self.metrics[metric]
        return obj.labels(**dict(labels)) if labels else obj

    def _children(self, metric: str, labels: Labels) -> list[Any]:
        """The series of ``metric`` with ``labels``, and of its deprecated alias if any."""
        children = []
        for name in (metric, self.aliases.get(metric)):
            if name is not None:
                obj = self.metrics[name]
                children.append(obj.labels(**dict(labels)) if labels else obj)
        return children

    def observe_round_trip(self, engine: str, seconds: float) -> None:
        if self.started:
            self.metrics[n.ROUND_TRIP_SECONDS].observe(seconds)
            # The engine's stuck-check counter exists from its first answer on, at 0: a labelled
            # series nobody touched is missing from /metrics with PROMETHEUS_MULTIPROC_DIR.
            self._children(n.STUCK_HEALTH_CHECKS, (("engine", engine),))

    def health_check_failed(self, engine: str) -> None:
        """A ``/health`` check failed because ``engine`` was stuck."""
        if self.started:
            for child in self._children(n.STUCK_HEALTH_CHECKS, (("engine", engine),)):
                child.inc()
