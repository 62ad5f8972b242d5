"""Every metric the plugin exports, in one place (README: "Metrics").

No name contains ``vllm``: vLLM's stat logger unregisters collectors whose name starts
with ``vllm:`` (0.23.0: whose name contains ``vllm`` anywhere).
"""

from __future__ import annotations

from dataclasses import dataclass

PREFIX = "mmcache_fix_"

PROTECTED_PROCESSES = "mmcache_fix_protected_processes"
CACHE_REPAIRS = "mmcache_fix_cache_repairs_total"
DRIFT_EVENTS = "mmcache_fix_drift_events_total"
ROLLBACKS = "mmcache_fix_rollbacks_total"
RECOVERIES = "mmcache_fix_recoveries_total"
RECOVERY_FAILURES = "mmcache_fix_recovery_failures_total"
INTERNAL_ERRORS = "mmcache_fix_internal_errors_total"
STALLS = "mmcache_fix_stalls_total"
ROUND_TRIP_SECONDS = "mmcache_fix_engine_round_trip_seconds"
ROUND_TRIPS_FAILED = "mmcache_fix_engine_round_trips_failed_total"
BUILD_INFO = "mmcache_fix_build_info"
"""Always 1; the labels carry the plugin's and vLLM's versions."""
ENGINE_LAST_ANSWER_AGE = "mmcache_fix_engine_last_answer_age_seconds"
"""Seconds since each EngineCore last answered this API server's heartbeat (``engine``)."""

MM_CACHE_BYTES = "mmcache_fix_mm_cache_bytes"
MM_CACHE_CAPACITY = "mmcache_fix_mm_cache_capacity_bytes"
MM_CACHE_ENTRIES = "mmcache_fix_mm_cache_entries"
MM_CACHE_EVICTIONS = "mmcache_fix_mm_cache_evictions_total"
MM_CACHE_TOO_LARGE = "mmcache_fix_mm_cache_too_large_total"
MM_CACHE_HITS = "mmcache_fix_mm_cache_hits_total"
MM_CACHE_MISSES = "mmcache_fix_mm_cache_misses_total"
CACHE_LABELS = ("role", "engine")
"""``role``: sender, receiver, processor_only; ``engine``: EngineCore's name for its caches
(``EngineCore``, ``EngineCore_DP<N>``), empty for the API server's."""

# Label values.
KIND_API_SERVER = "api_server"
KIND_ENGINE_CORE = "engine_core"
REPAIR_GHOST = "ghost_key_dropped"
REPAIR_ORPHAN = "orphan_restored"
CAUSE_CACHE_EVICTION = "cache_eviction"
CAUSE_BUSY = "busy"


@dataclass(frozen=True)
class MetricSpec:
    name: str
    kind: str
    """``counter``, ``gauge`` or ``histogram``."""
    labels: tuple[str, ...]
    help: str
    multiprocess_mode: str = "livesum"
    """How vLLM's multiprocess collector merges a gauge over API servers (``--api-server-count
    > 1``): counters and histograms are always summed."""


METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(
        PROTECTED_PROCESSES,
        "gauge",
        ("kind",),
        "Processes whose multimodal LRU caches have the plugin's eviction fix, per kind "
        "(api_server, engine_core).",
    ),
    MetricSpec(
        CACHE_REPAIRS,
        "counter",
        ("process", "repair"),
        "Multimodal cache repairs: order-only (ghost) keys dropped, data-only (orphan) keys "
        "restored to the LRU order.",
    ),
    MetricSpec(
        DRIFT_EVENTS,
        "counter",
        (),
        "Requests EngineCore could not serve because the API server's sender cache had "
        "drifted from EngineCore's cache.",
    ),
    MetricSpec(
        ROLLBACKS,
        "counter",
        (),
        "Requests rejected after processing whose sender-cache changes were undone.",
    ),
    MetricSpec(RECOVERIES, "counter", (), "Drifted requests re-sent with their data and served."),
    MetricSpec(RECOVERY_FAILURES, "counter", (), "Drifted requests whose re-send failed as well."),
    MetricSpec(
        INTERNAL_ERRORS,
        "counter",
        ("process",),
        "Errors in the plugin's own code (the part concerned was switched off, vLLM went on).",
    ),
    MetricSpec(
        STALLS,
        "counter",
        ("process", "cause"),
        "Stalls seen by the stall sentinel: a thread stuck in one call burning CPU; "
        "cause=cache_eviction inside the multimodal cache's eviction (vllm#43941), "
        "cause=busy anywhere else.",
    ),
    MetricSpec(
        ROUND_TRIP_SECONDS,
        "histogram",
        (),
        "Seconds of each heartbeat round trip to EngineCore (answered by its input thread).",
    ),
    MetricSpec(
        ROUND_TRIPS_FAILED,
        "counter",
        ("engine",),
        "/health checks that failed because an EngineCore was stuck (its input thread silent, "
        "or its busy loop inside one step, for MMCACHE_FIX_HEALTH_TIMEOUT seconds).",
    ),
    MetricSpec(
        ENGINE_LAST_ANSWER_AGE,
        "gauge",
        ("engine",),
        "Seconds since the EngineCore last answered the heartbeat (about 2 s when healthy; "
        "NaN where the check is off for it); the freshest over API servers.",
        multiprocess_mode="livemin",
    ),
    MetricSpec(
        MM_CACHE_BYTES,
        "gauge",
        CACHE_LABELS,
        "Bytes the multimodal processor caches hold (cachetools' currsize: vLLM's own size of "
        "each item), per role and engine.",
    ),
    MetricSpec(
        MM_CACHE_CAPACITY,
        "gauge",
        CACHE_LABELS,
        "Capacity in bytes of the multimodal processor caches (--mm-processor-cache-gb).",
    ),
    MetricSpec(
        MM_CACHE_ENTRIES, "gauge", CACHE_LABELS, "Items held by the multimodal processor caches."
    ),
    MetricSpec(
        MM_CACHE_EVICTIONS,
        "counter",
        CACHE_LABELS,
        "Items evicted from the multimodal processor caches to make room (a reset not counted).",
    ),
    MetricSpec(
        MM_CACHE_TOO_LARGE,
        "counter",
        CACHE_LABELS,
        "Items larger than the whole multimodal processor cache: served uncached (0.29+) or "
        "failed (older releases).",
    ),
    MetricSpec(
        MM_CACHE_HITS,
        "counter",
        (*CACHE_LABELS, "modality"),
        "Multimodal processor cache lookups that found the item, per modality.",
    ),
    MetricSpec(
        MM_CACHE_MISSES,
        "counter",
        (*CACHE_LABELS, "modality"),
        "Multimodal processor cache lookups that missed (the item was then processed and "
        "inserted), per modality.",
    ),
    MetricSpec(
        BUILD_INFO,
        "gauge",
        ("version", "vllm_version"),
        "Always 1: the vllm-mmcache-fix and vLLM versions this API server runs.",
        multiprocess_mode="livemax",
    ),
)

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
