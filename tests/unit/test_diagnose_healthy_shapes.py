"""``diagnose`` does not call a healthy server's busy processes frozen.

Real child processes shaped as vLLM's: a Worker titled ``VLLM::Worker_TP0`` that polls a
queue in ``shm_broadcast.acquire_read`` without blocking (what vLLM's Worker does between
steps), an EngineCore whose main thread (its busy loop) runs without blocking, and a
thread that is runnable all along but starved of CPU (it yields its core to a CPU-bound
process on the same CPU). The freeze's shape, an EngineCore thread other than the busy
loop spinning, still answers ``spinning``. Real vLLM servers: ``tests/e2e/test_e2e_diagnose.py``
and ``scripts/diagnose-shapes`` (``compat/diagnose-shapes.json``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from harness.children import Children, read_line, time_limit
from vllm_mmcache_fix.tools.diagnose import Classification, diagnose, find_py_spy
from vllm_mmcache_fix.tools.diagnose.classify import (
    expected_spin,
    stack_busy_waits,
    thread_is_spinning,
)
from vllm_mmcache_fix.tools.diagnose.procfs import process_kind
from vllm_mmcache_fix.tools.diagnose.results import ThreadReport
from vllm_mmcache_fix.tools.diagnose.rules import SPIN_MIN_FAIR_SHARE

C = Classification
INTERVAL = 1.5
PY_SPY = find_py_spy()


@pytest.fixture(autouse=True)
def _time_limit() -> Iterator[None]:
    with time_limit(120):
        yield


# A process titled like vLLM's (comm, as setproctitle leaves it), whose chosen thread
# polls without blocking inside a function of a file named like vLLM's.
TITLED_POLLER = """
import os, sys, threading
title, where, module_dir = sys.argv[1], sys.argv[2], sys.argv[3]
with open("/proc/self/comm", "w") as handle:
    handle.write(title)
sys.path.insert(0, module_dir)
import shm_broadcast
if where == "main":
    print("ready", flush=True)
    shm_broadcast.acquire_read()
else:
    worker = threading.Thread(target=shm_broadcast.acquire_read, name="process_input_sockets")
    worker.start()
    print("ready", flush=True)  # once the thread exists: the sampling must see it from the start
    worker.join()
"""

SHM_BROADCAST = """
def acquire_read():
    flag = []
    while not flag:  # vLLM polls the shared-memory flag the same way, without blocking
        pass
"""


@pytest.fixture
def module_dir(tmp_path: Path) -> Path:
    (tmp_path / "shm_broadcast.py").write_text(SHM_BROADCAST)
    return tmp_path


def _start(children: Children, title: str, where: str, module_dir: Path) -> int:
    proc = children.start(TITLED_POLLER, title, where, str(module_dir))
    assert read_line(proc) == "ready"
    return proc.pid


@pytest.mark.realtime  # samples real threads for seconds
@pytest.mark.parametrize("use_py_spy", [False, True], ids=["no-py-spy", "py-spy"])
def test_a_workers_busy_wait_is_active(
    children: Children, module_dir: Path, use_py_spy: bool
) -> None:
    """33a6648: ``spinning`` (12) without py-spy, ``spinning_elsewhere`` (13) with it."""
    if use_py_spy and PY_SPY is None:
        pytest.skip("py-spy not installed")
    pid = _start(children, "VLLM::Worker_TP0", "main", module_dir)
    # A busy machine can starve the poller for a whole sample (runnable, little CPU: not
    # spinning, and still active): sample again until it was seen burning its core.
    for _ in range(5):
        d = diagnose(pid, interval=INTERVAL, use_py_spy=use_py_spy)
        [report] = d.processes
        assert report.kind == "Worker"
        assert d.classification is C.ACTIVE, report.reason
        hot = [t for t in report.threads if t.spinning]
        if hot:
            break
    assert hot and all(t.expected for t in hot), report.threads
    if use_py_spy:
        assert hot[0].busy_wait is True and hot[0].stack, hot[0]
    assert d.exit_code == 0


@pytest.mark.realtime  # samples real threads for seconds
def test_engine_cores_busy_loop_is_active(children: Children, module_dir: Path) -> None:
    """EngineCore's main thread (its busy loop, waiting on its Workers' queue) at work."""
    pid = _start(children, "VLLM::EngineCore", "main", module_dir)
    d = diagnose(pid, interval=INTERVAL, use_py_spy=False)
    assert d.classification is C.ACTIVE, d.summary
    assert d.processes[0].kind == "EngineCore"


@pytest.mark.realtime  # samples real threads for seconds
def test_engine_cores_other_thread_spinning_is_the_signature(
    children: Children, module_dir: Path
) -> None:
    """The freeze's shape (its input thread spins) keeps its verdict without py-spy."""
    pid = _start(children, "VLLM::EngineCore", "thread", module_dir)
    d = diagnose(pid, interval=INTERVAL, use_py_spy=False)
    assert d.classification is C.SPINNING, d.summary
    assert d.exit_code == 12


