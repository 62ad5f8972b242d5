"""``diagnose`` on real processes that need nothing downloaded: other spins, stops, sleeps.

The real 0.23.0 cache hang is in ``tests/realsrc/test_diagnose_real.py``.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.children import (
    BUSY,
    SLEEPER,
    Children,
    as_user,
    assert_serialisable,
    dead_pid,
    hot_thread,
    only,
    read_line,
    time_limit,
    wait_for_state,
)
from vllm_mmcache_fix.tools.diagnose import (
    EXIT_CODES,
    Classification,
    DiagnoseError,
    ThreadReport,
    classify_process,
    diagnose,
    find_py_spy,
    parse_py_spy_dump,
    render,
    stack_in_mm_cache,
    thread_is_blocked,
    thread_is_spinning,
)
from vllm_mmcache_fix.tools.diagnose import run as diagnose_run

C = Classification
INTERVAL = 1.0
TEST_TIMEOUT = 120  # seconds per test, enforced with SIGALRM

PY_SPY = find_py_spy()
needs_py_spy = pytest.mark.skipif(PY_SPY is None, reason="py-spy not installed")


@pytest.fixture(autouse=True)
def _time_limit() -> Iterator[None]:
    with time_limit(TEST_TIMEOUT):
        yield


def _dead_pid() -> int:
    pid = dead_pid()
    if pid is None:
        pytest.skip("PID reused at once")
    return pid


# --------------------------------------------------------------------------- (2) elsewhere


@needs_py_spy
def test_busy_loop_elsewhere(children: Children) -> None:
    """On every Python: below 3.11 the stacks come from a dump that pauses the process (the
    one without pausing names threads by pthread id there)."""
    proc = children.start(BUSY)
    assert read_line(proc) == "spinning"
    time.sleep(0.2)

    d = diagnose(proc.pid, interval=INTERVAL)

    assert d.classification is C.SPINNING_ELSEWHERE, render(d)
    hot = hot_thread(only(d, proc.pid))
    assert hot.python_name == "busy_loop"
    assert hot.in_mm_cache is False
    assert hot.stack and "busy" in hot.stack[0]
    assert "not in the multimodal cache" in d.remedy
    assert_serialisable(d)


def test_busy_loop_without_stacks_only_matches_signature(children: Children) -> None:
    proc = children.start(BUSY)
    assert read_line(proc) == "spinning"
    time.sleep(0.2)

    d = diagnose(proc.pid, interval=INTERVAL, use_py_spy=False)

    assert d.classification is C.SPINNING, render(d)
    assert "stack not checked" in only(d, proc.pid).reason


# --------------------------------------------------------------------------- (3) blocked


def test_stopped_process_is_blocked(children: Children) -> None:
    proc = children.start(SLEEPER)
    assert read_line(proc) == "ready"
    os.kill(proc.pid, signal.SIGSTOP)
    wait_for_state(proc.pid, "T")
    try:
        d = diagnose(proc.pid, interval=INTERVAL)
    finally:
        os.kill(proc.pid, signal.SIGCONT)

    assert d.classification is C.BLOCKED, render(d)
    report = only(d, proc.pid)
    assert all(t.blocked and set(t.states) == {"T"} for t in report.threads)
    assert not any(t.spinning for t in report.threads)
    assert "kill -CONT" in d.remedy
    assert d.exit_code == EXIT_CODES[C.BLOCKED]


def _thread(states: str, cpu: float = 0.0, voluntary: int = 0, **kw: object) -> ThreadReport:
    report = ThreadReport(
        tid=1,
        name="t",
        python_name=None,
        states=states,
        cpu_seconds=cpu,
        cpu_fraction=cpu,
        runnable_fraction=None,
        voluntary_switches=voluntary,
        nonvoluntary_switches=0,
        syscall=None,
        wchan="io_schedule",
    )
    for key, value in kw.items():
        setattr(report, key, value)
    return report


def test_blocked_rule() -> None:
    # Uninterruptible sleep or stopped in every sample: blocked.
    assert thread_is_blocked("DDDDDDDDDDD")
    assert thread_is_blocked("TTT") and thread_is_blocked("tt") and thread_is_blocked("DTD")
    # Leaving that state once (a disk-heavy but working thread) is not.
    assert not thread_is_blocked("DDDRDDD")
    assert not thread_is_blocked("SSSSSSS")
    assert not thread_is_blocked("D")  # one sample proves nothing

    d_thread = _thread("DDDDD", blocked=True)
    idle = _thread("SSSSS")
    verdict, reason = classify_process([idle, d_thread], 0.0, stack_checked=False)
    assert verdict is C.BLOCKED
    assert "state D" in reason and "io_schedule" in reason
    # A spin outranks a blocked thread in the same process.
    spinner = _thread("RRRRR", cpu=1.0, spinning=True)
    assert classify_process([spinner, d_thread], 1.0, False)[0] is C.SPINNING


def test_spin_rule() -> None:
    assert thread_is_spinning(1.0, None, 0, 2.0)
    assert thread_is_spinning(0.2, 0.98, 2, 2.0)  # starved on a loaded machine
    assert not thread_is_spinning(1.0, 1.0, 50, 2.0)  # blocks often: working, not spinning
    # 2 a second: the plugin's own sentinel sampling a frozen EngineCore (0.23.0, measured).
    assert thread_is_spinning(1.0, 1.0, 8, 4.0)
    assert not thread_is_spinning(0.3, 0.5, 0, 2.0)
    assert not thread_is_spinning(0.3, None, 0, 2.0)


# --------------------------------------------------------------------------- (4) idle


ENGINE_WITHOUT_INPUT_THREAD = """
import ctypes, threading, time
ctypes.CDLL(None).prctl(15, b"VLLM::EngineCor", 0, 0, 0)  # vLLM's title (comm: 15 bytes)

