"""What the drift guard owns: its patches, its counts and metrics, its setting, its "active"
line. Its counts are the API server's only (EngineCore has no sender cache)."""

from __future__ import annotations

import sys

from ..core import messages
from ..core.declaration import Count, Declaration, MetricSpec
from ..core.settings import (
    DEFAULT_DRIFT,
    ENV_DRIFT,
    SettingSpec,
    choice_reader,
    read_drift_mode,
)
from ..vllm_layout import DRIFT_TARGETS

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
        stats = getattr(sys.modules.get(f"{_PACKAGE}.stats"), "STATS", None)
        return 0 if stats is None else int(stats.as_dict()[key])

    return Count(key, read, metric, process_label="")


DECLARATION = Declaration(
    fix_id=FIX_ID,
    build=_build,
    patch_ids=tuple(patch_id(target.name) for target in DRIFT_TARGETS),
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
            DEFAULT_DRIFT.value,
            "on | recover | off",
            "the API server's sender-cache guard: undo rejected requests and recover, "
            "recover only, or off",
            choice_reader(read_drift_mode),
        ),
    ),
    active=messages.DRIFT_GUARD_ACTIVE,
)
