"""The processes of a running server, from ``/proc``: tree, names, RSS, spin samples.

This is the one module of the harness that reads ``/proc``. Threads, CPU time, run
states and context switches are sampled by the package's own diagnosis
(:func:`vllm_mmcache_fix.tools.diagnose.diagnose`, without py-spy), so "spinning" here means
exactly what ``vllm-mmcache-fix diagnose`` calls spinning
(:func:`~vllm_mmcache_fix.tools.diagnose.thread_is_spinning`). Only what the diagnosis does not
read is read here: command lines, resident memory and process groups.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass, field

from vllm_mmcache_fix.tools.diagnose import (
    DiagnoseError,
    Diagnosis,
    ProcessReport,
    diagnose,
    is_engine_core,
    process_tree,
)

PROC = "/proc"


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return handle.read()
    except OSError:
        return ""


def _stat_fields(pid: int) -> list[str]:
    """Fields of ``/proc/PID/stat`` after the command name; empty when gone."""
    text = _read(f"{PROC}/{pid}/stat")
    rparen = text.rfind(")")  # the name may hold spaces and parentheses
    return text[rparen + 2 :].split() if rparen >= 0 else []


# ----------------------------------------------------------------------------- names


def comm(pid: int) -> str:
    return _read(f"{PROC}/{pid}/comm").strip()


def cmdline(pid: int) -> str:
    return _read(f"{PROC}/{pid}/cmdline").replace("\0", " ").strip()


def state(pid: int) -> str:
    """The process's state letter (``R``, ``S``, ``T``, ``Z``, ...); empty when it is gone."""
    fields = _stat_fields(pid)
    return fields[0] if fields else ""


def process_name(pid: int) -> str:
    """The command line, or the kernel's name when there is none."""
    return cmdline(pid) or comm(pid)


# ----------------------------------------------------------------------------- tree


def parent(pid: int) -> int | None:
    """The parent's pid (``/proc/PID/stat``, after the name); None when gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as handle:
            text = handle.read()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2 :].split()
    return int(fields[1]) if len(fields) > 1 else None


def tree(root: int) -> list[int]:
    """``root`` and its descendants, parents first."""
    try:
        return process_tree(root, proc_root=PROC)
    except DiagnoseError:
        return [root]


def descendants(root: int) -> list[int]:
    return tree(root)[1:]


def group_members(pgid: int) -> list[int]:
    """Every live process of a process group."""
    members = []
    for entry in os.listdir(PROC):
        if entry.isdigit():
            fields = _stat_fields(int(entry))
            if len(fields) > 2 and fields[2] == str(pgid) and fields[0] not in ("Z", "X"):
                members.append(int(entry))
    return members


def kill_group(pgid: int, grace: float = 10.0) -> None:
    """SIGTERM the group, SIGKILL after ``grace`` seconds, until no member is left."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.2)
    for _ in range(50):
        if not group_members(pgid):
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
        time.sleep(0.1)


# ----------------------------------------------------------------------------- memory


def rss_mb(pid: int) -> float | None:
    """``VmRSS`` of one process in MiB; None when it is gone."""
    for line in _read(f"{PROC}/{pid}/status").splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return None


def tree_rss_mb(root: int) -> float:
    """``VmRSS`` of ``root`` and its descendants together, in MiB."""
    return round(sum(rss_mb(pid) or 0.0 for pid in tree(root)), 1)


# ----------------------------------------------------------------------------- spinning


@dataclass
class SpinSample:
    """One process's threads over a window, as the package's diagnosis saw them."""

    pid: int | None
    name: str = ""
    seconds: float = 0.0
    cpu_percent: float = 0.0
    """All threads together; 100 is one core busy."""
    busiest_thread_percent: float = 0.0
    busiest_thread_runnable: float = 0.0
    """Share of the window the busiest thread was runnable (running or queued)."""
    voluntary_ctxt: int = 0
    nonvoluntary_ctxt: int = 0
    threads: int = 0
    spinning: bool = False
    """A thread spins by :func:`vllm_mmcache_fix.tools.diagnose.thread_is_spinning`."""
    spinning_threads: list[str] = field(default_factory=list)
    classification: str = ""
    """The diagnosis's class of this process (``IDLE``, ``SPINNING``, ...)."""
    error: str = ""


def spin_sample(report: ProcessReport, seconds: float) -> SpinSample:
    """A :class:`SpinSample` from one process of a diagnosis."""
    threads = report.threads  # the busiest first
    busiest = threads[0] if threads else None
    spinning = [t for t in threads if t.spinning]
    return SpinSample(
        pid=report.pid,
        name=(report.cmdline or report.comm)[:60],
        seconds=round(seconds, 2),
        cpu_percent=round(100.0 * report.cpu_fraction, 1),
        busiest_thread_percent=round(100.0 * busiest.cpu_fraction, 1) if busiest else 0.0,
        busiest_thread_runnable=round(busiest.runnable_fraction or 0.0, 2) if busiest else 0.0,
        voluntary_ctxt=sum(t.voluntary_switches for t in threads),
        nonvoluntary_ctxt=sum(t.nonvoluntary_switches for t in threads),
        threads=len(threads),
        spinning=bool(spinning),
        spinning_threads=[t.label for t in spinning],
        classification=report.classification.value,
    )


def sample_tree(root: int, seconds: float = 2.0) -> tuple[Diagnosis | None, str]:
    """The diagnosis of ``root`` and its descendants over ``seconds`` (no stacks)."""
    try:
        return diagnose(root, interval=seconds, use_py_spy=False, proc_root=PROC), ""
    except DiagnoseError as exc:
        return None, str(exc)


def sample_spin(pid: int | None, seconds: float = 2.0) -> SpinSample:
    """CPU use, run states and context switches of one process's threads over ``seconds``.

    A thread that spins stays runnable and burns CPU without voluntary switches; on a
    loaded machine its CPU share can be low while it stays runnable.
    """
    if pid is None:
        return SpinSample(pid=None)
    found, error = sample_tree(pid, seconds)
    if found is None:
        return SpinSample(pid=pid, error=error)
    report = next((p for p in found.processes if p.pid == pid), None)
    if report is None or not report.threads:
        return SpinSample(pid=pid, seconds=round(found.interval, 2), error="exited")
    return spin_sample(report, found.interval)


def find_engine_core(server_pid: int) -> int | None:
    """The server's EngineCore: the child vLLM titles so, else the busiest child."""
    kids = descendants(server_pid)
    for pid in kids:
        if is_engine_core(comm(pid), cmdline(pid)):
            return pid
    if not kids:
        return None
    found, _ = sample_tree(server_pid, 0.5)
    if found is None:
        return None
    busy = {p.pid: p.cpu_fraction for p in found.processes if p.pid in kids}
    return max(busy, key=lambda pid: busy[pid]) if busy else None
