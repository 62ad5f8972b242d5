"""The heartbeat's two ends on installed vLLM builds (no server, no engine behind the classes).

EngineCore's side on vLLM's real ``EngineCoreProc``: once adopted (what the busy loop's first
``_process_input_queue`` does), a ping put on the input queue by another thread (as the input
thread does) is answered right there through vLLM's own ``_handle_client_request``, and the
answer says what vLLM's own ``_process_engine_step`` or a utility call the busy loop runs is
doing. The API server's side: the real ``AsyncLLM`` is wrapped and the real async client's
utility call takes ``engine=``.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from harness.paths import REPO_ROOT
from harness.venvs import e2e_versions, venv_python

VERSIONS = e2e_versions()

CODE = r"""
import json, queue, threading, types
import vllm.v1.engine.core as core
import vllm.v1.engine.async_llm as async_llm
import vllm.v1.engine.core_client as cc
from vllm.v1.engine import EngineCoreRequestType as T
import vllm_mmcache_fix
from vllm_mmcache_fix import plugin
from vllm_mmcache_fix.core import registry, signals
from vllm_mmcache_fix.engine_liveness.heartbeat import accepts_engine

identified = []
signals.ENGINE_CORE_RUNNING.connect(lambda: identified.append("EngineCore"))
plugin.instrument()

engine = object.__new__(core.EngineCoreProc)  # vLLM's class; no model, no sockets
engine.input_queue = queue.Queue()
engine.output_queue = queue.Queue()
if hasattr(core, "EngineShutdownState"):
    engine.shutdown_state = core.EngineShutdownState.RUNNING
# The API server's first ping can reach the input queue before the busy loop adopts the
# engine (EngineCore said it was ready; its busy loop has not started): the busy loop answers
# it, and says it was queued before the hook.
engine.input_queue.put_nowait((T.UTILITY, [0, 0, "mmcache_fix_ping", []]))
plugin.ENGINE_ANSWER.adopt(engine)
engine._handle_client_request(*engine.input_queue.get_nowait())  # the busy loop takes it
early = engine.output_queue.get(timeout=5)[1].utility_output.result.result


def ping(call_id, target=None):
    # What the input thread does with a decoded utility request.
    target = engine if target is None else target
    request = (T.UTILITY, [0, call_id, "mmcache_fix_ping", []])
    thread = threading.Thread(target=target.input_queue.put_nowait, args=(request,), name="in")
    thread.start(); thread.join()
    _, outputs = target.output_queue.get(timeout=5)
    out = outputs.utility_output
    return {"call_id": out.call_id, "failure": out.failure_message,
            "result": out.result.result if out.result is not None else None}


idle = ping(1)
during = {}
engine.step_fn = lambda: (during.__setitem__("step", ping(2)), ({}, True))[1]
engine.post_step = lambda *args, **kwargs: None
engine.scheduler = types.SimpleNamespace(has_requests=lambda: False)
core.EngineCoreProc._process_engine_step(engine)
# vLLM's own scheduler queue and request classes: a request waits, steps schedule nothing.
from vllm.v1.core.sched.request_queue import FCFSRequestQueue
from vllm.v1.request import Request, RequestStatus
waiting = object.__new__(Request)
waiting.request_id, waiting.status, waiting.num_computed_tokens = "w", RequestStatus.WAITING, 0
queue_ = FCFSRequestQueue(); queue_.append(waiting)
engine.scheduler = types.SimpleNamespace(
    has_requests=lambda: True, requests={"w": waiting}, running=[], waiting=queue_)
engine.step_fn = lambda: ({}, False)
record = engine.__dict__["_mmcache_fix_liveness"]
record.progress = type(record.progress)()
record.progress.added(record.progress.since - 100.0)  # the request came 100 s ago
for _ in range(3):
    core.EngineCoreProc._process_engine_step(engine)
livelock = ping(5)["result"]["progress"]
# The same livelock while a client aborts another waiting request inside a step (vLLM's
# _process_aborts_queue, fed by the input thread) and another between steps (the ABORT
# request): the engine did nothing for either, so the clock keeps running.
def finish_requests(ids, status):
    for rid in [ids] if isinstance(ids, str) else ids:
        request = engine.scheduler.requests.pop(rid, None)
        if request is not None:
            queue_.remove(request)
