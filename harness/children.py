"""Child processes for the diagnosis tests (a real cache spin, a busy loop, sleepers), and checks.

Each program runs as ``python -c CODE`` with the repository root on ``PYTHONPATH``.
:class:`Children` starts them and kills (by PID) and reaps every one afterwards.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator

from harness import procs
from harness.paths import REPO_ROOT
from vllm_mmcache_fix.tools.diagnose import (
    EXIT_CODES,
    Diagnosis,
    ProcessReport,
    ThreadReport,
    render,
)

LINE_TIMEOUT = 60.0  # seconds to wait for a child to report it is ready

# The real LRUCache of vLLM 0.23.0 driven into the hang: touch() of a missing key leaves a
# ghost in the eviction order; once it is the oldest, eviction pops it forever.
SPINNER = """
import os, threading
from harness.realsrc import load_lru_module

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


class Children:
    """Processes a test starts; all are killed (by PID) and reaped afterwards."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[str]] = []
        self.extra_pids: list[int] = []

    def start(self, code: str, *args: str, python: str = sys.executable) -> subprocess.Popen[str]:
        """``python -c code args`` (this interpreter unless ``python`` says another)."""
        env = dict(os.environ)
        env["PYTHONPATH"] = str(REPO_ROOT)
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        proc = subprocess.Popen(
            [python, "-c", textwrap.dedent(code), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.procs.append(proc)
        return proc

    def cleanup(self) -> None:
        for pid in self.extra_pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)


def read_line(proc: subprocess.Popen[str], timeout: float = LINE_TIMEOUT) -> str:
    """The child's next line of output; fails when it prints nothing in time or exits."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        raise AssertionError(f"PID {proc.pid} printed nothing within {timeout} s")
    line = proc.stdout.readline()
    if not line:
        err = proc.stderr.read() if proc.stderr and proc.poll() is not None else ""
        raise AssertionError(f"PID {proc.pid} exited (status {proc.poll()}): {err}")
    return line.strip()


def start_spinner(children: Children, python: str = sys.executable) -> subprocess.Popen[str]:
    """The real 0.23.0 cache hang, running in a child (under ``python``: cachetools there)."""
    proc = children.start(SPINNER, python=python)
    assert read_line(proc) == "spinning"
    time.sleep(0.3)  # let it reach the ghost
    assert proc.poll() is None
    return proc


def wait_for_state(pid: int, state: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if procs.state(pid) == state:
            return
        time.sleep(0.01)
    raise AssertionError(f"PID {pid} did not reach state {state} within {timeout} s")


def dead_pid() -> int | None:
    """The PID of a process that has just exited; None if the PID was reused at once."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=30)
    if procs.state(proc.pid):
        return None
    return proc.pid


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise ``TimeoutError`` in the main thread once ``seconds`` have passed (SIGALRM)."""

    def expire(signum: int, frame: object) -> None:
        raise TimeoutError(f"test ran longer than {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def as_user(func: Callable[[], str], uid: int = 65534) -> str:
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


# --------------------------------------------------------------------------- diagnoses


def only(d: Diagnosis, pid: int) -> ProcessReport:
    """The report of one PID in a diagnosis."""
    [report] = [p for p in d.processes if p.pid == pid]
    return report


def hot_thread(report: ProcessReport) -> ThreadReport:
    """The one spinning thread of a process report."""
    spinning = [t for t in report.threads if t.spinning]
    assert len(spinning) == 1, render_threads(report)
    return spinning[0]


def render_threads(report: ProcessReport) -> str:
    return json.dumps([t.as_dict() for t in report.threads], indent=1)


def assert_serialisable(d: Diagnosis) -> None:
    data = json.loads(json.dumps(d.as_dict()))
    assert data["verdict"] == d.classification.value
    assert data["exit_code"] == EXIT_CODES[d.classification]
    assert render(d)


def plugin_cli(
    *args: str, timeout: float = 90, unset: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    """``python -m vllm_mmcache_fix ARGS`` with this checkout's package, the environment
    variables ``unset`` removed."""
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    for name in unset:
        env.pop(name, None)
    return subprocess.run(
        [sys.executable, "-m", "vllm_mmcache_fix", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        check=False,
    )


def diagnose_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m vllm_mmcache_fix diagnose ARGS`` with this checkout's package."""
    return plugin_cli("diagnose", *args)