def process_output_sockets():
    time.sleep(300)

threading.Thread(target=process_output_sockets, daemon=True).start()
print("ready", flush=True)
time.sleep(300)  # the busy loop waits for input that no thread reads any more
"""


@needs_py_spy
def test_the_header_names_the_dump_an_input_thread_verdict_rests_on(children: Children) -> None:
    proc = children.start(ENGINE_WITHOUT_INPUT_THREAD)
    assert read_line(proc) == "ready"
    time.sleep(0.2)

    d = diagnose(proc.pid, interval=INTERVAL)

    assert d.classification is C.ENGINE_INPUT_THREAD_GONE, render(d)
    # The verdict comes from py-spy's dump: the header does not say it was not needed.
    assert "not needed" not in d.py_spy and "input thread" in d.py_spy, d.py_spy


def test_sleeping_process_is_idle(children: Children) -> None:
    proc = children.start(SLEEPER)
    assert read_line(proc) == "ready"

    d = diagnose(proc.pid, interval=INTERVAL)

    assert d.classification is C.IDLE, render(d)
    assert d.exit_code == 0
    report = only(d, proc.pid)
    assert report.cpu_fraction <= 0.05
    # Asleep throughout (one sample may catch it on its way into sleep).
    assert all(t.states.count("S") >= len(t.states) - 1 for t in report.threads), render(d)
    assert "no EngineCore process" in " ".join(d.notes)
    assert_serialisable(d)


# --------------------------------------------------------------------------- (5) errors


def test_dead_pid() -> None:
    pid = _dead_pid()
    with pytest.raises(DiagnoseError, match=f"^no process with PID {pid}$"):
        diagnose(pid, interval=INTERVAL)


@pytest.mark.parametrize("bad", [0, -5])
def test_invalid_pid(bad: int) -> None:
    with pytest.raises(DiagnoseError, match="invalid PID"):
        diagnose(bad)


def test_interval_too_short(children: Children) -> None:
    with pytest.raises(DiagnoseError, match="interval"):
        diagnose(os.getpid(), interval=0.0)


@pytest.mark.parametrize("reap", [True, False], ids=["reaped", "zombie"])
def test_exits_mid_sample(children: Children, reap: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    proc = children.start(SLEEPER)
    assert read_line(proc) == "ready"
    watch = diagnose_run._watch_states

    def exit_after_the_first_samples(*args: Any, **kwargs: Any) -> Any:
        # The process ends between the first samples and the sampling interval, however
        # loaded the machine (a child that slept a fixed 0.5 s could be gone before the
        # first sample, and diagnose then rightly says "no process with PID").
        proc.kill()
        if reap:
            proc.wait(timeout=30)
        else:
            stat = Path(f"/proc/{proc.pid}/stat")
            deadline = time.monotonic() + 30
            while ") Z " not in stat.read_text() and time.monotonic() < deadline:
                time.sleep(0.01)
        return watch(*args, **kwargs)

    monkeypatch.setattr(diagnose_run, "_watch_states", exit_after_the_first_samples)

    d = diagnose(proc.pid, interval=INTERVAL)

    assert d.classification is C.EXITED, render(d)
    reason = only(d, proc.pid).reason
    assert ("zombie" in reason) is (not reap)
    assert d.exit_code == EXIT_CODES[C.EXITED]
    assert_serialisable(d)


def _copy_proc_entry(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_bytes(src.read_bytes())
    dst.chmod(0o644)


def test_unreadable_file_is_named(children: Children) -> None:
    """A required /proc file this user may not read (as with ``hidepid``) is named."""
    proc = children.start(SLEEPER)
    assert read_line(proc) == "ready"
    fake = Path(tempfile.mkdtemp(prefix="diag-proc-", dir="/tmp"))
    try:
        fake.chmod(0o755)
        pid = proc.pid
        for name in ("stat", "cmdline", "comm"):
            _copy_proc_entry(Path(f"/proc/{pid}/{name}"), fake / str(pid) / name)
        for name in ("stat", "status", "comm"):
            _copy_proc_entry(
                Path(f"/proc/{pid}/task/{pid}/{name}"), fake / str(pid) / "task" / str(pid) / name
            )
        for directory in (
            fake / str(pid),
            fake / str(pid) / "task",
            fake / str(pid) / "task" / str(pid),
        ):
            directory.chmod(0o755)
        locked = fake / str(pid) / "task" / str(pid) / "status"
        locked.chmod(0)

        def run() -> str:
            try:
                diagnose(pid, interval=0.3, use_py_spy=False, proc_root=fake)
            except DiagnoseError as exc:
                return f"DiagnoseError: {exc}"
            return "no error"

        if os.geteuid() == 0:
            message = as_user(run)  # root reads anything: drop to nobody
        else:
            message = run()
        assert message == (
            f"DiagnoseError: cannot read {locked}: permission denied; "
            "run as the user that runs vLLM, or as root"
        )
    finally:
        shutil.rmtree(fake, ignore_errors=True)


# --------------------------------------------------------------------------- stacks


DUMP = """\
Process 4242: VLLM::EngineCore
Python v3.11.7 (/usr/bin/python3.11)

