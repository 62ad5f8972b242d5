"""What the metrics fix owns: the build-info gauge and the exporter, fed by every fix's
declared counts and metrics (it patches nothing of vLLM)."""

from __future__ import annotations

from ..core.declaration import Declaration, MetricSpec, PatchSpec

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping
    from typing import Any

    from ..core.declaration import Root
    from ..core.lifecycle import Fix

FIX_ID = "plugin-metrics"
BUILD_INFO = "mmcache_fix_build_info"
"""Always 1; the labels carry the plugin's and vLLM's versions."""


def _build(root: Root) -> Fix:
    from .fix import PluginMetrics

    declarations = root.declarations()

    def engines() -> list[Mapping[str, Any]] | None:
        for declaration in declarations:
            if declaration.engine_counts is not None:
                return declaration.engine_counts(root)
        return None

    def ages() -> Mapping[str, float] | None:
        for declaration in declarations:
            if declaration.engine_ages is not None:
                return declaration.engine_ages(root)
        return None

    def progress() -> list[Mapping[str, Any]] | None:
        for declaration in declarations:
            if declaration.engine_progress is not None:
                return declaration.engine_progress(root)
        return None

    return PluginMetrics(root.counts, engines, ages, declarations, progress)


DECLARATION = Declaration(
    fix_id=FIX_ID,
    build=_build,
    patches=(
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
    ),
    metrics=(
        MetricSpec(
            BUILD_INFO,
            "gauge",
            ("version", "vllm_version"),
            "Always 1: the vllm-mmcache-fix and vLLM versions this API server runs.",
            multiprocess_mode="livemax",
        ),
    ),
)
