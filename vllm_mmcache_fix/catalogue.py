"""What this package patches, why, and when each patch can go.

One row per patch, as data: what it patches, in which process it acts, why,
the upstream threads, and when it can be removed. ``tests/unit/test_catalogue.py``
keeps the rows, the code (``plugin.FIXES``, ``vllm_layout``) and the files
under ``patches/`` in step.
"""

from __future__ import annotations

from dataclasses import dataclass

NEWEST_SOURCES_CHECKED = "0.34.0"
"""The newest vLLM release whose released files the realsrc tier checks: every fix on its
real ``LRUCache``, every layout lookup, the source patch, the drift guard on its own cache
classes and ``_merge_mm_kwargs`` (``tests/unit/test_catalogue.py``: the newest release in
``harness/sources.py``)."""

NEWEST_SERVER_CHECKED = "0.32.0"
"""The newest vLLM release with a passing real-server row in ``compat/matrix.json``
(the incident without and with the plugin, drift, concurrent clients)."""


def _release_key(version: str) -> tuple[int, ...]:
    """``0.34.0`` -> (0, 34, 0); ``0.23.0+empty``, ``0.35.0rc1``, ``0.24.0.dev5+g1`` keep
    their leading numbers."""
    parts: list[int] = []
    for part in version.split("+")[0].split("."):
        digits = ""
        for char in part:
            if not char.isdigit():
                break
            digits += char
        if not digits:
            break
        parts.append(int(digits))
        if len(digits) != len(part):
            break
    return tuple(parts)


def release_coverage(version: str | None) -> str:
    """What this version of the package has proven about vLLM ``version``, in one line."""
    if not version:
        return (
            f"sources checked up to vLLM {NEWEST_SOURCES_CHECKED}, real servers up to "
            f"{NEWEST_SERVER_CHECKED}"
        )
    key = _release_key(version)
    if key and key <= _release_key(NEWEST_SERVER_CHECKED):
        return f"vLLM {version}: released sources and a real server checked"
    if key and key <= _release_key(NEWEST_SOURCES_CHECKED):
        return (
            f"vLLM {version}: released sources checked (real servers up to {NEWEST_SERVER_CHECKED})"
        )
    return (
        f"vLLM {version} is newer than the newest release checked "
        f"({NEWEST_SOURCES_CHECKED}): the plugin finds what it patches by feature "
        "detection and switches off any piece it cannot find; this check's own trials "
        "(layout, the eviction probe and the patched cache) ran on it, nothing else did"
    )


@dataclass(frozen=True)
class PatchSpec:
    id: str
    fix: str
    """The fix (``plugin.FIXES``) that applies this patch."""
    runs_in: str
    """The processes where the patch acts."""
    targets: tuple[str, ...]
    """Where the patch lands, newest layout first (see locate.py)."""
    why: str
    upstream: tuple[str, ...]
    affected: str
    detection: str
    """How the package decides at run time that the target needs it."""
    removal: str
    """When the patch can be deleted."""
    source_patches: bool
    """Whether ``patches/`` carries the same fix as a source diff."""


