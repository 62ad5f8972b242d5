"""What the metrics fix owns: the build-info gauge and the exporter, fed by every fix's
declared counts and metrics (it patches nothing of vLLM)."""

from __future__ import annotations

from ..core.declaration import Declaration, MetricSpec

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

    return PluginMetrics(root.counts, engines, ages, declarations)


DECLARATION = Declaration(
    fix_id=FIX_ID,
    build=_build,
    patch_ids=(FIX_ID,),
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
