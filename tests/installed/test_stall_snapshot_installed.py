"""The stall snapshot's EngineCore details on installed vLLM builds (no server): vLLM's real
``Request`` objects (built by vLLM's constructor), its request queue, its ``RequestStatus``,
its ``EncoderCacheManager``, and its real ``EngineCoreProc._process_engine_step`` timed by the
plugin, read the way the input thread reads them for the answer."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from harness.paths import REPO_ROOT
from harness.venvs import e2e_versions, venv_python

VERSIONS = e2e_versions()

CODE = r"""
import json, queue, time, types
import vllm.v1.engine.core as core
from vllm import SamplingParams
from vllm.v1.core.encoder_cache_manager import EncoderCacheManager
from vllm.v1.core.sched.request_queue import FCFSRequestQueue
from vllm.v1.request import Request, RequestStatus
from vllm_mmcache_fix import plugin
from vllm_mmcache_fix.engine_liveness import snapshot
from vllm_mmcache_fix.engine_liveness.answer import ENGINE_ATTR, progress_snapshot

plugin.instrument()

def request(rid, age, computed=0, status=None):
    r = Request(rid, [1] * 50, SamplingParams(max_tokens=8), None,
                arrival_time=time.time() - age)
    r.num_computed_tokens = computed
    if status is not None:
        r.status = status
    return r

sched = types.SimpleNamespace()
running = request("run-1", 30.0, 48, RequestStatus.RUNNING)
remote = request("kv-2", 90.0, 0, RequestStatus.WAITING_FOR_REMOTE_KVS)
sched.running = [running]
sched.waiting = FCFSRequestQueue()
sched.waiting.add_request(remote)
sched.requests = {r.request_id: r for r in (running, remote)}
sched.encoder_cache_manager = EncoderCacheManager(cache_size=400)
sched.encoder_cache_manager.num_free_slots = 100

engine = object.__new__(core.EngineCoreProc)  # vLLM's class; no model, no sockets
engine.input_queue = queue.Queue()
engine.output_queue = queue.Queue()
engine.scheduler = sched
if hasattr(core, "EngineShutdownState"):
    engine.shutdown_state = core.EngineShutdownState.RUNNING
plugin.ENGINE_ANSWER.adopt(engine)
engine.step_fn = lambda: (time.sleep(0.015), ({}, True))[1]
engine.post_step = lambda model_executed: None
for _ in range(3):
    engine._process_engine_step()
record = engine.__dict__[ENGINE_ATTR]
print(json.dumps({
    "details": snapshot.engine_details(engine, sched),
    "progress": progress_snapshot(record, sched),
    "internal_errors": plugin.ENGINE_ANSWER.errors.total,
}, default=str))
"""


@pytest.mark.parametrize("version", VERSIONS)
def test_details_read_vllms_own_classes(version: str, vllm_venv) -> None:
    venv = vllm_venv(version)
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("VLLM_", "MMCACHE_FIX_", "MMCACHE_HARNESS_"))
    }
    env.update({"PYTHONPATH": str(REPO_ROOT), "VLLM_TARGET_DEVICE": "cpu"})
    proc = subprocess.run(
        [str(venv_python(venv)), "-c", CODE],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        cwd="/",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    requests = {r["request_id"]: r for r in out["details"]["stuck_requests"]}
    run, kv = requests["run-1"], requests["kv-2"]
    assert (run["status"], run["computed"], run["prompt_len"]) == ("RUNNING", 48, 50), out
    assert run["queue"] == "running" and 29 < run["age_s"] < 60, out
    assert kv["status"] == "WAITING_FOR_REMOTE_KVS" and kv["waiting_reason"] == "remote_kvs"
    assert kv["queue"] == "waiting" and kv["preemptions"] == 0, out
    assert out["details"]["encoder_cache_usage"] == 0.75, out
    assert any(s["frames"] for s in out["details"]["stacks"]), out
    progress = out["progress"]
    # Three real steps of at least 15 ms: timed, none in the buckets up to 10 ms, in the ring.
    assert sum(progress["step_counts"]) == 3 and progress["step_counts"][:3] == [0, 0, 0], out
    assert len(progress["recent_steps_s"]) == 3, out
    assert all(0.015 <= d < 1.0 for d in progress["recent_steps_s"]), out
    assert out["internal_errors"] == 0, out
