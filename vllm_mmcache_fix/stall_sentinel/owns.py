"""What the stall sentinel owns: its counts by cause, its metric, its setting, its "active"
line (it patches nothing)."""

from __future__ import annotations

import sys

from ..core import messages
from ..core.declaration import Count, Declaration, MetricSpec
from ..core.settings import (
    DEFAULT_STALL_SECONDS,
    ENV_STALL_SECONDS,
    read_stall_seconds,
)
from ..core.settings_table import SettingSpec, reading_of

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ..core.declaration import Root
    from ..core.lifecycle import Fix

FIX_ID = "stall-sentinel"
STALLS = "mmcache_fix_stalls_total"
CAUSE_CACHE_EVICTION = "cache_eviction"
CAUSE_BUSY = "busy"

_COUNTERS = f"{__name__.split('.')[0]}.core.counters"


def _build(root: Root) -> Fix:
    from .fix import StallSentinelFix

    return StallSentinelFix()


def _stalls(cause: str) -> Count:
    def read(root: Root) -> int:
        counters = sys.modules.get(_COUNTERS)
        return counters.stalls(cause) if counters is not None else 0

    return Count(f"stalls_{cause}", read, STALLS, (("cause", cause),))


DECLARATION = Declaration(
    fix_id=FIX_ID,
    build=_build,
    counts=(_stalls(CAUSE_CACHE_EVICTION), _stalls(CAUSE_BUSY)),
    metrics=(
        MetricSpec(
            STALLS,
            "counter",
            ("process", "cause"),
            "Stalls seen by the stall sentinel: a thread stuck in one call burning CPU; "
            "cause=cache_eviction inside the multimodal cache's eviction (vllm#43941), "
            "cause=busy anywhere else.",
        ),
    ),
    settings=(
        SettingSpec(
            ENV_STALL_SECONDS,
            f"{DEFAULT_STALL_SECONDS:g}",
            "seconds >= 0",
            "the stall sentinel reports a thread stuck burning a core this long; 0: off",
            reading_of(read_stall_seconds),
        ),
    ),
    active=messages.STALL_SENTINEL_ACTIVE,
)
