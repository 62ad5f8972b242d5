"""From the plugin's cumulative counters to metric updates, and the metrics themselves."""

from __future__ import annotations

import pytest

from vllm_mmcache_fix.metrics import names as n
from vllm_mmcache_fix.metrics.exporter import Deltas, Exporter, plan

LOCAL = {
    "protected": 1,
    "ghost_keys_dropped": 3,
    "orphans_restored": 1,
    "drift_events": 2,
    "rollbacks": 4,
    "recoveries": 2,
    "recovery_failures": 0,
    "internal_errors": 0,
    "stalls_cache_eviction": 0,
    "stalls_busy": 0,
}


def as_map(updates: list) -> dict:
    return {(m, labels, op): v for m, labels, op, v in updates}


def test_names_never_carry_vllm() -> None:
    assert len({s.name for s in n.METRICS}) == len(n.METRICS)
    for spec in n.METRICS:
        assert spec.name.startswith(n.PREFIX) and "vllm" not in spec.name
        assert spec.help


def test_counters_move_by_their_increase_only() -> None:
    deltas = Deltas()
    first = as_map(plan(deltas, LOCAL, None))
    api = (("process", "api_server"),)
    assert first[(n.CACHE_REPAIRS, api + (("repair", n.REPAIR_GHOST),), "inc")] == 3
    assert first[(n.ROLLBACKS, (), "inc")] == 4
    assert first[(n.PROTECTED_PROCESSES, (("kind", "api_server"),), "set")] == 1
    assert not any(labels == (("kind", "engine_core"),) for _, labels, _ in first)
    again = as_map(plan(deltas, {**LOCAL, "rollbacks": 6}, None))
    assert again[(n.ROLLBACKS, (), "inc")] == 2
    assert again[(n.CACHE_REPAIRS, api + (("repair", n.REPAIR_GHOST),), "inc")] == 0


def test_engine_counts_are_summed_and_a_restart_is_not_negative() -> None:
    deltas = Deltas()
    engines = [
        {"protected": 1, "ghost_keys_dropped": 5},
        {"protected": 0, "stalls_cache_eviction": 1, "stalls_busy": 3},
    ]
    got = as_map(plan(deltas, LOCAL, engines, {"EngineCore_DP0": 1.5}))
    core = (("process", "engine_core"),)
    assert got[(n.CACHE_REPAIRS, core + (("repair", n.REPAIR_GHOST),), "inc")] == 5
    assert got[(n.STALLS, core + (("cause", n.CAUSE_CACHE_EVICTION),), "inc")] == 1
    assert got[(n.STALLS, core + (("cause", n.CAUSE_BUSY),), "inc")] == 3
    assert got[(n.ENGINE_LAST_ANSWER_AGE, (("engine", "EngineCore_DP0"),), "set")] == 1.5
    assert got[(n.PROTECTED_PROCESSES, (("kind", "engine_core"),), "set")] == 1
    restarted = as_map(plan(deltas, LOCAL, [{"ghost_keys_dropped": 2}]))
    assert restarted[(n.CACHE_REPAIRS, core + (("repair", n.REPAIR_GHOST),), "inc")] == 2


def test_an_engine_that_leaves_takes_nothing_back() -> None:
    # DP=2: each engine's counters feed one series by their own increase. When DP1 leaves,
    # the series does not drop (Prometheus would read a reset, increase() a jump).
    deltas = Deltas()
    core = (("process", "engine_core"),)
    ghost = (n.CACHE_REPAIRS, core + (("repair", n.REPAIR_GHOST),), "inc")
    dp0 = {"mmcache|process|EngineCore_DP0": 1, "protected": 1, "ghost_keys_dropped": 5}
    dp1 = {"mmcache|process|EngineCore_DP1": 1, "protected": 1, "ghost_keys_dropped": 40}
    assert as_map(plan(deltas, LOCAL, [dp0, dp1]))[ghost] == 45
    left = as_map(plan(deltas, LOCAL, [{**dp0, "ghost_keys_dropped": 6}]))
    assert left[ghost] == 1
    assert left[(n.PROTECTED_PROCESSES, (("kind", "engine_core"),), "set")] == 1
    # DP1 comes back as a new process, counting from 0: its counts are all new.
    back = as_map(
        plan(deltas, LOCAL, [{**dp0, "ghost_keys_dropped": 6}, {**dp1, "ghost_keys_dropped": 2}])
    )
    assert back[ghost] == 2
    # An order change of the answers moves nothing.
    swapped = as_map(
        plan(deltas, LOCAL, [{**dp1, "ghost_keys_dropped": 2}, {**dp0, "ghost_keys_dropped": 6}])
    )
    assert swapped[ghost] == 0


