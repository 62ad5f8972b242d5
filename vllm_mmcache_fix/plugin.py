"""Composition root: the ``vllm.general_plugins`` entry point installs each fix.

vLLM calls :func:`register` in the API server, in EngineCore and in every
worker, possibly several times, with no try/except around it: it must never
raise and must stay cheap. Each fix decides for itself whether it applies in
this process (the drift guard only acts where vLLM builds a sender cache, that
is in the API server).

This module imports the fixes and the shared core only; the operator tools
(``tools/``) are never imported from here.
"""

from __future__ import annotations

from typing import Any

from .core import counters, imports, log, registry
from .core.lifecycle import STATUS_SCHEMA, Fix
from .core.process import process_label, vllm_version
from .drift_guard import GUARD as DRIFT_GUARD
from .drift_guard.stats import STATS as DRIFT_STATS
from .engine_liveness.answer import EngineLivenessAnswer
from .engine_liveness.health import EngineHealth
from .lru_eviction import cache as lru_cache
from .lru_eviction import stats as cache_stats
from .lru_eviction.fix import LruEvictionFix
from .metrics.fix import PluginMetrics
from .stall_sentinel.fix import StallSentinelFix

LRU_EVICTION = LruEvictionFix()
ENGINE_ANSWER = EngineLivenessAnswer(lambda: counts())
ENGINE_HEALTH = EngineHealth()
METRICS = PluginMetrics(
    lambda: counts(),
    lambda: ENGINE_HEALTH.liveness.engine_counts() if ENGINE_HEALTH.liveness else None,
    lambda: ENGINE_HEALTH.liveness.ages() if ENGINE_HEALTH.liveness else None,
)
STALL_SENTINEL = StallSentinelFix()

FIXES: tuple[Fix, ...] = (
    LRU_EVICTION,
    DRIFT_GUARD,
    ENGINE_ANSWER,
    ENGINE_HEALTH,
    METRICS,
    STALL_SENTINEL,
)
"""Installed in this order; each decides for itself whether it acts in this process."""


def register() -> None:
    """Entry point for vLLM's plugin loader: never raises."""
    try:
        instrument()
    except Exception as exc:
        try:
            log.warning("internal error, vLLM left as it is: %r", exc)
        except Exception:
            pass


def instrument() -> dict[str, Any]:
    """Install every fix that applies in this process; idempotent. Returns :func:`status`."""
    for fix in FIXES:
        fix.install()
    return status()


def uninstrument() -> None:
    """Undo everything :func:`instrument` did in this process."""
    for fix in reversed(FIXES):
        fix.uninstall()
    imports.cancel_all()
    registry.revert_all()
    counters.reset()
    cache_stats.reset()


def counts() -> dict[str, int]:
    """This process's counters as plain numbers: what ``/metrics`` exports (and what
    EngineCore sends with each answer to the heartbeat)."""
    repairs = lru_cache.STATS.as_dict()
    drift = DRIFT_STATS.as_dict()
    return {
        "protected": int(LRU_EVICTION.installed),
        "ghost_keys_dropped": repairs["ghost_keys_dropped"],
        "orphans_restored": repairs["orphans_restored"],
        "drift_events": drift["drift_events"],
        "rollbacks": drift["rollbacks"],
        "recoveries": drift["recoveries"],
        "recovery_failures": drift["recovery_failures"],
        "internal_errors": sum(fix.errors.total for fix in FIXES),
        "stalls_cache_eviction": counters.stalls(counters.STALL_CACHE_EVICTION),
        "stalls_busy": counters.stalls(counters.STALL_BUSY),
        # Each multimodal cache's figures, as flat "mmcache|<role>|<field>..." keys.
        **cache_stats.flat_counts(),
    }


def status() -> dict[str, Any]:
    """What this process has applied, as plain data (a copy; ``schema_version`` first)."""
    lru = LRU_EVICTION.status()
    return {
        "schema_version": STATUS_SCHEMA,
        "process": process_label(),
        "vllm_version": vllm_version(),
        # The eviction fix's fields at the top level, as the log line and check read them.
        "mode": lru["mode"],
        "attempted": lru["attempted"],
        "installed": lru["installed"],
        "waiting_for_import": lru["waiting_for_import"],
        "target": lru["target"],
        "layout": lru["layout"],
        "not_applied_reason": lru["not_enabled_reason"],
        "exposure": lru["exposure"],
        "caches_built": lru["caches_built"],
        "caches_fixed": lru["caches_fixed"],
        "repairs": lru["repairs"],
        "problems": lru["problems"],
        "drift": DRIFT_GUARD.status(),
        "stall_sentinel": STALL_SENTINEL.status(),
        "fixes": {fix.id: fix.status() for fix in FIXES},
        "internal_errors": sum(fix.errors.total for fix in FIXES),
        "patches": [{"id": a.patch_id, "target": a.target} for a in registry.applied()],
        "instance_patches": [
            {"id": pid, "target": what} for pid, what in registry.instance_changes()
        ],
    }
