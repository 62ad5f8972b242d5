"""Test-only injections into a vLLM server; the plugin is not used.

See ``harness.inside_vllm.inject``."""

from __future__ import annotations

import os
import runpy
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

STEP_SLEEP = float(os.environ.get("MMCACHE_INJECT_STEP_SLEEP_S") or 0)
UTILITY_SLEEP = float(os.environ.get("MMCACHE_INJECT_UTILITY_SLEEP_S") or 0)
BUSY_LOOP_DELAY = float(os.environ.get("MMCACHE_INJECT_BUSY_LOOP_DELAY_S") or 0)
FORK = os.environ.get("MMCACHE_INJECT_FORK") == "1"
TRIGGERS = Path(os.environ["MMCACHE_INJECT_DIR"]) if os.environ.get("MMCACHE_INJECT_DIR") else None
STUCK_STEP_MAX_S = 900.0


def _say(text: str) -> None:
    print(f"[inject] pid={os.getpid()} {text}", file=sys.stderr, flush=True)


def _engine_core(module: ModuleType) -> None:
    proc = getattr(module, "EngineCoreProc", None)
    core = getattr(module, "EngineCore", None)
    if proc is not None and (STEP_SLEEP or TRIGGERS is not None):
        step = proc._process_engine_step

        def _process_engine_step(self: Any, *args: Any, **kwargs: Any) -> Any:
            if TRIGGERS is not None and (TRIGGERS / "stuck-step").exists():
                _say("step stuck until the trigger file goes")
                end = time.monotonic() + STUCK_STEP_MAX_S
                while (TRIGGERS / "stuck-step").exists() and time.monotonic() < end:
                    time.sleep(0.1)
                _say("stuck step returns")
            if STEP_SLEEP:
                time.sleep(STEP_SLEEP)
            slow = _trigger_seconds("slow-steps")
            if slow:
                time.sleep(slow)
            return step(self, *args, **kwargs)

        proc._process_engine_step = _process_engine_step
        _say(f"EngineCore steps: +{STEP_SLEEP:g} s, stuck-step trigger {TRIGGERS}")
    if proc is not None and BUSY_LOOP_DELAY:
        run = proc.run_busy_loop

        def run_busy_loop(self: Any, *args: Any, **kwargs: Any) -> Any:
            _pause(BUSY_LOOP_DELAY, f"busy loop starts {BUSY_LOOP_DELAY:g} s after ready")
            return run(self, *args, **kwargs)

        proc.run_busy_loop = run_busy_loop
    if proc is not None and TRIGGERS is not None:
        take = proc._process_input_queue

        def _process_input_queue(self: Any, *args: Any, **kwargs: Any) -> Any:
            stuck = TRIGGERS / "input-stuck"
            if stuck.exists() and not self.scheduler.has_requests():
                _say("busy loop blocked before it takes its input queue, until the file goes")
                end = time.monotonic() + STUCK_STEP_MAX_S
                while stuck.exists() and time.monotonic() < end:
                    time.sleep(0.1)
                _say("busy loop takes its input queue again")
            out = take(self, *args, **kwargs)
            path = TRIGGERS / "dp-stuck"
            if (
                path.exists()
                and getattr(self, "engine_index", 0) == 1
                and self.scheduler.has_requests()
            ):
                _say("DP rank 1 blocked outside a step with requests taken, until the file goes")
                end = time.monotonic() + STUCK_STEP_MAX_S
                while path.exists() and time.monotonic() < end:
                    time.sleep(0.1)
                _say("DP rank 1 goes on")
            return out

        proc._process_input_queue = _process_input_queue
    if core is not None and (UTILITY_SLEEP or TRIGGERS is not None):
        reset = core.reset_prefix_cache

        def reset_prefix_cache(self: Any, *args: Any, **kwargs: Any) -> Any:
            seconds = UTILITY_SLEEP or _trigger_seconds("slow-utility")
            _pause(seconds, f"reset_prefix_cache sleeps {seconds:g} s")
            return reset(self, *args, **kwargs)

        core.reset_prefix_cache = reset_prefix_cache


def _trigger_seconds(name: str) -> float:
    """The seconds written in trigger file ``name`` (0 when it is absent or unreadable)."""
    if TRIGGERS is None:
        return 0.0
    try:
        return float((TRIGGERS / name).read_text() or 0)
    except (OSError, ValueError):
        return 0.0