def test_engines_without_caches_are_followed_by_the_name_the_heartbeat_gives() -> None:
    # A text-only engine builds no multimodal cache (no process key in its counts): the
    # heartbeat's engine name keeps DP0 the same series after DP1 leaves.
    from vllm_mmcache_fix.core.declaration import ENGINE_NAME_KEY

    deltas = Deltas()
    stalls = (n.STALLS, (("process", "engine_core"), ("cause", n.CAUSE_BUSY)), "inc")
    dp0 = {ENGINE_NAME_KEY: "EngineCore_DP0", "stalls_busy": 3}
    dp1 = {ENGINE_NAME_KEY: "EngineCore_DP1", "stalls_busy": 4}
    assert as_map(plan(deltas, LOCAL, [dp0, dp1]))[stalls] == 7
    assert as_map(plan(deltas, LOCAL, [dp0]))[stalls] == 0


def test_an_age_no_longer_reported_reads_nan_not_its_last_figure() -> None:
    # The heartbeat stopped (an internal error) or DP1 left: its last fresh age stayed on
    # the gauge for the server's life, and an alert on the age could never fire.
    import math

    deltas = Deltas()
    age = n.ENGINE_LAST_ANSWER_AGE
    both = as_map(plan(deltas, LOCAL, None, {"EngineCore_DP0": 0.2, "EngineCore_DP1": 0.3}))
    assert both[(age, (("engine", "EngineCore_DP1"),), "set")] == 0.3
    left = as_map(plan(deltas, LOCAL, None, {"EngineCore_DP0": 0.4}))
    assert left[(age, (("engine", "EngineCore_DP0"),), "set")] == 0.4
    assert math.isnan(left[(age, (("engine", "EngineCore_DP1"),), "set")])
    stopped = as_map(plan(deltas, LOCAL, None, {}))
    assert math.isnan(stopped[(age, (("engine", "EngineCore_DP0"),), "set")])
    # Set once: the next sync leaves the NaN as it is.
    assert not any(m == age for m, _, _ in as_map(plan(deltas, LOCAL, None, {})))


def test_the_liveness_gauges_of_a_stopped_heartbeat_read_nan_on_metrics() -> None:
    prom = pytest.importorskip("prometheus_client")
    from vllm_mmcache_fix.metrics import liveness as liveness_metrics

    ages: dict[str, float] = {"EngineCore": 0.2}
    progress: list[dict] | None = [{"engine": "EngineCore", "stalled_s": 40.0}]  # type: ignore[type-arg]
    exporter = Exporter(
        lambda: LOCAL, lambda: None, lambda exc: None, lambda: ages, progress=lambda: progress
    )
    stalled = f'{liveness_metrics.STALLED_SECONDS}{{engine="EngineCore"}}'
    age = 'mmcache_fix_engine_last_answer_age_seconds{engine="EngineCore"}'
    try:
        exporter.start()
        text = prom.generate_latest(prom.REGISTRY).decode()
        assert f"{age} 0.2" in text and f"{stalled} 40.0" in text
        ages, progress = {}, None  # the heartbeat stopped
        exporter.sync()
        text = prom.generate_latest(prom.REGISTRY).decode()
    finally:
        exporter.unregister()
    assert f"{age} NaN" in text and f"{stalled} NaN" in text


def test_the_exporter_shows_every_metric_on_the_default_registry() -> None:
    prom = pytest.importorskip("prometheus_client")
    engines = [{"protected": 1, "ghost_keys_dropped": 7}]
    errors: list[BaseException] = []
    exporter = Exporter(lambda: LOCAL, lambda: engines, errors.append, lambda: {"EngineCore": 2})
    try:
        exporter.start()
        exporter.observe_round_trip("EngineCore", 0.004)
        exporter.health_check_failed("EngineCore")
        text = prom.generate_latest(prom.REGISTRY).decode()
    finally:
        exporter.unregister()
    assert not errors
    for spec in n.METRICS:
        assert f"# TYPE {spec.name.removesuffix('_total')}" in text, spec.name
    assert (
        'mmcache_fix_cache_repairs_total{process="engine_core",repair="ghost_key_dropped"} 7.0'
        in text
    )
    assert 'mmcache_fix_protected_processes{kind="api_server"} 1.0' in text
    assert 'mmcache_fix_engine_stuck_health_checks_total{engine="EngineCore"} 1.0' in text
    # The former name, kept one release, has the same value.
    assert 'mmcache_fix_engine_round_trips_failed_total{engine="EngineCore"} 1.0' in text
    assert "mmcache_fix_engine_round_trip_seconds_count 1.0" in text
    assert 'mmcache_fix_engine_last_answer_age_seconds{engine="EngineCore"} 2.0' in text
    assert 'mmcache_fix_stalls_total{cause="busy",process="api_server"} 0.0' in text
    assert "mmcache_fix_" not in prom.generate_latest(prom.REGISTRY).decode()