Thread 4242 (idle): "MainThread"
    Queue.get (/usr/lib/python3.11/queue.py:171)
    EngineCoreProc.run_busy_loop (/venv/lib/python3.11/site-packages/vllm/v1/engine/core.py:810)
Thread 4250 (active+gil): "process_input_sockets"
    LRUCache.pop (/venv/lib/python3.11/site-packages/vllm/utils/cache.py:152)
    LRUCache.popitem (/venv/lib/python3.11/site-packages/vllm/utils/cache.py:205)
    Cache.__setitem__ (/venv/lib/python3.11/site-packages/cachetools/__init__.py:83)
    LRUCache.__setitem__ (/venv/lib/python3.11/site-packages/cachetools/__init__.py:358)
    MultiModalReceiverCache.get_and_update_item (/venv/vllm/multimodal/cache.py:560)
Thread 0x7F00AA (idle)
    run (<string>)
"""


def test_parse_py_spy_dump_and_stack_rule() -> None:
    threads = parse_py_spy_dump(DUMP)
    assert [(t.tid, t.name, t.status) for t in threads] == [
        (4242, "MainThread", "idle"),
        (4250, "process_input_sockets", "active+gil"),
        (None, None, "idle"),
    ]
    main, hot, anon = threads
    assert hot.frames[1] == (
        "LRUCache.popitem",
        "/venv/lib/python3.11/site-packages/vllm/utils/cache.py",
        205,
    )
    assert anon.frames == [("run", "<string>", None)]
    assert stack_in_mm_cache((f, p) for f, p, _ in hot.frames)
    assert not stack_in_mm_cache((f, p) for f, p, _ in main.frames)
    # clear() and remove_oldest() of older layouts evict through popitem as well.
    old = [
        ("popitem", "/x/vllm/utils/__init__.py"),
        ("remove_oldest", "/x/vllm/utils/__init__.py"),
        ("clear", "/x/vllm/utils/__init__.py"),
    ]
    assert stack_in_mm_cache(old)
    # Between two popitem calls there is no popitem frame: not enough on its own.
    assert not stack_in_mm_cache([("Cache.__setitem__", "/x/cachetools/__init__.py")])
    # A popitem of some other class does not count.
    assert not stack_in_mm_cache([("popitem", "/x/app.py"), ("__setitem__", "/x/app.py")])


# --------------------------------------------------------------------------- input thread

# EngineCore's thread layout (``EngineCoreProc`` of vLLM 0.10-0.13: an input thread and an
# output thread started with ``target=self.process_..._sockets``, the busy loop in the main
# thread). On 0.13 and older the input thread ends when a request fails its preprocessing
# (the receiver cache's ``Expected a cached item`` assertion); ``INPUT_DIES`` makes it so.
ENGINE = """
import os, queue, sys, threading, time

