"""The stall sentinel in a real process: real threads, real ``/proc``, real timing.

Each case runs a small Python program in a subprocess that installs the
sentinel as the plugin does (``StallSentinelFix().install()``, threshold from
``MMCACHE_FIX_STALL_SECONDS``), with the plugin's logger writing to stderr, and then
identifies the process as an API server as the engine heartbeat does
(``signals.API_SERVER_SERVING``): the sentinel runs only where a process is identified.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from harness.paths import REPO_ROOT
from vllm_mmcache_fix.core.messages import (
    BUSY,
    INTERNAL_ERROR,
    PREFIX,
    STALL,
    STALL_SENTINEL_ACTIVE,
)
from vllm_mmcache_fix.core.settings import (
    DEFAULT_STALL_SECONDS,
    ENV_STALL_SECONDS,
    read_stall_seconds,
)
from vllm_mmcache_fix.stall_sentinel.detect import StackLine, in_cache_eviction

PRELUDE = textwrap.dedent(
    """
    import json, logging, sys, threading, time
    logger = logging.getLogger("vllm")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    from vllm_mmcache_fix.stall_sentinel.fix import StallSentinelFix

    class Spinner:
        def __init__(self):
            self.running = True
            self.data = {}

        def spin_here(self, seconds):
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                self.data[len(self.data) % 64] = len(self.data)

        def run(self, plan):
            for kind, seconds in plan:
                if kind == "spin":
                    self.spin_here(seconds)
                else:
                    time.sleep(seconds)

    sentinel = StallSentinelFix()
    sentinel.install()
    from vllm_mmcache_fix.core import signals
    if IDENTIFY:
        signals.API_SERVER_SERVING.send()
    """
)


def _run(
    body: str, env: dict[str, str], timeout: float = 60.0, identify: bool = True
) -> tuple[dict, str]:
    code = (
        f"IDENTIFY = {identify}\n"
        + PRELUDE
        + textwrap.dedent(body)
        + "\nprint(json.dumps(sentinel.status()))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=str(REPO_ROOT),
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT), **env},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def _stall_records(stderr: str) -> list[str]:
    """Each WARNING record of a stall (the cache's or a busy call), with its stack lines."""
    records: list[str] = []
    for line in stderr.splitlines():
        if line.startswith(("WARNING " + PREFIX + STALL, "WARNING " + PREFIX + BUSY)):
            records.append(line)
        elif line.startswith("    ") and records:
            records[-1] += "\n" + line
    return records


@pytest.mark.realtime
def test_a_thread_spinning_in_one_function_gets_one_warning_with_its_stack() -> None:
    status, err = _run(
        """
        spinner = Spinner()
        t = threading.Thread(target=spinner.run, args=([("spin", 10.0)],), name="spinner")
        t.start(); t.join()
        time.sleep(1.5)
        """,
        {ENV_STALL_SECONDS: "2"},
    )
    records = _stall_records(err)
    assert len(records) == 1, err
    record = records[0]
    assert "thread 'spinner'" in record, record
    stack = record.split("innermost first:", 1)[1].strip().splitlines()
    assert "spin_here" in stack[0], record  # the innermost frame is the spinning function
    assert any(" run" in line or "Spinner.run" in line for line in stack), record
    assert "<string>:" in stack[0], record  # file:line
    assert "% CPU" in record and "voluntary switches +" in record and "involuntary +" in record
    assert STALL_SENTINEL_ACTIVE in err
    assert status["stalls"] == 1 and status["running"] is True
    assert status["last_stall"]["thread"] == "spinner"
    assert status["samples"] >= 6


@pytest.mark.realtime
def test_a_thread_that_moves_on_and_stalls_again_is_reported_again() -> None:
    status, err = _run(
        """
        spinner = Spinner()
        plan = [("spin", 7.0), ("sleep", 2.5), ("spin", 7.0)]
        t = threading.Thread(target=spinner.run, args=(plan,), name="spinner")
        t.start(); t.join()
        """,
        {ENV_STALL_SECONDS: "2"},
    )
    assert len(_stall_records(err)) == 2, err
    assert status["stalls"] == 2


@pytest.mark.realtime
def test_idle_sleeping_and_blocked_threads_are_not_reported() -> None:
    status, err = _run(
        """
        lock = threading.Lock(); lock.acquire()
        event = threading.Event()
        threads = [
            threading.Thread(target=time.sleep, args=(6,), name="sleeper"),
            threading.Thread(target=lock.acquire, name="blocked"),
            threading.Thread(target=event.wait, args=(6,), name="waiter"),
        ]
        for t in threads: t.start()
        threads[0].join(); lock.release(); event.set()
        for t in threads: t.join()
        """,
        {ENV_STALL_SECONDS: "2"},
    )
    assert _stall_records(err) == [], err
    assert status["stalls"] == 0 and status["samples"] >= 5 and status["running"]


@pytest.mark.realtime
def test_a_busy_thread_that_blocks_often_is_not_reported() -> None:
    """CPU-bound bursts with a blocking wait in between: voluntary switches are not flat."""
    status, err = _run(
        """
        def worker():
            end = time.monotonic() + 6
            ev = threading.Event()
            while time.monotonic() < end:
                x = 0
                for i in range(20000): x += i
                ev.wait(0.002)
        t = threading.Thread(target=worker, name="bursty"); t.start(); t.join()
        """,
        {ENV_STALL_SECONDS: "2"},
    )
    assert _stall_records(err) == [], err
    assert status["stalls"] == 0


@pytest.mark.realtime
def test_injected_fault_stops_the_sentinel_after_one_line_and_the_program_goes_on() -> None:
    status, err = _run(
        """
        spinner = Spinner()
        t = threading.Thread(target=spinner.run, args=([("spin", 4.5)],), name="spinner")
        t.start(); t.join()
        print("program finished", file=sys.stderr)
        """,
        {ENV_STALL_SECONDS: "2", "MMCACHE_FIX_FAIL_AT": "stall.sample"},
    )
    plugin_lines = [line for line in err.splitlines() if PREFIX in line]
    errors = [line for line in plugin_lines if INTERNAL_ERROR in line]
    assert len(errors) == 1, err
    assert "stall.sample" in errors[0]
    assert _stall_records(err) == []
    assert "program finished" in err
    assert status["running"] is False and status["stalls"] == 0
    assert "stall.sample" in status["stopped_reason"]
    assert status["internal_errors"] == {"stall.sample": 1}


@pytest.mark.realtime
def test_an_exception_inside_the_sampler_stops_it_quietly() -> None:
    status, err = _run(
        """
        from vllm_mmcache_fix.stall_sentinel import detect
        def broken(self):
            raise RuntimeError("sampler broke")
        detect.Detector.sample = broken
        spinner = Spinner()
        t = threading.Thread(target=spinner.run, args=([("spin", 3.5)],), name="spinner")
        t.start(); t.join()
        """,
        {ENV_STALL_SECONDS: "1"},
    )
    tracebacks = err.count("RuntimeError: sampler broke")
    errors = [line for line in err.splitlines() if PREFIX in line and INTERNAL_ERROR in line]
    assert len(errors) == 1 and tracebacks >= 1, err
    assert status["running"] is False
    assert "sampler broke" in status["stopped_reason"]


def test_zero_turns_it_off() -> None:
    status, err = _run("time.sleep(1.5)\n", {ENV_STALL_SECONDS: "0"})
    assert status["enabled"] is False and status["running"] is False
    assert f"{ENV_STALL_SECONDS}=0" in status["not_enabled_reason"]


def test_mode_off_turns_it_off() -> None:
    status, _ = _run("time.sleep(0.2)\n", {"MMCACHE_FIX_MODE": "off"})
    assert status["enabled"] is False and status["running"] is False


@pytest.mark.parametrize("raw", ["ten", "-3", "nan", "inf"])
def test_bad_threshold_uses_the_default_with_one_sentence(raw: str) -> None:
    setting = read_stall_seconds({ENV_STALL_SECONDS: raw})
    assert setting.value == DEFAULT_STALL_SECONDS
    assert setting.problem is not None and ENV_STALL_SECONDS in setting.problem


def test_bad_threshold_in_a_process_warns_and_runs_with_the_default() -> None:
    status, err = _run("time.sleep(1.5)\n", {ENV_STALL_SECONDS: "soon"})
    assert status["threshold_s"] == DEFAULT_STALL_SECONDS and status["running"]
    assert any(ENV_STALL_SECONDS in line and "WARNING" in line for line in err.splitlines()), err


def test_good_thresholds() -> None:
    assert read_stall_seconds({}).value == DEFAULT_STALL_SECONDS
    assert read_stall_seconds({ENV_STALL_SECONDS: " 2.5 "}).value == 2.5
    assert read_stall_seconds({ENV_STALL_SECONDS: "0"}).value == 0


@pytest.mark.realtime
def test_an_unidentified_process_runs_no_sentinel() -> None:
    """A user's ``LLM(...)`` script, a launcher, a worker: installed, never started."""
    status, err = _run(
        """
        spinner = Spinner()
        t = threading.Thread(target=spinner.run, args=([("spin", 4.0)],), name="spinner")
        t.start(); t.join()
        """,
        {ENV_STALL_SECONDS: "1"},
        identify=False,
    )
    assert status["enabled"] is True and status["running"] is False
    assert status["samples"] == 0 and _stall_records(err) == []
    assert STALL_SENTINEL_ACTIVE not in err


@pytest.mark.realtime
def test_a_long_call_elsewhere_is_reported_as_busy_not_as_the_cache_bug() -> None:
    status, err = _run(
        """
        spinner = Spinner()
        t = threading.Thread(target=spinner.run, args=([("spin", 5.0)],), name="tokenizer")
        t.start(); t.join()
        from vllm_mmcache_fix.core import counters
        print(json.dumps({"busy": counters.stalls("busy"),
                          "cache": counters.stalls("cache_eviction")}), file=sys.stderr)
        """,
        {ENV_STALL_SECONDS: "2"},
    )
    records = _stall_records(err)
    assert len(records) == 1, err
    assert records[0].startswith("WARNING " + PREFIX + BUSY + " for "), records[0]
    assert "not the multimodal cache" in records[0] and "43941" not in records[0]
    assert status["last_stall"]["cause"] == "busy"
    assert '{"busy": 1, "cache": 0}' in err


CACHE_BODY = '''
import os, sys, tempfile
root = tempfile.mkdtemp()
os.makedirs(os.path.join(root, "cachetools"))
with open(os.path.join(root, "cachetools", "__init__.py"), "w") as f:
    f.write("""
import time
class Cache:
    def __setitem__(self, key, value):
        while self.popitem():
            pass
    def popitem(self):
        return time.monotonic() < self.until
""")
sys.path.insert(0, root)
import cachetools
cache = cachetools.Cache()
cache.until = time.monotonic() + 5.0
t = threading.Thread(target=cache.__setitem__, args=(1, 2), name="input")
t.start(); t.join()
'''


@pytest.mark.realtime
def test_a_stall_in_the_caches_eviction_names_the_bug() -> None:
    """A spin in ``popitem`` called by ``__setitem__``, both in cachetools' files."""
    status, err = _run(CACHE_BODY, {ENV_STALL_SECONDS: "2"})
    records = _stall_records(err)
    assert len(records) == 1, err
    assert records[0].startswith("WARNING " + PREFIX + STALL + " API server"), records[0]
    # Python 3.11+ names frames by their qualified name; older ones by the function's.
    frame = "Cache.popitem" if sys.version_info >= (3, 11) else " popitem"
    assert "vllm#43941" in records[0] and frame in records[0], records[0]
    assert status["last_stall"]["cause"] == "cache_eviction"


def _stack(*frames: tuple[str, str]) -> list[StackLine]:
    return [StackLine(file, 1, function) for function, file in frames]


def test_the_eviction_rule_needs_the_frame_its_caller_and_the_lru_files() -> None:
    site = "/venv/lib/python3.11/site-packages"
    frozen = _stack(
        ("LRUCache.popitem", f"{site}/vllm/utils/cache.py"),
        ("Cache.__setitem__", f"{site}/cachetools/__init__.py"),
        ("EngineCore.preprocess_add_request", f"{site}/vllm/v1/engine/core.py"),
    )
    assert in_cache_eviction(frozen)
    assert in_cache_eviction(
        _stack(
            ("LRUCache.popitem", f"{site}/vllm/utils/__init__.py"),
            ("LRUCache.clear", f"{site}/vllm/utils/__init__.py"),
        )
    )
    assert not in_cache_eviction(frozen[:1])  # popitem with no caller on the stack
    assert not in_cache_eviction(
        _stack(("popitem", "/app/mine.py"), ("__setitem__", "/app/mine.py"))
    )
    assert not in_cache_eviction(
        _stack(("burn", "/app/x.py"), ("Tokenizer.encode", f"{site}/tokenizers/x.py"))
    )


FORK_BODY = """
import multiprocessing as mp

class LRUCache:
    def popitem(self):
        end = time.monotonic() + 12
        while time.monotonic() < end:
            pass

def child(identified):
    from vllm_mmcache_fix.core import signals
    if identified:
        signals.ENGINE_CORE_RUNNING.send()  # what an EngineCore's busy loop sends
    LRUCache().popitem()

ctx = mp.get_context("fork")
for name, identified in (("EngineCore", True), ("VllmWorker-0", False)):
    p = ctx.Process(target=child, args=(identified,), name=name)
    p.start(); p.join(30)
    assert p.exitcode == 0, p.exitcode
"""


@pytest.mark.realtime
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_engine_core_gets_its_own_sentinel_and_a_forked_worker_none() -> None:
    """vLLM forks EngineCore from the API server and calls no plugin again there: the child
    inherits no thread, and starts its own once its busy loop identifies it."""
    status, err = _run(FORK_BODY, {ENV_STALL_SECONDS: "2"}, timeout=90)
    records = _stall_records(err)
    assert len(records) == 1, err
    assert "in EngineCore pid=" in records[0], records[0]
    assert "popitem" in records[0], records[0]
    active = [line for line in err.splitlines() if STALL_SENTINEL_ACTIVE in line]
    assert len(active) == 2, err  # the parent and the EngineCore child, not the worker
    assert status["stalls"] == 0  # the parent saw none of its own


def _driven_detector(
    thread: threading.Thread, shown: Callable[[float], Any] | None = None
) -> tuple[Any, list, list[float], list[int]]:
    """A detector on a clock and CPU counters the test moves: (detector, stalls, now, ticks).

    ``thread`` shows ``ticks[0]`` clock ticks of CPU (or ``shown(now)``, its counters at the
    test clock's time); every other thread none.
    """
    from vllm_mmcache_fix.core.procfs import ThreadCounters
    from vllm_mmcache_fix.stall_sentinel.detect import Detector

    now, ticks = [0.0], [0]

    def counters(native_id: int) -> ThreadCounters:
        if native_id == thread.native_id:
            return shown(now[0]) if shown else ThreadCounters(ticks[0], 0, 0, None)
        return ThreadCounters(0, 0, 0, None)

    stalls: list = []
    detector = Detector(
        threshold_s=2.0,
        on_stall=stalls.append,
        read_counters=counters,
        clock=lambda: now[0],
        ignore_idents={threading.get_ident()},
    )
    return detector, stalls, now, ticks


def _intervals(detector: Any, now: list[float], ticks: list[int], busy_plan: list[bool]) -> None:
    """One sample per entry of ``busy_plan``, each 1 s of the test's clock after the last;
    the driven thread shows a whole second of CPU in the busy ones."""
    from vllm_mmcache_fix.stall_sentinel.detect import CLOCK_TICKS

    for busy in busy_plan:
        time.sleep(0.05)  # the thread's short waits end and begin again between samples
        now[0] += 1.0
        ticks[0] += int(CLOCK_TICKS) if busy else 0
        detector.sample()


def _staying_thread(name: str) -> tuple[threading.Event, threading.Thread]:
    """A started thread that stays inside one call (short waits) until the event is set."""
    stop = threading.Event()

    def stay_here() -> None:
        while not stop.is_set():
            stop.wait(0.01)

    thread = threading.Thread(target=stay_here, name=name)
    thread.start()
    return stop, thread


def test_a_starved_interval_after_the_warning_does_not_start_a_second_one() -> None:
    """The thread stays in its call; one interval shows it idle (the core went elsewhere)."""
    stop, thread = _staying_thread("stays")
    try:
        busy_plan = [True] * 4 + [False] + [True] * 6
        detector, stalls, now, ticks = _driven_detector(thread)
        detector.sample()
        _intervals(detector, now, ticks, busy_plan)
        assert [s.thread_name for s in stalls] == ["stays"]
    finally:
        stop.set()
        thread.join()


def test_the_report_names_the_loop_when_the_stall_began_in_its_caller() -> None:
    """The first sample catches the thread in the caller, before it enters the loop."""
    go, stop = threading.Event(), threading.Event()
    counter = [0]

    def step() -> None:
        counter[0] += 1

    def spin_in_loop() -> None:
        while not stop.is_set():
            step()

    def caller() -> None:
        go.wait()
        spin_in_loop()

    thread = threading.Thread(target=caller, name="loops")
    thread.start()
    try:
        detector, stalls, now, ticks = _driven_detector(thread)
        time.sleep(0.05)
        detector.sample()  # in caller, waiting for ``go``
        go.set()
        _intervals(detector, now, ticks, [True] * 4)
        assert len(stalls) == 1, stalls
        assert stalls[0].anchor_function.endswith("spin_in_loop"), stalls[0]
    finally:
        stop.set()
        thread.join()


def test_a_sample_keeps_nothing_alive_of_a_call_that_returned() -> None:
    """A forward pass's tensors must be freed when it returns, not at the next sample."""
    import gc
    import weakref

    from vllm_mmcache_fix.core.procfs import ThreadCounters
    from vllm_mmcache_fix.stall_sentinel.detect import Detector

    class Tensor:
        pass

    inside, leave, left, stop = (threading.Event() for _ in range(4))
    refs: list[weakref.ref] = []

    def forward() -> None:
        activations = Tensor()
        refs.append(weakref.ref(activations))
        inside.set()
        leave.wait()

    def loop() -> None:
        while not stop.is_set():
            forward()
            left.set()
            stop.wait()

    thread = threading.Thread(target=loop, name="engine")
    thread.start()
    try:
        detector = Detector(
            threshold_s=2.0,
            on_stall=lambda stall: None,
            read_counters=lambda native_id: ThreadCounters(0, 0, 0, None),
            ignore_idents={threading.get_ident()},
        )
        detector.sample()
        assert inside.wait(5)
        detector.sample()  # the second sample, inside ``forward``
        detector.sample()
        leave.set()
        assert left.wait(5)
        gc.collect()
        assert refs[0]() is None, "the sentinel kept a returned call's locals alive"
    finally:
        leave.set()
        stop.set()
        thread.join()


def test_the_report_keeps_the_callers_of_a_generator_the_loop_keeps_starting() -> None:
    """vLLM's ``LRUCache.popitem`` scans its order in a generator expression, a new one per
    call: the report must show the stack as it was seen, not as the generator has it later
    (finished, with no caller)."""
    stop = threading.Event()
    order = list(range(500))
    data: dict[int, int] = {}

    def popitem() -> int | None:
        return next((key for key in order if key in data), None)

    def setitem() -> None:
        while not stop.is_set():
            popitem()

    thread = threading.Thread(target=setitem, name="evicts")
    thread.start()
    try:
        detector, stalls, now, ticks = _driven_detector(thread)
        _intervals(detector, now, ticks, [True] * 4)
        assert len(stalls) == 1, stalls
        stall = stalls[0]
        functions = [line.function for line in stall.stack]
        assert stall.anchor_function.endswith("setitem"), (stall.anchor_function, functions)
        assert any(f.endswith("setitem") for f in functions), functions
        assert stall.frames_total == len(stall.stack) >= 3, functions
    finally:
        stop.set()
        thread.join()


@pytest.mark.parametrize(("voluntary_per_s", "reported"), [(49, False), (2, True)])
def test_a_starved_thread_is_reported_only_if_it_hardly_ever_blocks(
    voluntary_per_s: int, reported: bool
) -> None:
    """5% CPU and 94% on a CPU or waiting for one (a loaded machine): a thread that blocks
    49 times a second is waiting on something, not spinning; one that blocks twice a second
    (its GIL hand-offs) is spinning on a core it rarely gets."""
    from vllm_mmcache_fix.core.procfs import ThreadCounters
    from vllm_mmcache_fix.stall_sentinel.detect import CLOCK_TICKS

    def shown(now: float) -> ThreadCounters:
        n = int(now)
        ticks = int(0.05 * CLOCK_TICKS * n)
        return ThreadCounters(ticks, voluntary_per_s * n, 300 * n, int(0.94e9 * n))

    stop, thread = _staying_thread("starved")
    detector, stalls, now, _ = _driven_detector(thread, shown)
    try:
        for _ in range(6):
            detector.sample()
            time.sleep(0.02)
            now[0] += 1.0
    finally:
        stop.set()
        thread.join()
    assert bool(stalls) is reported, stalls