def _cpu() -> int:
    cpus = sorted(os.sched_getaffinity(0))
    return cpus[-1]


YIELDER = """
import os, sys
os.sched_setaffinity(0, {int(sys.argv[1])})
print("ready", flush=True)
while True:
    os.sched_yield()
"""

HOG = """
import os, sys
os.sched_setaffinity(0, {int(sys.argv[1])})
print("ready", flush=True)
while True:
    pass
"""


@pytest.mark.realtime  # samples real threads for seconds
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity here")
def test_runnable_but_starved_is_not_spinning(children: Children) -> None:
    """A thread that is runnable all along but gives its core away (``sched_yield``, as a
    busy-wait does) to a CPU-bound process on the same CPU: 33a6648 calls it spinning."""
    cpu = str(_cpu())
    hog = children.start(HOG, cpu)
    assert read_line(hog) == "ready"
    yielder = children.start(YIELDER, cpu)
    assert read_line(yielder) == "ready"
    d = diagnose(yielder.pid, interval=2.0, use_py_spy=False)
    [thread] = d.processes[0].threads
    assert thread.runnable_fraction is not None and thread.runnable_fraction > 0.9, thread
    assert thread.on_cpu_share is not None and d.fair_share is not None
    assert thread.on_cpu_share < SPIN_MIN_FAIR_SHARE * d.fair_share, (thread, d.fair_share)
    assert not thread.spinning and d.classification in (C.IDLE, C.ACTIVE), d.summary

    # The same CPU, a thread that spins: it gets its share and is spinning.
    hog_spin = diagnose(hog.pid, interval=2.0, use_py_spy=False)
    assert hog_spin.classification is C.SPINNING, hog_spin.summary


@given(
    cpu=st.floats(0.0, 1.0),
    share=st.floats(0.0, 1.0),
    fair=st.floats(0.01, 1.0),
    voluntary=st.integers(0, 3),
)
def test_spin_rule_with_the_machines_fair_share(
    cpu: float, share: float, fair: float, voluntary: int
) -> None:
    got = thread_is_spinning(cpu, 1.0, voluntary, 2.0, share, fair)
    if cpu >= 0.8:
        assert got
    else:
        assert got is (share >= SPIN_MIN_FAIR_SHARE * fair)
    assert not thread_is_spinning(cpu, 1.0, 100, 2.0, share, fair)


@pytest.mark.parametrize(
    ("comm", "cmdline", "kind"),
    [
        ("VLLM::EngineCor", "VLLM::EngineCore_DP1", "EngineCore"),
        ("VLLM::Worker_TP", "VLLM::Worker_TP1", "Worker"),
        ("VLLM::Worker", "", "Worker"),
        ("VLLM::APIServe", "VLLM::APIServer_0", "APIServer"),
        ("VLLM::DPCoordi", "VLLM::DPCoordinator", "DPCoordinator"),
        ("vllm", "/venv/bin/python /venv/bin/vllm serve /models/x --port 8000", "APIServer"),
        ("python", "python -m vllm.entrypoints.openai.api_server --model m", "APIServer"),
        ("python", "python -m vllm.entrypoints.cli.main serve m", "APIServer"),
        ("python", "python my_program.py", "other"),
        ("python3", "python3 -c import vllm_mmcache_fix", "other"),
    ],
)
def test_process_kind(comm: str, cmdline: str, kind: str) -> None:
    assert process_kind(comm, cmdline) == kind


def _thread(
    tid: int, *, stack: list[str] | None = None, in_cache: bool | None = None
) -> ThreadReport:
    t = ThreadReport(tid, "x", None, "RRRR", 2.0, 1.0, 1.0, 0, 5, "running", None, spinning=True)
    t.stack, t.in_mm_cache = stack, in_cache
    return t


def test_expected_spins() -> None:
    wait = [("acquire_read", "/v/vllm/distributed/device_communicators/shm_broadcast.py")]
    assert stack_busy_waits(wait)
    assert not stack_busy_waits([("acquire_read", "/srv/other.py")])
    busy_wait = _thread(7)
    busy_wait.busy_wait = True
    assert expected_spin(busy_wait, "other", 1)
    assert expected_spin(_thread(7), "Worker", 1)
    assert expected_spin(_thread(7), "APIServer", 1)
    assert expected_spin(_thread(1), "EngineCore", 1)  # its busy loop
    assert expected_spin(_thread(7), "EngineCore", 1) is None  # another thread: counts
    assert expected_spin(_thread(7, in_cache=True), "Worker", 1) is None  # the cache: counts
    assert expected_spin(_thread(7), "other", 1) is None
    assert sys.version_info >= (3, 9)
