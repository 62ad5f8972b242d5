"""What the two engine liveness fixes own: the answer's patch and "active" line (EngineCore),
the health check's patch, metrics, settings and "active" line (API server), and the EngineCore
counts that arrive with each answer."""

from __future__ import annotations

from ..core import messages
from ..core.declaration import Declaration, MetricSpec
from ..core.settings import (
    DEFAULT_HEALTH_TIMEOUT,
    DEFAULT_PROGRESS_TIMEOUT,
    DEFAULT_STEP_TIMEOUT,
    ENV_HEALTH_TIMEOUT,
    ENV_PROGRESS_TIMEOUT,
    ENV_STEP_TIMEOUT,
    MIN_HEALTH_TIMEOUT,
    VLLM_STEP_TIMEOUT,
    SettingSpec,
    float_reader,
    read_health_timeout,
    read_progress_timeout,
    read_step_timeout,
)

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping
    from typing import Any

    from ..core.declaration import Root
    from ..core.lifecycle import Fix

ANSWER_ID = "engine-liveness-answer"
HEALTH_ID = "engine-liveness-health"

ROUND_TRIP_SECONDS = "mmcache_fix_engine_round_trip_seconds"
STUCK_HEALTH_CHECKS = "mmcache_fix_engine_stuck_health_checks_total"
DEPRECATED_ROUND_TRIPS_FAILED = "mmcache_fix_engine_round_trips_failed_total"
"""The name :data:`STUCK_HEALTH_CHECKS` had up to 0.x (it never counted round trips): still
exported, with the same value, for one release (CHANGELOG)."""
ENGINE_LAST_ANSWER_AGE = "mmcache_fix_engine_last_answer_age_seconds"
"""Seconds since each EngineCore last answered this API server's heartbeat (``engine``)."""


def _build_answer(root: Root) -> Fix:
    from .answer import EngineLivenessAnswer

    # EngineCore's counts travel as the payload of each answer.
    return EngineLivenessAnswer(root.counts)


def _build_health(root: Root) -> Fix:
    from .health import EngineHealth

    return EngineHealth()


def _liveness(root: Root) -> Any:
    return getattr(root.built(HEALTH_ID), "liveness", None)


def _engine_counts(root: Root) -> list[Mapping[str, Any]] | None:
    liveness = _liveness(root)
    return liveness.engine_counts() if liveness is not None else None


def _engine_ages(root: Root) -> Mapping[str, float] | None:
    liveness = _liveness(root)
    return liveness.ages() if liveness is not None else None


ANSWER = Declaration(
    fix_id=ANSWER_ID,
    build=_build_answer,
    patch_ids=(ANSWER_ID,),
    active=messages.ANSWER_ACTIVE,
)

HEALTH = Declaration(
    fix_id=HEALTH_ID,
    build=_build_health,
    patch_ids=(HEALTH_ID,),
    metrics=(
        MetricSpec(
            ROUND_TRIP_SECONDS,
            "histogram",
            (),
            "Seconds of each heartbeat round trip to EngineCore (answered by its input thread).",
        ),
        MetricSpec(
            STUCK_HEALTH_CHECKS,
            "counter",
            ("engine",),
            "/health checks that failed because an EngineCore was stuck (its input thread "
            "silent, or its busy loop inside one step, for MMCACHE_FIX_HEALTH_TIMEOUT seconds).",
            deprecated_alias=DEPRECATED_ROUND_TRIPS_FAILED,
        ),
        MetricSpec(
            ENGINE_LAST_ANSWER_AGE,
            "gauge",
            ("engine",),
            "Seconds since the EngineCore last answered the heartbeat (about 2 s when healthy; "
            "NaN where the check is off for it); the freshest over API servers.",
            multiprocess_mode="livemin",
        ),
    ),
    settings=(
        SettingSpec(
            ENV_HEALTH_TIMEOUT,
            f"{DEFAULT_HEALTH_TIMEOUT:g}",
            "seconds >= 0",
            "/health fails when an EngineCore has not answered for this long; 0: off",
            float_reader(read_health_timeout),
        ),
        SettingSpec(
            ENV_STEP_TIMEOUT,
            f"{DEFAULT_STEP_TIMEOUT:g}",
            f"seconds >= {MIN_HEALTH_TIMEOUT:g}",
            f"/health fails when one EngineCore step has run this long (default: "
            f"{VLLM_STEP_TIMEOUT} or {DEFAULT_STEP_TIMEOUT:g})",
            float_reader(read_step_timeout),
        ),
        SettingSpec(
            ENV_PROGRESS_TIMEOUT,
            f"{DEFAULT_PROGRESS_TIMEOUT:g}",
            "seconds 30-600; 0 = off",
            "/health fails when an EngineCore has made no net progress this long while "
            "requests wait",
            float_reader(read_progress_timeout),
        ),
    ),
    active=messages.LIVENESS_ACTIVE,
    engine_counts=_engine_counts,
    engine_ages=_engine_ages,
)
