"""docs/health.md says what the committed runs and the code say.

The runs in ``compat/health-load.json`` (``scripts/health-load``) must each meet the bars of
the health check (every check of :func:`harness.programs.health_load.checks` passes), the
doc's table
must be what they render, and the doc's metrics table must list exactly the metrics of
``metrics/names.py`` with their labels.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from typing import Any

import pytest

from harness.paths import REPO_ROOT
from harness.programs import health_load
from vllm_mmcache_fix.core.settings import DEFAULT_HEALTH_TIMEOUT, MIN_HEALTH_TIMEOUT
from vllm_mmcache_fix.engine_liveness.heartbeat import PING_INTERVAL_S
from vllm_mmcache_fix.metrics import names

DOC = REPO_ROOT / "docs" / "health.md"


def test_every_planned_run_is_committed_and_meets_its_bars() -> None:
    data = health_load.load_results()
    runs = data["runs"]
    assert data["timeout_s"] == health_load.TIMEOUT_S
    missing = [key for key in health_load.DEFAULT_PLAN if key not in runs]
    assert not missing, f"run scripts/health-load for {missing}"
    for key, run in runs.items():
        failed = [name for name, ok in health_load.checks(run, runs).items() if not ok]
        assert not failed, (key, failed)


def test_the_doc_table_is_what_the_results_render() -> None:
    block = health_load.doc_block(DOC.read_text())
    assert block is not None, "docs/health.md has no health-load block"
    assert block == health_load.render_block(health_load.load_results()), (
        "run scripts/health-load --doc"
    )


def test_the_load_bar_is_the_issue_bar() -> None:
    assert health_load.within_p99({"p99_ms": 16.0}, {"p99_ms": 10.0})
    assert not health_load.within_p99({"p99_ms": 16.1}, {"p99_ms": 10.0})
    assert health_load.percentile([5.0, 1.0, 3.0, 2.0, 4.0], 50) == 3.0
    assert health_load.percentile(list(map(float, range(1, 101))), 99) == 99.0


def test_the_doc_metrics_table_is_the_declared_metrics() -> None:
    """One description per metric: the doc's table is generated from the declarations."""
    from harness import fix_tables

    block = fix_tables.metrics_block(DOC.read_text())
    assert block == names.markdown_table(), "run: python -m harness.fix_tables --write"
    for spec in names.METRICS:
        assert f"| `{spec.name}` | {spec.kind}" in block, spec.name
        assert spec.help in block, spec.name


def test_the_doc_states_the_defaults_the_code_has() -> None:
    text = DOC.read_text()
    assert f"default `{DEFAULT_HEALTH_TIMEOUT:g}`, at least `{MIN_HEALTH_TIMEOUT:g}`" in text
    assert f"every {PING_INTERVAL_S:g} s" in text


def test_the_checks_catch_a_run_that_misses_a_bar() -> None:
    stats = {"n": 480, "p50_ms": 3.0, "p95_ms": 8.0, "p99_ms": 12.0, "max_ms": 40.0}
    base = {
        "key": "0.32.0 serve noplugin",
        "case": "serve",
        "variant": "noplugin",
        "started": True,
        "error": "",
        "start_method": "spawn",
        "phases": {"load": {"failures": 0, "requests_ok": 8, "polls": 480, "latency": stats}},
        "log_scan": {},
    }
    good_load = {"failures": 0, "requests_ok": 8, "polls": 480, "latency": dict(stats)}
    plugin = {
        **base,
        "key": "0.32.0 serve plugin",
        "variant": "plugin",
        "phases": {
            "load": good_load,
            "stuck_step": {"detected_s": 7.0, "recovered_s": 4.0, "metrics_while_stuck": {}},
        },
        "log_scan": {"loop_stuck": 1, "invocation_failed": 0, "check_off": 0},
    }
    runs = {base["key"]: base, plugin["key"]: plugin}
    got = health_load.checks(plugin, runs)
    assert got["load_no_failure"] and got["load_p99"] and got["stuck_503_in_time"]
    assert not got["stuck_metric"]  # no failed-check counter while stuck
    slow = {**good_load, "failures": 1, "latency": {**stats, "p99_ms": 19.0}}
    late = {"detected_s": 10.5, "recovered_s": None, "metrics_while_stuck": {}}
    plugin["phases"] = {"load": slow, "stuck_step": late}
    got = health_load.checks(plugin, runs)
    assert not any(got[k] for k in ("load_no_failure", "load_p99", "stuck_503_in_time"))
    assert not got["stuck_recovers"]


def _child(queue: Any) -> None:
    queue.put(os.getpid())
    time.sleep(120)  # read while alive, however slow the machine; terminated after


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_the_start_method_is_read_from_the_process(method: str) -> None:
    """What health-load records as the engine's start method, on real children."""
    ctx = multiprocessing.get_context(method)
    queue = ctx.Queue()
    child = ctx.Process(target=_child, args=(queue,))
    child.start()
    try:
        pid = queue.get(timeout=60)
        assert health_load.start_method(pid) == method
    finally:
        child.terminate()
        child.join()
