"""``diagnose`` on the real 0.23.0 cache hang (the release's own ``LRUCache``, spinning).

The other process shapes (busy loops, stops, sleeps, errors) are in
``tests/unit/test_diagnose_rules.py``.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness import pythons, realsrc
from harness.children import (
    PARENT,
    SPINNER,
    Children,
    as_user,
    assert_serialisable,
    dead_pid,
    diagnose_cli,
    hot_thread,
    only,
    read_line,
    start_spinner,
    time_limit,
)
from vllm_mmcache_fix.tools.diagnose import (
    EXIT_CODES,
    EXIT_ERROR,
    Classification,
    Diagnosis,
    diagnose,
    find_py_spy,
    render,
)

C = Classification
VERSION = "0.23.0"
INTERVAL = 1.0
TEST_TIMEOUT = 120  # seconds per test, enforced with SIGALRM

PY_SPY = find_py_spy()
needs_py_spy = pytest.mark.skipif(PY_SPY is None, reason="py-spy not installed")


@pytest.fixture(autouse=True)
def _time_limit() -> Iterator[None]:
    with time_limit(TEST_TIMEOUT):
        yield


SAMPLES = 4
"""A loaded machine can starve the spinner for a whole interval: runnable, but on a CPU for
less than half its fair share, which diagnose rightly does not call spinning. Each check
samples again, at most this many times, until the spinner got its share."""


def _sampled(pid: int, use_py_spy: bool, want: Classification) -> Diagnosis:
    for _ in range(SAMPLES):
        d = diagnose(pid, interval=INTERVAL, use_py_spy=use_py_spy)
        if d.classification is want:
            break
    return d


def _cli_sampled(want: str, *args: str) -> subprocess.CompletedProcess[str]:
    for _ in range(SAMPLES):
        done = diagnose_cli(*args)
        if want in done.stdout:
            break
    return done


@pytest.fixture(scope="module")
def real_sources() -> Path:
    try:
        root = realsrc.source_root(VERSION)
    except realsrc.SourcesUnavailable as exc:
        pytest.skip(str(exc))
    assert (root / "vllm" / "utils" / "cache.py").is_file()
    return root


# --------------------------------------------------------------------------- (1) the real hang


@pytest.mark.parametrize("use_py_spy", [True, False], ids=["py-spy", "no-py-spy"])
def test_real_023_cache_spin(real_sources: Path, children: Children, use_py_spy: bool) -> None:
    if use_py_spy and PY_SPY is None:
        pytest.skip("py-spy not installed")
    proc = start_spinner(children)

    want = C.SPINNING_IN_MM_CACHE if use_py_spy else C.SPINNING
    d = _sampled(proc.pid, use_py_spy, want)

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

        out = as_user(run)
    finally:
        shutil.rmtree(bindir, ignore_errors=True)
    data = json.loads(out)
    assert data["verdict"] == "spinning", out
    [report] = data["processes"]
    assert report["stack_check"]["status"] == "failed"
    assert "ptrace" in report["stack_check"]["detail"]
    assert any("ptrace" in note for note in data["notes"])
    assert f"failed for PID {proc.pid}" in data["py_spy"]
    [hot] = [t for t in report["threads"] if t["spinning"]]
    assert hot["syscall"] is None  # /proc/PID/task/TID/syscall needs ptrace access too


# --------------------------------------------------------------------------- (6) parent/child


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

    expected = C.SPINNING_IN_MM_CACHE if use_py_spy else C.SPINNING
    d = _sampled(parent.pid, use_py_spy, expected)

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


def test_cli_exit_codes(real_sources: Path, children: Children) -> None:
    proc = start_spinner(children)
    done = _cli_sampled(
        '"verdict": "spinning"',
        "--pid",
        str(proc.pid),
        "--interval",
        str(INTERVAL),
        "--json",
        "--no-py-spy",
    )
    data = json.loads(done.stdout)
    assert data["verdict"] == "spinning"
    assert done.returncode == EXIT_CODES[C.SPINNING] == data["exit_code"], done.stderr
    if PY_SPY is not None:
        done = _cli_sampled(
            ": spinning_in_mm_cache", "--pid", str(proc.pid), "--interval", str(INTERVAL)
        )
        assert done.returncode == EXIT_CODES[C.SPINNING_IN_MM_CACHE], done.stdout + done.stderr
        assert done.stdout.startswith(f"PID {proc.pid}: spinning_in_mm_cache")

    pid = dead_pid()
    if pid is None:
        pytest.skip("PID reused at once")
    done = diagnose_cli("--pid", str(pid))
    assert done.returncode == EXIT_ERROR
    assert f"no process with PID {pid}" in done.stderr


OLDER_PYTHON = "3.10"
"""A server's Python where py-spy, without pausing the process, names each Python thread by
its ``pthread_t`` and not by the OS's thread id (every Python before 3.11; 3.9 gives no thread
name either), and the oldest that vLLM 0.23.0 runs on; a venv of that Python with the unit
tier's requirements (cachetools) runs the release's cache."""


@pytest.fixture(scope="module")
def older_python() -> str:
    """That venv's interpreter (built before the test's time limit starts, when missing)."""
    venv = pythons.venv_for(OLDER_PYTHON, pythons.ensure_python(OLDER_PYTHON))
    return str(venv / "bin" / "python")


@needs_py_spy
def test_the_hang_under_a_python_older_than_311_is_found_in_the_cache(
    real_sources: Path, children: Children, older_python: str
) -> None:
    """A vLLM on Python 3.10 (or 3.9) froze in the cache: its spinning thread's stack is read
    (py-spy pauses the process for one dump), the verdict is the cache's. Without that dump
    the thread had no stack: ``spinning_elsewhere`` (13), "not the cache"."""
    proc = start_spinner(children, python=older_python)
    d = _sampled(proc.pid, True, C.SPINNING_IN_MM_CACHE)
    assert proc.poll() is None, "the cache loop ended: not the real hang"
    report = only(d, proc.pid)
    assert d.classification is C.SPINNING_IN_MM_CACHE, render(d)
    assert d.exit_code == EXIT_CODES[C.SPINNING_IN_MM_CACHE]
    hot = hot_thread(report)
    assert hot.in_mm_cache is True and hot.stack is not None
    assert any("popitem (" in f for f in hot.stack)  # 3.10: no class in the name
    assert hot.python_name == "process_input_sockets"
    assert report.stack_check is not None and report.stack_check.paused
    assert "paused for one dump" in d.py_spy


@needs_py_spy
@pytest.mark.skipif(sys.version_info < (3, 11), reason="the tier's Python is older than 3.11")
def test_a_python_311_server_is_never_paused(real_sources: Path, children: Children) -> None:
    """From Python 3.11 py-spy reads the thread ids without stopping the process: no pause."""
    proc = start_spinner(children)
    d = _sampled(proc.pid, True, C.SPINNING_IN_MM_CACHE)
    assert d.classification is C.SPINNING_IN_MM_CACHE, render(d)
    report = only(d, proc.pid)
    assert report.stack_check is not None and not report.stack_check.paused
    assert "paused" not in d.py_spy
