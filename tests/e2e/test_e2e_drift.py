"""Real servers: P0/P1 multimodal cache drift never reaches a client with the plugin.

A 200-request mixed run (``scripts/drift-run``, harness/programs/drift_run.py) at
``--mm-processor-cache-gb 0.001`` for each vLLM version of ``MMCACHE_HARNESS_E2E_VERSIONS``:

* with the plugin (default mode, on the release's shared plugin server, with images it
  has not seen): the long-prompt request gets 400, the next request with the same image
  200, and no request gets a 5xx or times out;
* with the plugin in ``recover`` mode (no prevention; a server of its own; 0.23.0 or
  0.32.0, one per commit): drift happens and every drifted request is re-sent before the
  client sees it: again no 5xx;
* without the plugin (the shared server that keeps it out; one release per commit, the
  same as the incident replay's without the plugin): the same run shows 5xx.
  0.23.0 freezes without the plugin (tests/e2e/test_e2e_incident.py); its drift run
  without the plugin is in the release matrix (``scripts/matrix``, ``compat/matrix.json``).

One server at a time; a mixed run takes about a minute on two cores.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from harness import runner
from harness.programs import drift_run
from harness.rotation import per_commit
from harness.shared_servers import SharedServers
from harness.venvs import complete_venv, e2e_versions

VERSIONS = e2e_versions()
FREEZES = ("0.23.0",)

# Recovery alone (no prevention) on the oldest or the newest, one per commit
# (MMCACHE_HARNESS_ROTATE=off: both): the engine reports no missing hashes up to 0.27 and
# reports them from 0.28 on.
RECOVER_ONLY = per_commit([v for v in VERSIONS if v in ("0.23.0", "0.32.0")])
BASELINES = per_commit([v for v in VERSIONS if v not in FREEZES])
"""Releases whose drift run without the plugin runs in this commit (one; the release
matrix has every release's)."""


def _print(run: drift_run.DriftRun) -> None:
    print(
        f"vLLM {run.vllm_version} plugin={run.plugin_installed and not run.plugin_disabled} "
        f"drift={run.drift_mode or 'on'}: {run.requests} requests in {run.seconds} s; "
        f"first two {run.first_400_then_same_image}; statuses {run.status_counts}; "
        f"5xx={run.server_errors} timeouts={run.timeouts}; by kind {run.by_kind}; "
        f"drift warnings={run.drift_warnings} rollback lines={run.rollback_lines}"
    )


def _on_shared(servers: SharedServers, version: str, kind: str) -> drift_run.DriftRun:
    session = servers(version, kind)
    run = drift_run.send_mixed(session, requests=200, first_image=servers.new_items())
    return drift_run.read_log(session, run)


def _assert_clean(run: drift_run.DriftRun) -> None:
    assert run.started, run.error
    assert not run.error, run.error
    assert run.first_400_then_same_image == [400, 200], run.unexpected[:5]
    assert run.server_errors == 0, run.unexpected[:5]
    assert run.timeouts == 0, run.unexpected[:5]
    assert run.status_counts.get("400", 0) >= 40


@pytest.mark.shared_server("plugin")
@pytest.mark.parametrize("version", VERSIONS)
def test_no_client_sees_drift_with_the_plugin(version: str, shared_server: SharedServers) -> None:
    run = _on_shared(shared_server, version, "plugin")
    _print(run)
    _assert_clean(run)
    assert run.drift_guard_active, run.plugin_lines


@pytest.mark.parametrize("version", RECOVER_ONLY)
def test_recovery_alone_hides_the_drift(version: str, plugin_wheel: Path) -> None:
    venv = complete_venv(version)
    with runner.plugin_state(venv, plugin_wheel, purpose="drift e2e, recover") as lock:
        run = drift_run.run_mixed(venv, requests=200, drift_mode="recover", lock=lock)
    _print(run)
    _assert_clean(run)
    assert run.drift_warnings >= 1, run.plugin_lines


@pytest.mark.shared_server("noplugin")
@pytest.mark.parametrize("version", BASELINES)
def test_the_same_run_shows_5xx_without_the_plugin(
    version: str, shared_server: SharedServers
) -> None:
    run = _on_shared(shared_server, version, "noplugin")
    _print(run)
    assert run.started, run.error
    assert not run.plugin_lines, run.plugin_lines
    assert run.server_errors > 0 or run.timeouts > 0, run.status_counts


@pytest.mark.parametrize("version", [v for v in VERSIONS if v == VERSIONS[-1]])
def test_shm_cache_is_left_alone(version: str, plugin_wheel: Path) -> None:
    """``--mm-processor-cache-type shm`` uses other classes; the plugin must not get in the way."""
    venv = complete_venv(version)
    shm = ["--mm-processor-cache-type", "shm"]
    with runner.plugin_state(venv, plugin_wheel, purpose="drift e2e, shm") as lock:
        run = drift_run.run_mixed(venv, requests=200, extra_args=shm, lock=lock)
    _print(run)
    assert run.started, run.error
    assert not run.error, run.error
    assert run.timeouts == 0, run.unexpected[:5]
    assert run.server_errors == 0, run.unexpected[:5]
    assert run.status_counts.get("400", 0) >= 40