with open("/proc/self/comm", "w") as handle:
    handle.write("VLLM::EngineCore")


class EngineCoreProc:
    def __init__(self):
        self.input_queue = queue.Queue()
        self.output_queue = queue.Queue()

    def process_input_sockets(self):
        if sys.argv[1] == "INPUT_DIES":
            raise AssertionError("Expected a cached item for mm_hash='0f3a'")
        while True:
            self.input_queue.put(self.output_queue.get())

    def process_output_sockets(self):
        while True:
            self.output_queue.get()

    def run_busy_loop(self):
        while True:
            try:
                self.input_queue.get(timeout=2.5)
            except queue.Empty:
                pass


engine = EngineCoreProc()
inputs = threading.Thread(target=engine.process_input_sockets, daemon=True)
inputs.start()
threading.Thread(target=engine.process_output_sockets, daemon=True).start()
inputs.join(timeout=0.5)
print("ready", flush=True)
engine.run_busy_loop()
"""


@needs_py_spy
@pytest.mark.parametrize("case", ["INPUT_DIES", "INPUT_LIVES"])
def test_idle_engine_without_its_input_thread(children: Children, case: str) -> None:
    proc = children.start(ENGINE, case)
    assert read_line(proc) == "ready"

    d = diagnose(proc.pid, interval=INTERVAL)

    report = only(d, proc.pid)
    assert report.role == "EngineCore"
    if case == "INPUT_DIES":
        assert d.classification is C.ENGINE_INPUT_THREAD_GONE, render(d)
        assert report.input_thread_gone is True
        assert d.exit_code == EXIT_CODES[C.ENGINE_INPUT_THREAD_GONE] == 16
        assert "restart the server" in d.remedy
        assert "input thread: GONE" in render(d)
    else:
        assert d.classification is C.IDLE, render(d)
        assert report.input_thread_gone is False
    assert_serialisable(d)


def test_idle_engine_without_py_spy_says_what_to_run() -> None:
    from vllm_mmcache_fix.tools.diagnose import REMEDIES

    assert "0.13 and older" in REMEDIES[C.IDLE] and "py-spy" in REMEDIES[C.IDLE]


def test_input_thread_rule() -> None:
    from vllm_mmcache_fix.tools.diagnose import input_thread_gone

    output = ("Thread-2 (process_output_sockets)", ["EngineCoreProc.process_output_sockets"])
    main = ("MainThread", ["Queue.get", "EngineCoreProc.run_busy_loop"])
    unnamed_input = (None, ["Poller.poll", "EngineCoreProc.process_input_sockets"])
    assert input_thread_gone([main, output]) is True
    assert input_thread_gone([main, output, unnamed_input]) is False
    assert input_thread_gone([main, ("Thread-1 (process_input_sockets)", []), output]) is False
    assert input_thread_gone([main]) is None  # not a multiprocess engine: cannot tell