def waiting_request(rid):
    request = object.__new__(Request)
    request.request_id, request.status, request.num_computed_tokens = rid, RequestStatus.WAITING, 0
    engine.scheduler.requests[rid] = request
    queue_.append(request)
engine.scheduler.finish_requests = finish_requests
engine.aborts_queue = queue.Queue()
for rid in ("in-step", "between"):
    waiting_request(rid)
record.progress = type(record.progress)()
record.progress.added(record.progress.since - 100.0, len(engine.scheduler.requests))
engine.aborts_queue.put_nowait(["in-step"])
engine.step_fn = lambda: (engine._process_aborts_queue(), ({}, False))[1]
core.EngineCoreProc._process_engine_step(engine)
engine.step_fn = lambda: ({}, False)
engine._handle_client_request(T.ABORT, ["between"])
core.EngineCoreProc._process_engine_step(engine)
aborts = dict(ping(11)["result"]["progress"], left=sorted(engine.scheduler.requests))
engine.slow_utility = lambda: during.__setitem__("utility", ping(3)) or "done"
engine._handle_client_request(T.UTILITY, [0, 4, "slow_utility", []])
_, slow = engine.output_queue.get(timeout=5)

# A request the input thread queues while the busy loop, idle for 100 s, does not take it.
engine.scheduler = types.SimpleNamespace(
    has_requests=lambda: False, requests={}, running=[], waiting=FCFSRequestQueue())
record.progress = type(record.progress)()
thread = threading.Thread(target=engine.input_queue.put_nowait, args=((T.ADD, "r"),), name="in")
thread.start(); thread.join()
record.queued_since -= 50.0
record.loop.phase = record.loop.phase._replace(since=record.loop.phase.since - 100.0)
queued = ping(7)["result"]["progress"]
engine.input_queue.get_nowait()  # the busy loop takes it

# A pause or a sleep that waited for in-flight requests runs its work (a sleep: the
# executor offloads the weights) from the idle loop's callbacks; a request queued meanwhile
# waits behind it, as behind a utility call, not in a loop that stopped taking input.
def offload(engine_):
    thread = threading.Thread(
        target=engine.input_queue.put_nowait, args=((T.ADD, "r2"),), name="in")
    thread.start(); thread.join()
    record.queued_since -= 100.0
    during["idle_callbacks"] = ping(12)["result"]
record.loop.phase = record.loop.phase._replace(since=record.loop.phase.since - 100.0)
engine._idle_state_callbacks = [offload]
if hasattr(core.EngineCoreProc, "_notify_idle_state_callbacks"):
    engine._notify_idle_state_callbacks()
    engine.input_queue.get_nowait()  # the busy loop takes it
idle_callbacks = {
    "loop": during["idle_callbacks"]["loop"],
    "queued_s": during["idle_callbacks"]["progress"]["queued_s"],
    "after": ping(13)["result"]["loop"]["state"],
} if "idle_callbacks" in during else None

# A DP rank waiting for its peers, on vLLM's own DPEngineCoreProc and ParallelConfig: the
# all-reduce of its DP state runs with torch's collective made to wait (a peer's step); a
# ping meanwhile. Adopted on this thread, as its busy loop would be.
import torch.distributed
dp = object.__new__(core.DPEngineCoreProc)
dp.input_queue, dp.output_queue = queue.Queue(), queue.Queue()
if hasattr(core, "EngineShutdownState"):
    dp.shutdown_state = core.EngineShutdownState.RUNNING
dp.dp_group = types.SimpleNamespace(size=lambda: 2)
dp.step_counter, dp.dp_sync_interval, dp.pending_pause = 31, 32, False
dp.vllm_config = types.SimpleNamespace(parallel_config=core.ParallelConfig)
plugin.ENGINE_ANSWER.adopt(dp)
collectives = []
def all_reduce(tensor, *args, **kwargs):
    collectives.append(tensor.tolist())
    during["sync"] = ping(8, dp)
torch.distributed.all_reduce = all_reduce
global_unfinished = dp._has_global_unfinished_reqs(True)
dp.model_executor = types.SimpleNamespace(
    execute_dummy_batch=lambda: during.__setitem__("dummy", ping(9, dp)))
dp.execute_dummy_batch()
after_sync = ping(10, dp)["result"]["loop"]["state"]

