"""``diagnose`` on real processes: the real 0.23.0 cache hang, other spins, stops, sleeps."""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from vllm_mmcache_fix.tools.diagnose import (
    EXIT_CODES,
    EXIT_ERROR,
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

C = Classification
TESTS = Path(__file__).resolve().parent
PROJECT = TESTS.parent
VERSION = "0.23.0"
INTERVAL = 1.0
TEST_TIMEOUT = 120  # seconds per test, enforced with SIGALRM
LINE_TIMEOUT = 60.0  # seconds to wait for a child to report it is ready

PY_SPY = find_py_spy()
needs_py_spy = pytest.mark.skipif(PY_SPY is None, reason="py-spy not installed")

# The real LRUCache of vLLM 0.23.0 driven into the hang: touch() of a missing key leaves a
# ghost in the eviction order; once it is the oldest, eviction pops it forever.
SPINNER = """
import os, threading
from realsrc import load_lru_module

title = os.environ.get("SPINNER_TITLE")
if title:
    # What setproctitle does for vLLM's engine process (comm is cut to 15 bytes).
    with open("/proc/self/comm", "w") as handle:
        handle.write(title)

LRUCache = load_lru_module("0.23.0").LRUCache


def run():
    cache = LRUCache(4, getsizeof=lambda value: 1)
    for i in range(4):
        cache[f"item{i}"] = i
    cache.touch("ghost")
    print("spinning", flush=True)
    for i in range(8):
        cache[f"new{i}"] = i
    print("returned", flush=True)


thread = threading.Thread(target=run, name="process_input_sockets", daemon=True)
thread.start()
thread.join()
"""

BUSY = """
import threading

def busy():
    n = 0
    while True:
        n += 1

print("spinning", flush=True)
thread = threading.Thread(target=busy, name="busy_loop", daemon=True)
thread.start()
thread.join()
"""

SLEEPER = """
import sys, time
print("ready", flush=True)
time.sleep(float(sys.argv[1]) if len(sys.argv) > 1 else 300)
"""

# An API server stand-in that starts an engine stand-in and waits for it. Neither command
# line names the engine: it is found by its comm, as set by setproctitle.
PARENT = """
import os, subprocess, sys
env = dict(os.environ, SPINNER_TITLE="VLLM::Engine" + "Core")
cmd = [sys.executable, "-c", sys.argv[1]]
child = subprocess.Popen(cmd, stdout=subprocess.PIPE, env=env, text=True)
print(child.pid, flush=True)
print(child.stdout.readline().strip(), flush=True)
child.wait()
"""


@pytest.fixture(autouse=True)
def _time_limit() -> Iterator[None]:
    def expire(signum: int, frame: object) -> None:
        raise TimeoutError(f"test ran longer than {TEST_TIMEOUT} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, TEST_TIMEOUT)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture(scope="module")
def real_sources() -> Path:
    import realsrc

    try:
        root = realsrc.source_root(VERSION)
    except realsrc.SourcesUnavailable as exc:
        pytest.skip(str(exc))
    assert (root / "vllm" / "utils" / "cache.py").is_file()
    return root


class Children:
    """Processes a test starts; all are killed (by PID) and reaped afterwards."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[str]] = []
        self.extra_pids: list[int] = []

    def start(self, code: str, *args: str) -> subprocess.Popen[str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(TESTS), str(PROJECT)])
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        proc = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(code), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.procs.append(proc)
        return proc

    def cleanup(self) -> None:
        for pid in self.extra_pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass


@pytest.fixture
def children() -> Iterator[Children]:
    started = Children()
    try:
        yield started
    finally:
        started.cleanup()


def read_line(proc: subprocess.Popen[str], timeout: float = LINE_TIMEOUT) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        raise AssertionError(f"PID {proc.pid} printed nothing within {timeout} s")
    line = proc.stdout.readline()
    if not line:
        err = proc.stderr.read() if proc.stderr and proc.poll() is not None else ""
        raise AssertionError(f"PID {proc.pid} exited (status {proc.poll()}): {err}")
    return line.strip()


def start_spinner(children: Children) -> subprocess.Popen[str]:
    proc = children.start(SPINNER)
    assert read_line(proc) == "spinning"
    time.sleep(0.3)  # let it reach the ghost
    assert proc.poll() is None
    return proc


def wait_for_state(pid: int, state: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = Path(f"/proc/{pid}/stat").read_text()
        if text[text.rfind(")") + 2 :].startswith(state):
            return
        time.sleep(0.01)
    raise AssertionError(f"PID {pid} did not reach state {state} within {timeout} s")


def only(d, pid: int):
    [report] = [p for p in d.processes if p.pid == pid]
    return report


def hot_thread(report) -> ThreadReport:
    spinning = [t for t in report.threads if t.spinning]
    assert len(spinning) == 1, render_threads(report)
    return spinning[0]


def render_threads(report) -> str:
    return json.dumps([t.as_dict() for t in report.threads], indent=1)


def assert_serialisable(d) -> None:
    data = json.loads(json.dumps(d.as_dict()))
    assert data["classification"] == d.classification.value
    assert data["exit_code"] == EXIT_CODES[d.classification]
    assert render(d)


# --------------------------------------------------------------------------- (1) the real hang


@pytest.mark.realsrc
@pytest.mark.parametrize("use_py_spy", [True, False], ids=["py-spy", "no-py-spy"])
def test_real_023_cache_spin(real_sources: Path, children: Children, use_py_spy: bool) -> None:
    if use_py_spy and PY_SPY is None:
        pytest.skip("py-spy not installed")
    proc = start_spinner(children)

    d = diagnose(proc.pid, interval=INTERVAL, use_py_spy=use_py_spy)

    assert proc.poll() is None, "the cache loop ended: not the real hang"
    report = only(d, proc.pid)
    hot = hot_thread(report)
    assert hot.voluntary_switches <= 1
    assert hot.cpu_fraction > 0
    assert set(hot.states) == {"R"}
    assert_serialisable(d)
    if use_py_spy:
        assert d.classification is C.SPINNING_IN_MM_CACHE, render(d)
        assert d.exit_code == EXIT_CODES[C.SPINNING_IN_MM_CACHE]
        assert hot.python_name == "process_input_sockets"
        assert hot.in_mm_cache is True
        assert hot.stack is not None
        assert any(".popitem " in f and "vllm-0.23.0/vllm/utils/cache.py" in f for f in hot.stack)
        assert report.stack_check is not None and report.stack_check.text
        assert "--mm-processor-cache-gb 0" in d.remedy
        assert "vllm-mmcache-fix check" in d.remedy
        assert "popitem" in render(d)
    else:
        assert d.classification is C.SPINNING, render(d)
        assert "stack not checked" in report.reason
        assert "signature" in report.reason
        assert hot.in_mm_cache is None and hot.stack is None
        assert "py-spy" in d.remedy


# --------------------------------------------------------------------------- (2) elsewhere


@needs_py_spy
def test_busy_loop_elsewhere(children: Children) -> None:
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
    assert not thread_is_spinning(0.3, 0.5, 0, 2.0)
    assert not thread_is_spinning(0.3, None, 0, 2.0)


# --------------------------------------------------------------------------- (4) idle


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


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=30)
    if Path(f"/proc/{proc.pid}").exists():
        pytest.skip("PID reused at once")
    return proc.pid


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
def test_exits_mid_sample(children: Children, reap: bool) -> None:
    proc = children.start(SLEEPER, "0.5")
    assert read_line(proc) == "ready"
    if reap:
        reaper = threading.Thread(target=proc.wait, daemon=True)
        reaper.start()

    d = diagnose(proc.pid, interval=INTERVAL)

    assert d.classification is C.EXITED, render(d)
    reason = only(d, proc.pid).reason
    assert ("zombie" in reason) is (not reap)
    assert d.exit_code == EXIT_CODES[C.EXITED]
    assert_serialisable(d)


def _as_user(func: Callable[[], str], uid: int = 65534) -> str:
    """Run ``func`` in a forked child that switched to ``uid``; its result or error text."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        status = 0
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            result = func()
        except BaseException as exc:  # reported to the parent
            result = f"{type(exc).__name__}: {exc}"
            status = 1
        finally:
            try:
                os.write(write_end, result.encode())
            finally:
                os._exit(status)
    os.close(write_end)
    chunks = []
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([read_end], [], [], deadline - time.monotonic())
            if not ready:
                break
            chunk = os.read(read_end, 65536)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(read_end)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.waitpid(pid, 0)
    return b"".join(chunks).decode()


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
            message = _as_user(run)  # root reads anything: drop to nobody
        else:
            message = run()
        assert message == (
            f"DiagnoseError: cannot read {locked}: permission denied; "
            "run as the user that runs vLLM, or as root"
        )
    finally:
        shutil.rmtree(fake, ignore_errors=True)


@pytest.mark.realsrc
@needs_py_spy
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a check as another user")
def test_py_spy_without_ptrace_permission_degrades(real_sources: Path, children: Children) -> None:
    """Another user cannot attach py-spy to a root process: say so, classify as SPINNING."""
    proc = start_spinner(children)
    bindir = Path(tempfile.mkdtemp(prefix="diag-bin-", dir="/tmp"))
    try:
        bindir.chmod(0o755)
        assert PY_SPY is not None
        shutil.copy(PY_SPY, bindir / "py-spy")
        (bindir / "py-spy").chmod(stat.S_IRWXU | stat.S_IRGRP | stat.S_IXGRP | 0o005)

        def run() -> str:
            os.environ["PATH"] = f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}"
            return json.dumps(diagnose(proc.pid, interval=INTERVAL).as_dict())

        out = _as_user(run)
    finally:
        shutil.rmtree(bindir, ignore_errors=True)
    data = json.loads(out)
    assert data["classification"] == "SPINNING", out
    [report] = data["processes"]
    assert report["stack_check"]["status"] == "failed"
    assert "ptrace" in report["stack_check"]["detail"]
    assert any("ptrace" in note for note in data["notes"])
    assert f"failed for PID {proc.pid}" in data["py_spy"]
    [hot] = [t for t in report["threads"] if t["spinning"]]
    assert hot["syscall"] is None  # /proc/PID/task/TID/syscall needs ptrace access too


# --------------------------------------------------------------------------- (6) parent/child


@pytest.mark.realsrc
@pytest.mark.parametrize("use_py_spy", [True, False], ids=["py-spy", "no-py-spy"])
def test_parent_pid_finds_spinning_engine_core(
    real_sources: Path, children: Children, use_py_spy: bool
) -> None:
    if use_py_spy and PY_SPY is None:
        pytest.skip("py-spy not installed")
    parent = children.start(PARENT, textwrap.dedent(SPINNER))
    child_pid = int(read_line(parent))
    children.extra_pids.append(child_pid)
    assert read_line(parent) == "spinning"
    time.sleep(0.3)

    d = diagnose(parent.pid, interval=INTERVAL, use_py_spy=use_py_spy)

    expected = C.SPINNING_IN_MM_CACHE if use_py_spy else C.SPINNING
    assert d.classification is expected, render(d)
    assert [p.pid for p in d.processes] == [parent.pid, child_pid]
    top, engine = d.processes
    assert top.role == "target" and top.classification is C.IDLE
    assert engine.role == "EngineCore" and engine.comm == "VLLM::EngineCor"
    assert engine.ppid == parent.pid
    assert engine.classification is expected
    assert d.summary.startswith(f"EngineCore PID {child_pid}: ")
    assert not d.notes or all("EngineCore" not in n for n in d.notes)
    assert_serialisable(d)


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


# --------------------------------------------------------------------------- command line


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(PROJECT))
    return subprocess.run(
        [sys.executable, "-m", "vllm_mmcache_fix", "diagnose", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=90,
        check=False,
    )


@pytest.mark.realsrc
def test_cli_exit_codes(real_sources: Path, children: Children) -> None:
    proc = start_spinner(children)
    done = _cli("--pid", str(proc.pid), "--interval", str(INTERVAL), "--json", "--no-py-spy")
    data = json.loads(done.stdout)
    assert data["classification"] == "SPINNING"
    assert done.returncode == EXIT_CODES[C.SPINNING] == data["exit_code"], done.stderr
    if PY_SPY is not None:
        done = _cli("--pid", str(proc.pid), "--interval", str(INTERVAL))
        assert done.returncode == EXIT_CODES[C.SPINNING_IN_MM_CACHE], done.stdout + done.stderr
        assert done.stdout.startswith(f"PID {proc.pid}: SPINNING_IN_MM_CACHE")

    pid = _dead_pid()
    done = _cli("--pid", str(pid))
    assert done.returncode == EXIT_ERROR
    assert f"no process with PID {pid}" in done.stderr
