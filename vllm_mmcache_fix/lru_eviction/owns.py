"""What the eviction fix owns: its patch, its counts and metrics, its "active" line."""

from __future__ import annotations

import sys

from ..core import messages
from ..core.declaration import Count, Declaration, MetricSpec, PatchSpec

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ..core.declaration import Root
    from ..core.lifecycle import Fix

FIX_ID = "mm-lru-eviction"
PATCH_FIX = "mm-lru-eviction"

PROTECTED_PROCESSES = "mmcache_fix_protected_processes"
CACHE_REPAIRS = "mmcache_fix_cache_repairs_total"
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
REPAIR_GHOST = "ghost_key_dropped"
REPAIR_ORPHAN = "orphan_restored"
_REPAIR_LABELS = {"ghost_keys_dropped": REPAIR_GHOST, "orphans_restored": REPAIR_ORPHAN}
REPAIR_KINDS = tuple(_REPAIR_LABELS)
"""The repair counts of ``cache.STATS`` (``RepairStats``)."""

_PACKAGE = __name__.rpartition(".")[0]


def _build(root: Root) -> Fix:
    from .fix import LruEvictionFix

    return LruEvictionFix()


def _protected(root: Root) -> int:
    return int(bool(getattr(root.built(FIX_ID), "installed", False)))


def repair_totals() -> dict[str, int]:
    """The repairs of every fixed cache in this process; imports nothing (the cache module
    comes with the first cache vLLM builds, and one not imported has repaired nothing)."""
    stats = getattr(sys.modules.get(f"{_PACKAGE}.cache"), "STATS", None)
    if stats is None:
        return dict.fromkeys(REPAIR_KINDS, 0)
    totals: dict[str, int] = stats.as_dict()
    return totals


def _repairs(key: str) -> Count:
    def read(root: Root) -> int:
        return int(repair_totals()[key])

    return Count(key, read, CACHE_REPAIRS, (("repair", _REPAIR_LABELS[key]),))


def _cache_figures() -> dict[str, int]:
    """Each multimodal cache's figures, as flat ``mmcache|<role>|<field>...`` keys."""
    stats = sys.modules.get(f"{_PACKAGE}.stats")
    figures: dict[str, int] = stats.flat_counts() if stats is not None else {}
    return figures


DECLARATION = Declaration(
    fix_id=FIX_ID,
    build=_build,
    patches=(
        PatchSpec(
            id="mm-lru-eviction",
            fix="mm-lru-eviction",
            runs_in="every process",
            targets=(
                "vllm.multimodal.cache.base.MultiModalCache.get_lru_cache",
                "vllm.multimodal.cache.MultiModalCache.get_lru_cache",
                "vllm.multimodal.processing.ProcessingCache.get_lru_cache",
            ),
            why=(
                "vLLM's LRUCache.popitem picks the oldest key of its order dict and pop() returns "
                "without removing anything when that key has no data, so cachetools' eviction "
                "loop and LRUCache.clear() spin forever on a ghost key; touch() of a missing key "
                "created such keys up to 0.23.x. The caches built by get_lru_cache get touch, "
                "popitem and clear that always make progress."
            ),
            upstream=(
                "vllm-project/vllm#43941 (the freeze)",
                "vllm-project/vllm#43595 (touch ignores missing keys, 0.24.0)",
                "vllm-project/vllm#47958 (freeze after days of traffic, unexplained)",
            ),
            affected=(
                "touch creates ghost keys: 0.10.0-0.23.x; eviction and clear stall on any "
                "ghost key: every release up to 0.34.0"
            ),
            detection=(
                "lru_eviction.probe.probe_touch / probe_popitem on the LRUCache class the "
                "factory module builds"
            ),
            removal=(
                "when every vLLM you run has a popitem that removes an item or raises on an "
                "order-only key (probe_popitem returns False on the plain class)"
            ),
            source_patches=True,
        ),
    ),
    counts=(
        Count("protected", _protected, PROTECTED_PROCESSES, process_label="kind"),
        _repairs("ghost_keys_dropped"),
        _repairs("orphans_restored"),
    ),
    more_counts=_cache_figures,
    metrics=(
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
            MM_CACHE_BYTES,
            "gauge",
            CACHE_LABELS,
            "Bytes the multimodal processor caches hold (cachetools' currsize: vLLM's own size "
            "of each item), per role and engine.",
        ),
        MetricSpec(
            MM_CACHE_CAPACITY,
            "gauge",
            CACHE_LABELS,
            "Capacity in bytes of the multimodal processor caches (--mm-processor-cache-gb).",
        ),
        MetricSpec(
            MM_CACHE_ENTRIES,
            "gauge",
            CACHE_LABELS,
            "Items held by the multimodal processor caches.",
        ),
        MetricSpec(
            MM_CACHE_EVICTIONS,
            "counter",
            CACHE_LABELS,
            "Items evicted from the multimodal processor caches to make room (a reset not "
            "counted).",
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
    ),
    active=messages.ACTIVE,
)