def _pause(seconds: float, text: str) -> None:
    """Say ``text`` and sleep ``seconds``, when they are not 0."""
    if seconds:
        _say(text)
        time.sleep(seconds)


def _burn(seconds: float) -> int:
    """Pure-Python work in one frame for ``seconds`` (a tokenizer-like loop)."""
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        n += sum(range(500))
    return n


def _async_llm(module: ModuleType) -> None:
    cls = getattr(module, "AsyncLLM", None)
    if cls is None or TRIGGERS is None:
        return
    generate = cls.generate

    def generate_wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        path = TRIGGERS / "burn-api"
        if path.exists():
            try:
                seconds = float(path.read_text() or 15)
                path.unlink()
            except (OSError, ValueError):
                seconds = 0.0
            if seconds:
                _say(f"API server request path burns {seconds:g} s of CPU")
                _burn(seconds)
                _say("burn done")
        return generate(self, *args, **kwargs)

    cls.generate = generate_wrapper


def _is_ping_answer(value: Any) -> bool:
    return isinstance(value, dict) and "schema" in value and "via" in value and "pid" in value


def _core_client(module: ModuleType) -> None:
    """While ``drop-pings`` exists, the API server drops the answers to the plugin's
    heartbeat pings as they arrive (what vLLM's ROUTER does to the replies of an engine that
    reconnects): the call's future is never resolved."""
    process = getattr(module, "_process_utility_output", None)
    if process is None or TRIGGERS is None:
        return
    dropped = [0]

    def _process_utility_output(output: Any, utility_results: Any) -> Any:
        if (TRIGGERS / "drop-pings").exists():
            result = getattr(getattr(output, "result", None), "result", None)
            if _is_ping_answer(result):
                dropped[0] += 1
                _say(f"ping answer dropped ({dropped[0]} so far)")
                return None
        return process(output, utility_results)

    module._process_utility_output = _process_utility_output  # type: ignore[attr-defined]


def _schedule_hiding(
    self: Any, schedule: Callable[..., Any], args: Any, kwargs: Any, *, running: bool = False
) -> Any:
    """vLLM's ``schedule`` run with the waiting queue (and, with ``running``, the running
    list) made empty for the call: it schedules none of them, and they are back after."""
    held_running, held_waiting = self.running, self.waiting
    self.waiting = type(held_waiting)()
    if running:
        self.running = []
    try:
        return schedule(self, *args, **kwargs)
    finally:
        self.running, self.waiting = held_running, held_waiting


def _scheduler(module: ModuleType) -> None:
    """While ``livelock`` exists, the scheduler schedules nothing (it sees no running and no
    waiting request), as when it cannot fit a request: the busy loop keeps turning with empty
    steps and EngineCore answers every ping (the zero-token livelock, vllm#40707)."""
    cls = getattr(module, "Scheduler", None)
    if cls is None or TRIGGERS is None:
        return
    schedule = cls.schedule
    said = [False]

    def schedule_wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not (TRIGGERS / "livelock").exists():
            said[0] = False
            return schedule(self, *args, **kwargs)
        if not said[0]:
            said[0] = True
            _say("livelock: the scheduler schedules nothing until the trigger file goes")
        return _schedule_hiding(self, schedule, args, kwargs, running=True)

    cls.schedule = schedule_wrapper
    _remote_kv(module, cls)
    _preempt(module, cls)