print(json.dumps({
    "early": {k: early.get(k) for k in ("via", "input_thread", "queued_before_hook")},
    "idle": idle,
    "step": during["step"],
    "utility": during["utility"],
    "slow_reply": slow.utility_output.result.result,
    "livelock": livelock,
    "queued": queued,
    "aborts": aborts,
    "idle_callbacks": idle_callbacks,
    "collectives": collectives,
    "global_unfinished": global_unfinished,
    "sync": during["sync"]["result"]["loop"],
    "dummy": during["dummy"]["result"]["loop"],
    "after_sync": after_sync,
    "internal_errors": sum(f.errors.total for f in plugin.FIXES),
    "queued_for_busy_loop": engine.input_queue.qsize(),
    "identified": identified,
    "patched": sorted(
        f"{e.owner.__name__}.{e.attr}" for e in registry.applied()
        if e.patch_id.startswith("engine-liveness")
    ),
    "client_call_has_engine": accepts_engine(cc.AsyncMPClient._call_utility_async),
    "health_wrapped": getattr(async_llm.AsyncLLM.check_health, "__wrapped__", None) is not None,
    "fixes": {k: v["enabled"] for k, v in vllm_mmcache_fix.status()["fixes"].items()},
}))
"""


@pytest.mark.parametrize("version", VERSIONS)
def test_both_ends_on_the_real_classes(version: str, vllm_venv) -> None:
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
    early = {"via": "busy loop", "input_thread": True, "queued_before_hook": True}
    assert out["early"] == early, out
    idle = out["idle"]
    assert idle["call_id"] == 1 and idle["failure"] is None, out
    answer = idle["result"]
    assert answer["via"] == "input thread" and answer["input_thread"] is True, out
    assert "queued_before_hook" not in answer, out
    assert answer["loop"]["state"] == "idle", out
    assert set(answer["counts"]) >= {"protected", "stalls_cache_eviction", "stalls_busy"}, out
    assert out["step"]["result"]["loop"]["state"] == "step", out
    utility = out["utility"]["result"]["loop"]
    assert utility["state"] == "utility" and utility["detail"] == "slow_utility", out
    assert out["slow_reply"] == "done", out
    # A waiting request and steps that schedule nothing: no net progress, counted.
    assert out["livelock"]["stalled_s"] >= 99 and out["livelock"]["empty_steps"] == 3, out
    # A client's abort inside a step and one between steps: not progress.
    assert out["aborts"]["left"] == ["w"], out
    assert out["aborts"]["stalled_s"] >= 99 and out["aborts"]["empty_steps"] == 2, out
    # A pause's or sleep's deferred work run by the idle loop: a utility call.
    idle = out["idle_callbacks"]
    assert idle["loop"]["state"] == "utility" and idle["loop"]["detail"] == "idle callbacks", out
    assert idle["queued_s"] == 0 and idle["after"] == "idle", out
    # A request left in the input queue while the loop idles: time without progress.
    assert out["queued"]["queued_s"] >= 49 and out["queued"]["stalled_s"] >= 49, out
    # A DP rank inside the all-reduce or a dummy batch says so (judged by the step bound).
    assert out["collectives"] and out["global_unfinished"] is True, out
    assert out["sync"]["state"] == "sync" and out["sync"]["detail"] == "dp all-reduce", out
    assert out["dummy"]["state"] == "sync" and out["dummy"]["detail"] == "dummy batch", out
    assert out["after_sync"] == "idle", out
    assert out["internal_errors"] == 0, out
    assert out["queued_for_busy_loop"] == 0, out  # no later ping reached the busy loop
    assert out["identified"] == ["EngineCore", "EngineCore"], out  # one per adopted engine
    assert out["patched"] == [
        "AsyncLLM.__init__",
        "AsyncLLM.check_health",
        "EngineCore.abort_requests",
        "EngineCore.execute_dummy_batch",
        "EngineCore.mmcache_fix_ping",
        "EngineCoreProc._handle_client_request",
        "EngineCoreProc._notify_idle_state_callbacks",
        "EngineCoreProc._process_engine_step",
        "EngineCoreProc._process_input_queue",
        "ParallelConfig.has_unfinished_dp",
        "ParallelConfig.sync_dp_state",
    ], out
    assert out["client_call_has_engine"] is True and out["health_wrapped"] is True, out
    assert out["fixes"]["engine-liveness-answer"] is True, out
    assert out["fixes"]["engine-liveness-health"] is True, out
    assert "Invocation of" not in proc.stdout + proc.stderr
