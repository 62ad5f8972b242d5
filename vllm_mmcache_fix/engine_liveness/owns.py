"""What the two engine liveness fixes own: the answer's patch and "active" line (EngineCore),
the health check's patch, metrics, settings and "active" line (API server), and the EngineCore
counts that arrive with each answer."""

from __future__ import annotations

from ..core import messages
from ..core.declaration import Count, Declaration, MetricSpec, PatchSpec
from ..core.settings import (
    DEFAULT_ABORT_STUCK,
    DEFAULT_HEALTH_TIMEOUT,
    DEFAULT_PROGRESS_TIMEOUT,
    DEFAULT_STEP_TIMEOUT,
    ENV_ABORT_STUCK,
    ENV_HEALTH_TIMEOUT,
    ENV_PROGRESS_TIMEOUT,
    ENV_STEP_TIMEOUT,
    MIN_HEALTH_TIMEOUT,
    VLLM_STEP_TIMEOUT,
    read_abort_stuck,
    read_health_timeout,
    read_progress_timeout,
    read_step_timeout,
)
from ..core.settings_table import SettingSpec, reading_of

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
STUCK_ABORTS = "mmcache_fix_engine_stuck_aborts_total"
"""Requests EngineCore aborted at a zero-token livelock (``MMCACHE_FIX_ABORT_STUCK=on``)."""


def _build_answer(root: Root) -> Fix:
    from .answer import EngineLivenessAnswer

    # EngineCore's counts travel as the payload of each answer.
    return EngineLivenessAnswer(root.counts)


def _build_health(root: Root) -> Fix:
    from .health import EngineHealth

    return EngineHealth()


def _stuck_aborts(root: Root) -> int:
    return int(getattr(root.built(ANSWER_ID), "stuck_aborts", 0) or 0)


def _liveness(root: Root) -> Any:
    return getattr(root.built(HEALTH_ID), "liveness", None)


def _engine_counts(root: Root) -> list[Mapping[str, Any]] | None:
    liveness = _liveness(root)
    return liveness.engine_counts() if liveness is not None else None


def _engine_ages(root: Root) -> Mapping[str, float] | None:
    liveness = _liveness(root)
    return liveness.ages() if liveness is not None else None


def _engine_progress(root: Root) -> list[Mapping[str, Any]] | None:
    liveness = _liveness(root)
    return liveness.progress_figures() if liveness is not None else None


ANSWER = Declaration(
    fix_id=ANSWER_ID,
    build=_build_answer,
    patches=(
        PatchSpec(
            id="engine-liveness-answer",
            fix="engine-liveness-answer",
            runs_in="EngineCore",
            targets=(
                "vllm.v1.engine.core.EngineCore.mmcache_fix_ping",
                "vllm.v1.engine.core.EngineCoreProc._process_input_queue",
                "vllm.v1.engine.core.EngineCoreProc._process_engine_step",
                "vllm.v1.engine.core.EngineCoreProc._handle_client_request",
                "vllm.v1.engine.core.EngineCoreProc._notify_idle_state_callbacks",
                "vllm.config.ParallelConfig.has_unfinished_dp",
                "vllm.config.ParallelConfig.sync_dp_state",
                "vllm.v1.engine.core.EngineCore.execute_dummy_batch",
                "vllm.v1.engine.core.EngineCore.abort_requests",
                "EngineCoreProc.input_queue.put_nowait (each running engine)",
            ),
            why=(
                "vLLM's /health never asks EngineCore, and a utility call waits for the busy loop "
                "(a long step or utility call delays it). The plugin adds a utility method and, "
                "when an EngineCoreProc's busy loop starts (in any process model: spawned, forked, "
                "DP, Ray actors; the class patches are installed in every process), makes its "
                "input thread answer that method at once through vLLM's own dispatch, with the "
                "busy loop's state (step, add/abort, utility call, a DP rank's wait for its "
                "peers, or idle, and since when), its net progress (including a request left in "
                "the input queue while the loop is idle) and the process's plugin counters. Only "
                "a dead or spinning input thread leaves it unanswered."
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
    ),
    counts=(Count("stuck_aborts", _stuck_aborts, STUCK_ABORTS),),
    metrics=(
        MetricSpec(
            STUCK_ABORTS,
            "counter",
            ("process",),
            "Requests EngineCore aborted because it made no net progress for the progress "
            "timeout while they waited (MMCACHE_FIX_ABORT_STUCK=on; at most one per engine "
            "per 5 minutes); their clients got finish_reason abort.",
        ),
    ),
    settings=(
        SettingSpec(
            ENV_ABORT_STUCK,
            DEFAULT_ABORT_STUCK,
            "on | off",
            "on: at a zero-token livelock (no net progress for MMCACHE_FIX_PROGRESS_TIMEOUT), "
            "EngineCore aborts the oldest stuck request (its client gets finish_reason abort), "
            "at most once per engine per 5 minutes",
            reading_of(read_abort_stuck),
        ),
    ),
    active=messages.ANSWER_ACTIVE,
)

HEALTH = Declaration(
    fix_id=HEALTH_ID,
    build=_build_health,
    patches=(
        PatchSpec(
            id="engine-liveness-health",
            fix="engine-liveness-health",
            runs_in="API server",
            targets=(
                "vllm.v1.engine.async_llm.AsyncLLM.__init__",
                "vllm.v1.engine.async_llm.AsyncLLM.check_health",
            ),
            why=(
                "AsyncLLM.check_health, which /health awaits, raises only once EngineCore has "
                "died. A heartbeat (an asyncio task per engine client, started with AsyncLLM) "
                "pings every EngineCore every 2 s, at most two pings in flight; check_health "
                "runs vLLM's check, then reads the heartbeat's verdict without waiting and "
                "raises an EngineDeadError subclass (503) only for a stuck engine: two pings "
                "unanswered, the older one for MMCACHE_FIX_HEALTH_TIMEOUT seconds, or an answer "
                "saying the busy loop has been inside one step (or add/abort) that long. A "
                "utility call is healthy however long it runs."
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
    ),
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
            "NaN where the check is off for it or no longer runs); the freshest over API "
            "servers.",
            multiprocess_mode="livemin",
        ),
    ),
    settings=(
        SettingSpec(
            ENV_HEALTH_TIMEOUT,
            f"{DEFAULT_HEALTH_TIMEOUT:g}",
            "seconds >= 0",
            "/health fails when an EngineCore has not answered for this long; 0: off",
            reading_of(read_health_timeout),
        ),
        SettingSpec(
            ENV_STEP_TIMEOUT,
            f"{DEFAULT_STEP_TIMEOUT:g}",
            f"seconds >= {MIN_HEALTH_TIMEOUT:g}",
            f"/health fails when one EngineCore step has run this long (default: "
            f"{VLLM_STEP_TIMEOUT} or {DEFAULT_STEP_TIMEOUT:g})",
            reading_of(read_step_timeout),
        ),
        SettingSpec(
            ENV_PROGRESS_TIMEOUT,
            f"{DEFAULT_PROGRESS_TIMEOUT:g}",
            "seconds 30-600; 0 = off",
            "/health fails when an EngineCore has made no net progress this long while "
            "requests wait",
            reading_of(read_progress_timeout),
        ),
    ),
    active=messages.LIVENESS_ACTIVE,
    engine_counts=_engine_counts,
    engine_ages=_engine_ages,
    engine_progress=_engine_progress,
)