def _preempt(module: ModuleType, cls: Any) -> None:
    """While ``preempt`` exists, each running request is preempted after every step with
    vLLM's own ``_preempt_request`` (blocks freed, computed tokens back to 0, to the front
    of the waiting queue), and the next step leaves it waiting, as vLLM leaves a request it
    preempted in a step; the step after resumes it from 0. Recomputed over and over, never
    past its first chunk (the preemption cascade, vllm#49674)."""
    update = getattr(cls, "update_from_output", None)
    status_cls: Any = getattr(sys.modules.get("vllm.v1.request"), "RequestStatus", None)
    if update is None or status_cls is None or not hasattr(cls, "_preempt_request"):
        return
    schedule = cls.schedule
    count = [0]
    held = [False]

    def update_from_output(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = update(self, *args, **kwargs)
        assert TRIGGERS is not None
        if (TRIGGERS / "preempt").exists():
            for request in [r for r in self.running if r.status == status_cls.RUNNING]:
                self.running.remove(request)
                self._preempt_request(request, time.monotonic())
                held[0] = True
                count[0] += 1
                if count[0] in (1, 10, 100) or count[0] % 1000 == 0:
                    _say(f"preempt: {count[0]} preemption(s) so far")
        return out

    def schedule_wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not held[0]:
            return schedule(self, *args, **kwargs)
        held[0] = False
        return _schedule_hiding(self, schedule, args, kwargs)

    cls.update_from_output = update_from_output
    cls.schedule = schedule_wrapper


def _remote_kv(module: ModuleType, cls: Any) -> None:
    """While ``remote-kv`` exists, every waiting request is put in vLLM's
    ``WAITING_FOR_REMOTE_KVS`` state and left in the waiting queue unscheduled, as with a KV
    connector whose transfer has not arrived; running requests go on. Once the file goes,
    they are ``WAITING`` again and served."""
    status_cls: Any = getattr(sys.modules.get("vllm.v1.request"), "RequestStatus", None)
    remote = getattr(status_cls, "WAITING_FOR_REMOTE_KVS", None)
    if status_cls is None or remote is None:
        return
    schedule = cls.schedule
    parked: dict[str, Any] = {}

    def schedule_wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        assert TRIGGERS is not None
        if not (TRIGGERS / "remote-kv").exists():
            if parked:
                for request in parked.values():
                    if request.status == remote:
                        request.status = status_cls.WAITING
                _say(f"remote-kv: {len(parked)} request(s) waiting again")
                parked.clear()
            return schedule(self, *args, **kwargs)
        for request in list(self.waiting):
            if request.request_id not in parked and request.status == status_cls.WAITING:
                request.status = remote
                parked[request.request_id] = request
                _say(f"remote-kv: request {request.request_id} waits for remote KV")
        return _schedule_hiding(self, schedule, args, kwargs)

    cls.schedule = schedule_wrapper


def _structured_output(module: ModuleType) -> None:
    """While ``slow-grammar`` exists (its text: seconds), compiling a request's grammar takes
    that much longer (in vLLM's grammar thread pool; the request waits for its grammar)."""
    cls = getattr(module, "StructuredOutputManager", None)
    if cls is None or TRIGGERS is None or not hasattr(cls, "_create_grammar"):
        return
    create = cls._create_grammar

    def _create_grammar(self: Any, *args: Any, **kwargs: Any) -> Any:
        seconds = _trigger_seconds("slow-grammar")
        _pause(seconds, f"grammar compilation takes {seconds:g} s longer")
        return create(self, *args, **kwargs)

    cls._create_grammar = _create_grammar


def _cpu_platform(module: ModuleType) -> None:
    cls = getattr(module, "CpuPlatform", None)
    if cls is None or not FORK:
        return
    check = cls.check_and_update_config.__func__

    def check_and_update_config(klass: Any, vllm_config: Any) -> None:
        check(klass, vllm_config)
        if os.environ.get("VLLM_WORKER_MULTIPROC_METHOD") == "spawn":
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"
            _say("VLLM_WORKER_MULTIPROC_METHOD=fork (the CPU platform had forced spawn)")

    cls.check_and_update_config = classmethod(check_and_update_config)


TARGETS: dict[str, Callable[[ModuleType], None]] = {
    "vllm.v1.engine.core": _engine_core,
    "vllm.v1.engine.async_llm": _async_llm,
    "vllm.v1.engine.core_client": _core_client,
    "vllm.v1.core.sched.scheduler": _scheduler,
    "vllm.v1.structured_output": _structured_output,
    "vllm.platforms.cpu": _cpu_platform,
}


if FORK:
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"
_HOOKS = Path(__file__).resolve().parents[2] / "import_hook.py"
runpy.run_path(str(_HOOKS))["after_import"](TARGETS)

# Another sitecustomize later on the path (harness.inside_vllm.cpu_mrope's) still runs.
_here = Path(__file__).resolve().parent
for _entry in sys.path:
    _other = Path(_entry or ".") / "sitecustomize.py"
    if _other.is_file() and _other.resolve().parent != _here:
        runpy.run_path(str(_other))
        break
