"""Real servers: ``/health`` with the engine liveness check, and the plugin's ``/metrics``.

The frozen-engine cases replay the incident on vLLM 0.23.0 (where it freezes EngineCore
without the eviction fix) while a thread polls ``/health`` every 0.5 s (the replays are
fixtures of ``tests/e2e/conftest.py``, shared with the stall sentinel's and the
incident's tests):

- plugin loaded, eviction fix off (``MMCACHE_FIX_MODE=warn``), liveness at 5 s:
  ``/health`` answers 200 until EngineCore's input thread spins, then 503 within the
  timeout plus a margin of the freezing request, and ``/metrics`` counts the failed checks;
- plugin on (default), liveness at 5 s: ``/health`` stays 200 through the whole replay;
- plugin kept out: ``/health`` stays 200 while EngineCore spins (vLLM's own check).

The metrics cases scrape ``/metrics`` of the shared plugin server of every e2e version,
and of a server with two API servers. They wait (at most :data:`SERIES_WAIT_S`) for
EngineCore's series to reach ``/metrics`` and send no ``/health`` meanwhile: those
series must arrive whoever calls ``/health``, and whichever API server a call lands on.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

import vllm_mmcache_fix
from harness import runner
from harness.http import http_get
from harness.programs.health import scrape
from harness.readme import guide_blocks
from harness.shared_servers import (
    HEALTH_TIMEOUT_S,
    MARGIN_S,
    SharedServers,
    WatchedReplay,
    status_cli,
)
from harness.venvs import complete_venv, e2e_versions
from vllm_mmcache_fix.core.messages import ENGINE_CHECK_OFF, ENGINE_NOT_ANSWERING
from vllm_mmcache_fix.metrics import names

VERSIONS = e2e_versions()
SERIES_WAIT_S = 60.0
ENGINE_SERIES = f'{names.PROTECTED_PROCESSES}{{kind="engine_core"}}'


def test_health_fails_when_enginecore_spins(frozen_in_warn_mode: WatchedReplay) -> None:
    result = frozen_in_warn_mode.result
    report = frozen_in_warn_mode.report()
    assert result.started, result.error
    assert result.hung and result.spin_after is not None and result.spin_after.spinning, report
    polls = frozen_in_warn_mode.polls()
    assert polls and polls[0][1] == 200, report
    # 200 while EngineCore served, then 503 and nothing else once it spins.
    first_bad = next(i for i, (_, status, _) in enumerate(polls) if status != 200)
    assert all(status == 200 for _, status, _ in polls[:first_bad]), report
    assert {status for _, status, _ in polls[first_bad:]} == {503}, report
    hung = next(s for s in result.steps if s.timed_out)
    assert polls[first_bad][0] - hung.sent_at <= HEALTH_TIMEOUT_S + MARGIN_S, report
    inspection = result.inspection
    assert isinstance(inspection, dict), report
    assert inspection["health"] == 503, report
    assert inspection["health_s"] <= HEALTH_TIMEOUT_S + MARGIN_S, report
    failed = inspection["metrics"].get(f'{names.STUCK_HEALTH_CHECKS}{{engine="EngineCore"}}', 0)
    assert failed >= 1, report
    logged = [
        x for lines in result.plugin_lines.values() for x in lines if ENGINE_NOT_ANSWERING in x
    ]
    assert len(logged) == 1 and "EngineCore has not answered" in logged[0], report
    assert "pings sent since" in logged[0] and "input thread" in logged[0], report
    # A fleet script asking the server from outside: stuck (exit 9).
    status = inspection["status_cli"]
    assert (status["rc"], status.get("verdict")) == (9, "stuck"), report + str(status)


def test_health_stays_200_with_the_fix(fixed_with_short_thresholds: WatchedReplay) -> None:
    result = fixed_with_short_thresholds.result
    report = fixed_with_short_thresholds.report()
    assert result.started and not result.hung, report
    new_images = [s for s in result.steps if s.step.startswith("c:")]
    assert len(new_images) == 20 and all(s.ok for s in new_images), report
    polls = fixed_with_short_thresholds.polls()
    assert len(polls) >= 10, report
    assert all(status == 200 for _, status, _ in polls), report
    # The check judged EngineCore all along: nothing turned it off (the first ping can reach
    # EngineCore before its busy loop hooks the input queue).
    off = [x for lines in result.plugin_lines.values() for x in lines if ENGINE_CHECK_OFF in x]
    assert off == [], report
    inspection = result.inspection
    assert isinstance(inspection, dict), report
    assert inspection["health"] == 200, report
    m = inspection["metrics"]
    assert m[f'{names.PROTECTED_PROCESSES}{{kind="api_server"}}'] == 1, report
    assert m[ENGINE_SERIES] == 1, report
    assert m.get(names.ROLLBACKS, 0) >= 1, report  # request (a) was rolled back
    assert not any(k.startswith(names.STUCK_HEALTH_CHECKS) and v for k, v in m.items()), report
    # The heartbeat repeats (every 2 s; a fast replay and its inspection last about 6 s).
    assert m[f"{names.ROUND_TRIP_SECONDS}_count"] >= 2, report
    status = inspection["status_cli"]
    assert (status["rc"], status.get("verdict")) == (0, "protected"), report + str(status)


def test_health_stays_200_while_frozen_without_the_plugin(
    frozen_without_plugin: WatchedReplay,
) -> None:
    result = frozen_without_plugin.result
    report = frozen_without_plugin.report()
    assert result.started and not result.plugin_lines, report
    assert result.hung and result.spin_after is not None and result.spin_after.spinning, report
    inspection = result.inspection
    assert isinstance(inspection, dict), report
    assert inspection["health"] == 200, report
    assert all(status == 200 for _, status, _ in frozen_without_plugin.polls()), report
    assert not any(k.startswith(names.PREFIX) for k in inspection["metrics"]), report
    # Without the plugin nothing on the server tells a frozen engine: status can only say
    # that the server is not protected.
    status = inspection["status_cli"]
    assert (status["rc"], status.get("verdict")) == (3, "unprotected"), report + str(status)


def wait_for_engine_series(base_url: str) -> tuple[int | None, dict[str, float], str, float]:
    """Scrape ``/metrics`` until EngineCore's series is there (at most :data:`SERIES_WAIT_S`;
    no ``/health`` call): ``(status, metrics, text, seconds waited)``."""
    start = time.monotonic()
    while True:
        status, metrics, text = scrape(base_url)
        waited = time.monotonic() - start
        if ENGINE_SERIES in metrics or waited >= SERIES_WAIT_S:
            return status, metrics, text, round(waited, 1)
        time.sleep(1.0)


CACHE_FAMILIES = frozenset(
    {
        names.MM_CACHE_BYTES,
        names.MM_CACHE_CAPACITY,
        names.MM_CACHE_ENTRIES,
        names.MM_CACHE_EVICTIONS,
        names.MM_CACHE_TOO_LARGE,
        names.MM_CACHE_HITS,
        names.MM_CACHE_MISSES,
    }
)
"""Series of the multimodal caches: labelled by cache (and modality), so with
``PROMETHEUS_MULTIPROC_DIR`` (several API servers) a family has no line at all until a
cache has figures; these tests send no request (the cache series under traffic:
test_e2e_cache_metrics.py)."""


def _assert_all_metrics(
    metrics: dict[str, float], text: str, where: str, *, multiprocess: bool = False
) -> None:
    for spec in names.METRICS:
        if multiprocess and spec.name in CACHE_FAMILIES:
            continue
        assert f"# TYPE {spec.name.removesuffix('_total')}" in text, (spec.name, where)
    assert metrics[ENGINE_SERIES] == 1, (metrics, where)
    assert metrics[f"{names.ROUND_TRIP_SECONDS}_count"] >= 1, (metrics, where)
    age = metrics[f'{names.ENGINE_LAST_ANSWER_AGE}{{engine="EngineCore"}}']
    assert age < 10, (metrics, where)
    assert not any(k.startswith("vllm") for k in metrics), metrics


@pytest.mark.shared_server("plugin")
@pytest.mark.parametrize("version", VERSIONS)
def test_metrics_on_one_api_server(version: str, shared_server: SharedServers) -> None:
    session = shared_server(version, "plugin")
    status, metrics, text, waited = wait_for_engine_series(session.base_url)
    where = f"{session.log_path} (waited {waited} s)"
    assert status == 200, where
    _assert_all_metrics(metrics, text, where)
    assert metrics[f'{names.PROTECTED_PROCESSES}{{kind="api_server"}}'] == 1, (metrics, where)
    assert "vllm:" in text  # vLLM's own metrics are still there
    healths = [http_get(session.base_url + "/health", 30)[0] for _ in range(4)]
    assert healths == [200] * 4, where
    # The README's status line and find-pid line, as an operator runs them.
    cli = status_cli(session.venv, session.base_url, 30)
    assert (cli["rc"], cli.get("verdict")) == (0, "protected"), cli
    assert cli["plugin_version"] == vllm_mmcache_fix.__version__, cli
    assert cli["vllm_version"].split("+")[0] == version, cli
    pids = subprocess.run(
        ["bash", "-c", guide_blocks()["find-pid"][1]],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "80"},  # ps cuts lines to this without -ww
    ).stdout
    found = _found_pids(pids, session.pid)
    assert found["api_server"] and found["engine_core"], pids


def _found_pids(ps_lines: str, server_pid: int | None) -> dict[str, bool]:
    """What the README's find-pid line shows: the API server's PID and an EngineCore."""
    rows = [line.split(None, 2) for line in ps_lines.strip().splitlines()]
    return {
        "api_server": any(row[0] == str(server_pid) for row in rows),
        "engine_core": any("EngineCore" in row[2] for row in rows if len(row) == 3),
    }


TWO_API_VERSIONS = [v for v in VERSIONS if v == "0.32.0"] or VERSIONS[-1:]


@pytest.mark.parametrize("version", TWO_API_VERSIONS)
def test_metrics_with_two_api_servers(version: str, plugin_wheel: Path) -> None:
    """EngineCore's series reach the first API server's ``/metrics`` with no ``/health``
    traffic at all: they must not depend on which API server a ``/health`` lands on."""
    venv = complete_venv(version)
    spec = runner.ServerSpec(venv, args=["--api-server-count", "2"], name="metrics-api2")
    with runner.plugin_state(venv, plugin_wheel, purpose="metrics e2e") as lock:
        with runner.Session(spec, lock=lock) as session:
            status, metrics, text, waited = wait_for_engine_series(session.base_url)
            where = f"{session.log_path} (waited {waited} s)"
            healths = [http_get(session.base_url + "/health", 30)[0] for _ in range(6)]
    assert status == 200, where
    _assert_all_metrics(metrics, text, where, multiprocess=True)
    # Both API servers are protected; the multiprocess collector adds them up.
    assert metrics[f'{names.PROTECTED_PROCESSES}{{kind="api_server"}}'] == 2, (metrics, where)
    assert healths == [200] * 6, where
