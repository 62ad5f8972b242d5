"""Real servers: ``/health`` with the engine liveness check, and the plugin's ``/metrics``.

The frozen-engine cases replay the incident on vLLM 0.23.0 (where it freezes EngineCore
without the eviction fix) while a thread polls ``/health`` every 0.5 s:

- plugin loaded, eviction fix off (``MMCACHE_FIX_MODE=warn``), liveness on: ``/health``
  answers 200 until EngineCore spins, then 503 within the timeout plus a margin, and
  ``/metrics`` counts the failed round trips;
- plugin on (default): ``/health`` stays 200 through the whole replay;
- plugin kept out: ``/health`` stays 200 while EngineCore spins (vLLM's own check).

The metrics cases scrape ``/metrics`` on every e2e version, and with two API servers.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

import vllm_mmcache_fix
from harness import incident, tiny_models
from harness.health import HealthPoller, scrape
from harness.http import free_port, http_get
from harness.lock import ServerLock
from harness.paths import log_path as new_log_path
from harness.readme import guide_blocks
from harness.server import Server
from harness.venvs import e2e_versions, set_plugin
from vllm_mmcache_fix.core.messages import ENGINE_NOT_ANSWERING
from vllm_mmcache_fix.core.settings import ENV_HEALTH_TIMEOUT, ENV_MODE
from vllm_mmcache_fix.metrics import names

VERSIONS = e2e_versions()
FREEZE_VERSION = "0.23.0"
TIMEOUT_S = 3.0
MARGIN_S = 5.0
MIN_POLLS = 12


def _status_cli(venv: Path, base: str, timeout: float) -> dict:
    """The README's ``status --url`` line, run against this server."""
    line = guide_blocks()["status-url"][1].strip().replace("http://localhost:8000", base)
    done = subprocess.run(
        ["bash", "-c", f"{line} --json --timeout {timeout:g}"],
        env={**os.environ, "PATH": f"{venv / 'bin'}:{os.environ['PATH']}"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    try:
        return {"rc": done.returncode, **json.loads(done.stdout)}
    except json.JSONDecodeError:
        return {"rc": done.returncode, "stdout": done.stdout, "stderr": done.stderr[-2000:]}


def _polls(result: incident.RunResult, poller: HealthPoller) -> list:
    """The polls from the server's first 200 to the end of the inspection (before shutdown)."""
    end = result.inspection["end"] if isinstance(result.inspection, dict) else float("inf")
    return [p for p in poller.answered() if p[0] <= end]


def _report(result: incident.RunResult, poller: HealthPoller) -> str:
    polls = ", ".join(f"{s}" for _, s, _ in _polls(result, poller))
    return "\n" + incident.format_result(result) + f"\n/health polls: {polls}\n{result.inspection}"


def _freeze_case(version: str, vllm_venv, wheel: Path | None, env: dict[str, str], **kw):
    if version not in VERSIONS:
        pytest.skip(f"{version} not in MMCACHE_FIX_E2E_VERSIONS")
    venv = vllm_venv(version)
    port = free_port()
    base = f"http://127.0.0.1:{port}"

    def inspect(_pid: int) -> dict:
        # A replay that is served fast takes a second or two: let /health be polled at
        # least MIN_POLLS times (each poll is a round trip) before looking.
        wait_until = time.monotonic() + MIN_POLLS * 0.5 + 10
        while len(poller.answered()) < MIN_POLLS and time.monotonic() < wait_until:
            time.sleep(0.2)
        t0 = time.monotonic()
        status, body, took = http_get(base + "/health", TIMEOUT_S + MARGIN_S + 30)
        metrics_status, metrics, _ = scrape(base)
        after_s = round(time.monotonic() - t0, 2)
        return {
            "health": status,
            "health_s": round(took, 2),
            "after_s": after_s,
            "metrics_status": metrics_status,
            "metrics": metrics,
            "status_cli": _status_cli(venv, base, TIMEOUT_S + MARGIN_S + 10),
            "end": time.monotonic(),
        }

    # The venv changes only under the lock: another holder may be serving from it.
    with ServerLock().hold(purpose="health e2e") as lock:
        if wheel is not None:
            set_plugin(venv, wheel)
        with HealthPoller(base, interval=0.5, timeout=TIMEOUT_S + MARGIN_S + 30) as poller:
            result = incident.run_incident(
                venv,
                env={ENV_HEALTH_TIMEOUT: str(TIMEOUT_S), **env},
                inspect=inspect,
                port=port,
                lock=lock,
                **kw,
            )
    return result, poller


def test_health_fails_when_enginecore_spins(plugin_wheel: Path, vllm_venv) -> None:
    result, poller = _freeze_case(
        FREEZE_VERSION, vllm_venv, plugin_wheel, {ENV_MODE: "warn"}, disable_plugin=False
    )
    report = _report(result, poller)
    assert result.started, result.error
    assert result.hung and result.spin_after is not None and result.spin_after.spinning, report
    polls = _polls(result, poller)
    assert polls and polls[0][1] == 200, report
    # 200 while EngineCore served, then 503 and nothing else once it spins.
    first_bad = next(i for i, (_, status, _) in enumerate(polls) if status != 200)
    assert all(status == 200 for _, status, _ in polls[:first_bad]), report
    assert {status for _, status, _ in polls[first_bad:]} == {503}, report
    gap = polls[first_bad][0] - polls[first_bad - 1][0]
    assert gap <= TIMEOUT_S + MARGIN_S, report
    inspection = result.inspection
    assert inspection["health"] == 503 and inspection["health_s"] <= TIMEOUT_S + MARGIN_S, report
    failed = inspection["metrics"].get(f'{names.ROUND_TRIPS_FAILED}{{engine="EngineCore"}}', 0)
    assert failed >= 1, report
    logged = [
        x for lines in result.plugin_lines.values() for x in lines if ENGINE_NOT_ANSWERING in x
    ]
    assert len(logged) == 1 and "EngineCore has not answered" in logged[0], report
    assert "round trip sent at" in logged[0], report
    # A fleet script asking the server from outside: stuck (exit 9).
    status = inspection["status_cli"]
    assert (status["rc"], status.get("verdict")) == (9, "stuck"), report + str(status)


def test_health_stays_200_with_the_fix(plugin_wheel: Path, vllm_venv) -> None:
    result, poller = _freeze_case(FREEZE_VERSION, vllm_venv, plugin_wheel, {})
    report = _report(result, poller)
    assert result.started and not result.hung, report
    new_images = [s for s in result.steps if s.step.startswith("c:")]
    assert len(new_images) == 20 and all(s.ok for s in new_images), report
    polls = _polls(result, poller)
    assert len(polls) >= 10, report
    assert all(status == 200 for _, status, _ in polls), report
    inspection = result.inspection
    assert inspection["health"] == 200, report
    m = inspection["metrics"]
    assert m[f'{names.PROTECTED_PROCESSES}{{kind="api_server"}}'] == 1, report
    assert m[f'{names.PROTECTED_PROCESSES}{{kind="engine_core"}}'] == 1, report
    assert m.get(names.ROLLBACKS, 0) >= 1, report  # request (a) was rolled back
    assert not any(k.startswith(names.ROUND_TRIPS_FAILED) and v for k, v in m.items()), report
    assert m[f"{names.ROUND_TRIP_SECONDS}_count"] >= 10, report
    status = inspection["status_cli"]
    assert (status["rc"], status.get("verdict")) == (0, "protected"), report + str(status)


def test_health_stays_200_while_frozen_without_the_plugin(plugin_wheel: Path, vllm_venv) -> None:
    result, poller = _freeze_case(FREEZE_VERSION, vllm_venv, plugin_wheel, {}, disable_plugin=True)
    report = _report(result, poller)
    assert result.started and not result.plugin_lines, report
    assert result.hung and result.spin_after is not None and result.spin_after.spinning, report
    assert result.inspection["health"] == 200, report
    assert all(status == 200 for _, status, _ in _polls(result, poller)), report
    assert not any(k.startswith(names.PREFIX) for k in result.inspection["metrics"]), report
    # Without the plugin nothing on the server tells a frozen engine: status can only say
    # that the server is not protected.
    status = result.inspection["status_cli"]
    assert (status["rc"], status.get("verdict")) == (3, "unprotected"), report + str(status)


def _scrape_server(version: str, vllm_venv, plugin_wheel: Path, extra_args: list[str]) -> tuple:
    venv = vllm_venv(version)
    model = tiny_models.ensure_model(venv)
    tag = "x".join(extra_args[1:2]) or "1"
    log = new_log_path(f"metrics-{version}-api{tag}")
    with ServerLock().hold(purpose="metrics e2e") as lock:
        set_plugin(venv, plugin_wheel)
        with Server(venv, model, log, extra_args=extra_args, lock=lock) as server:
            server.wait_ready(240)
            # 12 calls: with two API servers, each gets some (the kernel spreads connections).
            healths = [http_get(server.base_url + "/health", 30)[0] for _ in range(12)]
            time.sleep(2.5)  # the metrics thread syncs every second
            status, metrics, text = scrape(server.base_url)
            cli = _status_cli(venv, server.base_url, 30)
            pids = subprocess.run(
                ["bash", "-c", guide_blocks()["find-pid"][1]],
                capture_output=True,
                text=True,
                timeout=60,
                env={**os.environ, "COLUMNS": "80"},  # ps cut lines to this without -ww
            ).stdout
            found = _found_pids(pids, server.pid)
    assert (cli["rc"], cli.get("verdict")) == (0, "protected"), cli
    assert cli["plugin_version"] == vllm_mmcache_fix.__version__, cli
    assert cli["vllm_version"].split("+")[0] == version, cli
    assert found["api_server"] and found["engine_core"], pids
    return healths, status, metrics, text, log


def _found_pids(ps_lines: str, server_pid: int | None) -> dict[str, bool]:
    """What the README's find-pid line shows: the API server's PID and an EngineCore."""
    rows = [line.split(None, 2) for line in ps_lines.strip().splitlines()]
    return {
        "api_server": any(row[0] == str(server_pid) for row in rows),
        "engine_core": any("EngineCore" in row[2] for row in rows if len(row) == 3),
    }


def _assert_all_metrics(metrics: dict[str, float], text: str, log: Path) -> None:
    for spec in names.METRICS:
        assert f"# TYPE {spec.name.removesuffix('_total')}" in text, (spec.name, log)
    assert metrics[f'{names.PROTECTED_PROCESSES}{{kind="engine_core"}}'] == 1, (metrics, log)
    assert metrics[f"{names.ROUND_TRIP_SECONDS}_count"] >= 1, (metrics, log)
    assert not any(k.startswith("vllm") for k in metrics), metrics


@pytest.mark.parametrize("version", VERSIONS)
def test_metrics_on_one_api_server(version: str, plugin_wheel: Path, vllm_venv) -> None:
    healths, status, metrics, text, log = _scrape_server(version, vllm_venv, plugin_wheel, [])
    assert healths == [200] * 12, log
    assert status == 200, log
    _assert_all_metrics(metrics, text, log)
    assert metrics[f'{names.PROTECTED_PROCESSES}{{kind="api_server"}}'] == 1, (metrics, log)
    assert "vllm:" in text  # vLLM's own metrics are still there


TWO_API_VERSIONS = [v for v in VERSIONS if v == "0.32.0"] or VERSIONS[-1:]


@pytest.mark.parametrize("version", TWO_API_VERSIONS)
def test_metrics_with_two_api_servers(version: str, plugin_wheel: Path, vllm_venv) -> None:
    healths, status, metrics, text, log = _scrape_server(
        version, vllm_venv, plugin_wheel, ["--api-server-count", "2"]
    )
    assert healths == [200] * 12, log
    assert status == 200, log
    _assert_all_metrics(metrics, text, log)
    # Both API servers are protected; the multiprocess collector adds them up.
    assert metrics[f'{names.PROTECTED_PROCESSES}{{kind="api_server"}}'] == 2, (metrics, log)
