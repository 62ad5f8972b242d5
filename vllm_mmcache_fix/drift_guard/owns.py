"""What the drift guard owns: its patches, its counts and metrics, its setting, its "active"
line. Its counts are the API server's only (EngineCore has no sender cache)."""

from __future__ import annotations

import sys

from ..core import messages
from ..core.declaration import Count, Declaration, MetricSpec, PatchSpec
from ..core.settings import (
    DEFAULT_DRIFT,
    ENV_DRIFT,
    read_drift_mode,
)
from ..core.settings_table import SettingSpec, reading_of

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ..core.declaration import Root
    from ..core.lifecycle import Fix

FIX_ID = "mm-drift-guard"
PATCH_PREFIX = "mm-drift"

DRIFT_EVENTS = "mmcache_fix_drift_events_total"
ROLLBACKS = "mmcache_fix_rollbacks_total"
RECOVERIES = "mmcache_fix_recoveries_total"
RECOVERY_FAILURES = "mmcache_fix_recovery_failures_total"

_PACKAGE = __name__.rpartition(".")[0]


def patch_id(target: str) -> str:
    """The patch id of one of ``vllm_layout.DRIFT_TARGETS`` (``fix.patch_id`` says the same)."""
    return f"{PATCH_PREFIX}-{target}"


def _build(root: Root) -> Fix:
    from . import GUARD

    return GUARD


def _count(key: str, metric: str) -> Count:
    def read(root: Root) -> int:
        guard = getattr(sys.modules.get(_PACKAGE), "GUARD", None)
        stats = getattr(getattr(guard, "state", None), "stats", None)
        return 0 if stats is None else int(stats.get(key))

    return Count(key, read, metric, process_label="")


def _companion(
    patch_id: str,
    targets: tuple[str, ...],
    why: str,
    *,
    affected: str,
    upstream: tuple[str, ...] = ("vllm-project/vllm#43941",),
    removal: str = "with mm-drift-sender",
) -> PatchSpec:
    """A patch that serves the sender cache's (``mm-drift-sender``): found the same way, in the
    same process, never in ``patches/``."""
    return PatchSpec(
        id=patch_id,
        fix=FIX_ID,
        runs_in="API server",
        targets=targets,
        why=why,
        upstream=upstream,
        affected=affected,
        detection="feature detection (vllm_layout.DRIFT_TARGETS)",
        removal=removal,
        source_patches=False,
    )


DECLARATION = Declaration(
    fix_id=FIX_ID,
    build=_build,
    patches=(
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
                "vllm-project/vllm#46747 "
                "(MultiModalCacheMissError, 0.28.0: one 500 instead of many)",
                "vllm-project/vllm#46451, #51897 (P0 rollback, closed unmerged)",
            ),
            affected="every release with the LRU sender cache; the shm sender cache is left alone",
            detection="feature detection of the class and its methods (vllm_layout.DRIFT_TARGETS)",
            removal="when vLLM rolls the sender cache back on rejection and never answers a drift "
            "with an error",
            source_patches=False,
        ),
        _companion(
            "mm-drift-processor",
            (
                "vllm.multimodal.processing.processor.BaseMultiModalProcessor",
                "vllm.multimodal.processing.BaseMultiModalProcessor",
            ),
            "Opens the per-request journal around _merge_mm_kwargs, keeps the inputs of "
            "apply() so a drifted request can be processed again with its data, and tells "
            "the sender cache's lookup (_get_cache_missing_items) which items came without "
            "data (a UUID only): for those vLLM's answer stands.",
            affected="every release with _merge_mm_kwargs",
        ),
        _companion(
            "mm-drift-process_inputs",
            (
                "vllm.v1.engine.input_processor.InputProcessor.process_inputs",
                "vllm.v1.engine.processor.Processor.process_inputs",
            ),
            "The commit point: a request that becomes an EngineCoreRequest commits its "
            "journal; one that raises here rolls it back.",
            affected="every release with the V1 input processor",
        ),
        _companion(
            "mm-drift-generate",
            ("vllm.v1.engine.async_llm.AsyncLLM.generate",),
            "Recovery: when the first output of a request that sent items without data is an "
            "error with no tokens, drop its items from the shadow, process them again and "
            "re-submit once, before anything reaches the client.",
            affected="every release with AsyncLLM",
            upstream=("vllm-project/vllm#46747",),
            removal="when vLLM re-sends drifted items itself",
        ),
    ),
    counts=(
        _count("drift_events", DRIFT_EVENTS),
        _count("rollbacks", ROLLBACKS),
        _count("recoveries", RECOVERIES),
        _count("recovery_failures", RECOVERY_FAILURES),
    ),
    metrics=(
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
        MetricSpec(
            RECOVERIES, "counter", (), "Drifted requests re-sent with their data and served."
        ),
        MetricSpec(
            RECOVERY_FAILURES, "counter", (), "Drifted requests whose re-send failed as well."
        ),
    ),
    settings=(
        SettingSpec(
            ENV_DRIFT,
            DEFAULT_DRIFT,
            "on | recover | off",
            "the API server's sender-cache guard: undo rejected requests and recover, "
            "recover only, or off",
            reading_of(read_drift_mode),
        ),
    ),
    active=messages.DRIFT_GUARD_ACTIVE,
)