def test_a_failed_sync_is_retried_and_only_a_long_run_stops_the_exporter() -> None:
    """A race in the plugin's own counters (a dict read while another thread adds a key)
    made the first failed sync stop the exporter for good."""
    pytest.importorskip("prometheus_client")
    import prometheus_client as prom

    from vllm_mmcache_fix.metrics import exporter as exporter_mod

    reads = [0]
    value = [3]

    def local() -> dict:
        reads[0] += 1
        if reads[0] in (2, 3):
            raise RuntimeError("dictionary changed size during iteration")
        return {**LOCAL, "rollbacks": value[0]}

    gave_up: list[BaseException] = []
    exporter = Exporter(local, lambda: None, gave_up.append)
    try:
        exporter.start()  # read 1
        value[0] = 5
        exporter.sync()  # read 2 fails
        exporter.sync()  # read 3 fails
        exporter.sync()  # read 4: the increase of the failed ones is not lost
        text = prom.generate_latest(prom.REGISTRY).decode()
        assert "mmcache_fix_rollbacks_total 5.0" in text, text
        assert exporter.failed_syncs == 2 and not gave_up
        assert not exporter._stop.is_set()

        def broken() -> dict:
            raise RuntimeError("persistent")

        exporter.local = broken
        for _ in range(exporter_mod.MAX_FAILED_SYNCS):
            exporter.sync()
        assert len(gave_up) == 1 and exporter._stop.is_set()
    finally:
        exporter.unregister()


MULTIPROCESS = r"""
import json, os, sys
from vllm_mmcache_fix.metrics.exporter import Exporter
counts = json.loads(sys.argv[1])
engines = json.loads(sys.argv[2])
ages = json.loads(sys.argv[3])
exporter = Exporter(lambda: counts, lambda: engines, print, lambda: ages)
exporter.start()
exporter.observe_round_trip("EngineCore", 0.01)
exporter.stop()
"""

READ = r"""
import prometheus_client as prom
from prometheus_client import multiprocess
registry = prom.CollectorRegistry()
multiprocess.MultiProcessCollector(registry)
print(prom.generate_latest(registry).decode())
"""


def test_two_api_servers_add_up_in_multiprocess_mode(tmp_path) -> None:
    """Two exporter processes with PROMETHEUS_MULTIPROC_DIR, read as vLLM reads them."""
    pytest.importorskip("prometheus_client")
    import json
    import os
    import subprocess
    import sys

    from harness.paths import REPO_ROOT

    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "PYTHONPATH": str(REPO_ROOT)}
    receiver = {
        "mmcache|receiver|bytes": 300,
        "mmcache|receiver|capacity_bytes": 1000,
        "mmcache|receiver|entries": 3,
        "mmcache|receiver|evictions": 2,
        "mmcache|receiver|too_large": 0,
        "mmcache|receiver|hits|image": 5,
        "mmcache|receiver|misses|video": 1,
        "mmcache|process|EngineCore": 1,
    }
    first = json.dumps([{"protected": 1, "ghost_keys_dropped": 4, **receiver}])
    # Only the first API server exports EngineCore's counts; each has its own view of the age.
    for engines, age in ((first, 1.5), ("null", 40.0)):
        subprocess.run(
            [
                sys.executable,
                "-c",
                MULTIPROCESS,
                json.dumps(LOCAL),
                engines,
                json.dumps({"EngineCore": age}),
            ],
            env=env,
            check=True,
            timeout=60,
        )
    text = subprocess.run(
        [sys.executable, "-c", READ],
        env=env,
        check=True,
        timeout=60,
        capture_output=True,
        text=True,
    ).stdout
    assert 'mmcache_fix_protected_processes{kind="api_server"} 2.0' in text, text
    assert 'mmcache_fix_protected_processes{kind="engine_core"} 1.0' in text, text
    assert "mmcache_fix_rollbacks_total 8.0" in text, text
    assert (
        'mmcache_fix_cache_repairs_total{process="engine_core",repair="ghost_key_dropped"} 4.0'
        in text
    ), text
    assert "mmcache_fix_engine_round_trip_seconds_count 2.0" in text, text
    assert (
        'mmcache_fix_mm_cache_hits_total{engine="EngineCore",modality="image",role="receiver"} 5.0'
        in text
    ), text
    # Every metric is listed, also a labelled counter still at 0 (multiprocess mode shows
    # only series that were created).
    for spec in n.METRICS:
        assert f"# TYPE {spec.name.removesuffix('_total')}" in text, (spec.name, text)
    assert 'mmcache_fix_engine_stuck_health_checks_total{engine="EngineCore"} 0.0' in text, text
    assert 'mmcache_fix_engine_round_trips_failed_total{engine="EngineCore"} 0.0' in text, text
    # The freshest answer any API server got (livemin), not a sum of ages.
    assert 'mmcache_fix_engine_last_answer_age_seconds{engine="EngineCore"} 1.5' in text, text


def test_the_internal_error_total_is_read_under_the_lock_record_takes() -> None:
    """``record()`` adds a site under its lock; ``total`` must not sum the dict meanwhile."""
    import threading

    from vllm_mmcache_fix.core.guard import InternalErrors

    errors = InternalErrors("test", lambda where, exc: None)
    errors.counts["a"] = 1
    got: list[int] = []
    with errors._lock:  # a record() in progress
        reader = threading.Thread(target=lambda: got.append(errors.total))
        reader.start()
        reader.join(0.3)
        assert reader.is_alive() and got == []
    reader.join(5)
    assert got == [1]