CATALOGUE: tuple[PatchSpec, ...] = (
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
    PatchSpec(
        id="mm-drift-sender",
        fix="mm-drift-guard",
        runs_in="API server",
        targets=(
            "vllm.multimodal.cache.lru.LruKeyReplicatedSenderCache",
            "vllm.multimodal.cache.MultiModalProcessorSenderCache",
        ),
        why=(
            "The API server's sender cache is a shadow of EngineCore's receiver cache and "
            "sends data=None for items it believes EngineCore holds. Its changes are "
            "journaled per request so a request rejected after processing can be undone "
            "(membership and LRU order), and keys a request added stay invisible to other "
            "requests until that request reaches EngineCore. One deliberate difference from "
            "vLLM: for a key the guard itself made look uncached, get_and_update_item returns "
            "the caller's data where vLLM returns None, so EngineCore gets it; for every other "
            "key vLLM's result is returned as it is. An internal error in this bookkeeping "
            "switches the guard off for good and leaves vLLM's call and result untouched."
        ),
        upstream=(
            "vllm-project/vllm#43941 (400 then 500 for the same image)",
            "vllm-project/vllm#46747 (MultiModalCacheMissError, 0.28.0: one 500 instead of many)",
            "vllm-project/vllm#46451, #51897 (P0 rollback, closed unmerged)",
        ),
        affected="every release with the LRU sender cache; the shm sender cache is left alone",
        detection="feature detection of the class and its methods (vllm_layout.DRIFT_TARGETS)",
        removal="when vLLM rolls the sender cache back on rejection and never answers a drift "
        "with an error",
        source_patches=False,
    ),
    PatchSpec(
        id="mm-drift-processor",
        fix="mm-drift-guard",
        runs_in="API server",
        targets=(
            "vllm.multimodal.processing.processor.BaseMultiModalProcessor",
            "vllm.multimodal.processing.BaseMultiModalProcessor",
        ),
        why=(
            "Opens the per-request journal around _merge_mm_kwargs and keeps the inputs of "
            "apply() so a drifted request can be processed again with its data."
        ),
        upstream=("vllm-project/vllm#43941",),
        affected="every release with _merge_mm_kwargs",
        detection="feature detection (vllm_layout.DRIFT_TARGETS)",
        removal="with mm-drift-sender",
        source_patches=False,
    ),
    PatchSpec(
        id="mm-drift-process_inputs",
        fix="mm-drift-guard",
        runs_in="API server",
        targets=(
            "vllm.v1.engine.input_processor.InputProcessor.process_inputs",
            "vllm.v1.engine.processor.Processor.process_inputs",
        ),
        why=(
            "The commit point: a request that becomes an EngineCoreRequest commits its "
            "journal; one that raises here rolls it back."
        ),
        upstream=("vllm-project/vllm#43941",),
        affected="every release with the V1 input processor",
        detection="feature detection (vllm_layout.DRIFT_TARGETS)",
        removal="with mm-drift-sender",
        source_patches=False,
    ),
    PatchSpec(
        id="mm-drift-generate",
        fix="mm-drift-guard",
        runs_in="API server",
        targets=("vllm.v1.engine.async_llm.AsyncLLM.generate",),
        why=(
            "Recovery: when the first output of a request that sent items without data is an "
            "error with no tokens, drop its items from the shadow, process them again and "
            "re-submit once, before anything reaches the client."
        ),
        upstream=("vllm-project/vllm#46747",),
        affected="every release with AsyncLLM",
        detection="feature detection (vllm_layout.DRIFT_TARGETS)",
        removal="when vLLM re-sends drifted items itself",
        source_patches=False,
    ),
    PatchSpec(
        id="engine-liveness-answer",
        fix="engine-liveness-answer",
        runs_in="EngineCore",
        targets=(
            "vllm.v1.engine.core.EngineCore.mmcache_fix_ping",
            "vllm.v1.engine.core.EngineCoreProc._process_input_queue",
            "vllm.v1.engine.core.EngineCoreProc._process_engine_step",
            "vllm.v1.engine.core.EngineCoreProc._handle_client_request",
            "EngineCoreProc.input_queue.put_nowait (each running engine)",
        ),
        why=(
            "vLLM's /health never asks EngineCore, and a utility call waits for the busy loop "
            "(a long step or utility call delays it). The plugin adds a utility method and, "
            "when an EngineCoreProc's busy loop starts (in any process model: spawned, forked, "
            "DP, Ray actors; the class patches are installed in every process), makes its "
            "input thread answer that method at once through vLLM's own dispatch, with the "
            "busy loop's state (step, add/abort, utility call, or idle, and since when) and "
            "the process's plugin counters. Only a dead or spinning input thread leaves it "
            "unanswered."
        ),
        upstream=(
            "vllm-project/vllm#36451 (ping EngineCore through its input thread, open)",
            "vllm-project/vllm-ascend#14240 (the same for Ascend, open)",
        ),
        affected="every release: /health stays 200 while EngineCore spins (up to 0.34.0)",
        detection=(
            "the classes vllm_layout.ENGINE_CORE_CLASS and ENGINE_PROC_CLASS with the busy "
            "loop's methods; acts at the first _process_input_queue of each engine"
        ),
        removal="when vLLM's /health asks EngineCore itself",
        source_patches=False,
    ),
    PatchSpec(
        id="engine-liveness-health",
        fix="engine-liveness-health",
        runs_in="API server",
        targets=(
            "vllm.v1.engine.async_llm.AsyncLLM.__init__",
            "vllm.v1.engine.async_llm.AsyncLLM.check_health",
        ),
        why=(
            "AsyncLLM.check_health, which /health awaits, raises only once EngineCore has died. "
            "A heartbeat (an asyncio task per engine client, started with AsyncLLM) pings "
            "every EngineCore every 2 s, at most two pings in flight; check_health runs vLLM's "
            "check, then reads the heartbeat's verdict without waiting and raises an "
            "EngineDeadError subclass (503) only for a stuck engine: two pings unanswered, the "
            "older one for MMCACHE_FIX_HEALTH_TIMEOUT seconds, or an answer saying the busy "
            "loop has been inside one step (or add/abort) that long. A utility call is healthy "
            "however long it runs."
        ),
        upstream=("vllm-project/vllm#36451 (open)", "vllm-project/vllm#43941 (the freeze)"),
        affected="every release with AsyncLLM",
        detection=(
            "feature detection (vllm_layout.HEALTH_TARGET; ASYNC_CLIENT_CLASS's "
            "_call_utility_async must take engine=)"
        ),
        removal="when vLLM's /health asks EngineCore itself",
        source_patches=False,
    ),
    PatchSpec(
        id="plugin-metrics",
        fix="plugin-metrics",
        runs_in="API server",
        targets=(
            "prometheus_client default registry / PROMETHEUS_MULTIPROC_DIR "
            "(served by vllm.entrypoints.serve.instrumentator.metrics)",
        ),
        why=(
            "The plugin's counters (repairs, drift, rollbacks, recoveries, internal errors, "
            "stalls by cause, the heartbeat's round trips and each engine's last-answer age) "
            "as mmcache_fix_* metrics on vLLM's own /metrics; EngineCore's counters arrive "
            "with every heartbeat answer; nothing of vLLM is patched."
        ),
        upstream=("vllm-project/vllm#57118 (drift counter, closed unmerged)",),
        affected="every release that serves /metrics with prometheus_client",
        detection=(
            "the import of vllm_layout.METRICS_ROUTE_MODULES, or the heartbeat's start "
            "(signals.API_SERVER_SERVING)"
        ),
        removal="never needed by vLLM; remove with the fixes whose counters it exports",
        source_patches=False,
    ),
)


def by_id(patch_id: str) -> PatchSpec:
    for spec in CATALOGUE:
        if spec.id == patch_id:
            return spec
    raise KeyError(patch_id)
