"""Reading ``/proc``: threads, CPU time, context switches, states, the process tree.

The stat and status parsers are shared with the stall sentinel
(``core/procfs.py``); the development harness samples servers through this
module too."""

from __future__ import annotations

import errno
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

from ...core.procfs import StatFields, parse_schedstat, parse_stat, parse_switches
from ..redact import redact_argv
from .rules import (
    _API_SERVER_COMMAND,
    _ENGINE_CORE_COMM,
    _SYSCALL_NAMES,
    ENGINE_CORE_MARKER,
    KIND_API_SERVER,
    KIND_ENGINE_CORE,
    KIND_OTHER,
    TITLE_PREFIXES,
    DiagnoseError,
)

# --------------------------------------------------------------------------- /proc reading


class _Gone(Exception):
    """The process or thread disappeared while being read."""


_GONE_ERRNOS = (errno.ENOENT, errno.ESRCH)


def _denied(path: Path) -> DiagnoseError:
    return DiagnoseError(
        f"cannot read {path}: permission denied; run as the user that runs vLLM, or as root"
    )


def _read(path: Path, *, optional: bool = False) -> str | None:
    """Text of a /proc file. Missing -> _Gone; unreadable -> DiagnoseError (or None)."""
    try:
        with open(path, "rb") as handle:
            data = handle.read()
    except PermissionError as exc:
        if optional:
            return None
        raise _denied(path) from exc
    except OSError as exc:
        if exc.errno in _GONE_ERRNOS:
            raise _Gone(str(path)) from exc
        if optional:
            return None
        raise DiagnoseError(f"cannot read {path}: {exc.strerror or exc}") from exc
    return data.decode("utf-8", "replace")


def _parse_stat(text: str, path: Path) -> StatFields:
    try:
        return parse_stat(text)
    except ValueError as exc:
        raise DiagnoseError(f"cannot parse {path}: {text[:80]!r}") from exc


def _read_stat(path: Path) -> StatFields:
    text = _read(path)
    assert text is not None
    return _parse_stat(text, path)


def _switches(path: Path) -> tuple[int, int]:
    text = _read(path)
    assert text is not None
    return parse_switches(text)


def _runnable_ns(text: str | None) -> int | None:
    return parse_schedstat(text or "")


def _on_cpu_ns(text: str | None) -> int | None:
    """Nanoseconds on a CPU (the first field of ``schedstat``); the second is the time spent
    waiting for one."""
    fields = (text or "").split()
    return int(fields[0]) if fields and fields[0].isdigit() else None


def _syscall_name(text: str | None) -> str | None:
    if text is None:
        return None
    first = text.split(" ", 1)[0].strip()
    if not first:
        return None
    if not first.lstrip("-").isdigit():
        return first  # "running"
    number = int(first)
    if number < 0:
        return "in kernel (not a syscall)"
    names = _SYSCALL_NAMES.get(platform.machine(), {})
    return names.get(number, f"syscall {number}")


@dataclass
class _ThreadSample:
    tid: int
    comm: str
    state: str
    """The state letter of ``stat`` (``R`` running, ``S`` sleeping, ...)."""
    ticks: int
    """User plus system CPU time, in clock ticks."""
    voluntary: int
    """Context switches the thread asked for (it blocked), from ``status``."""
    nonvoluntary: int
    syscall: str | None = None
    wchan: str | None = None
    runnable_ns: int | None = None
    """Time on a CPU plus time waiting for one, from schedstat."""
    on_cpu_ns: int | None = None
    """Time on a CPU, from schedstat."""


@dataclass
class _ProcessSample:
    pid: int
    starttime: int
    threads: dict[int, _ThreadSample]
    time: float


def _tids(proc: Path, pid: int) -> list[int]:
    task = proc / str(pid) / "task"
    try:
        names = os.listdir(task)
    except PermissionError as exc:
        raise _denied(task) from exc
    except OSError as exc:
        if exc.errno in _GONE_ERRNOS:
            raise _Gone(str(task)) from exc
        raise DiagnoseError(f"cannot read {task}: {exc.strerror or exc}") from exc
    return sorted(int(name) for name in names if name.isdigit())


def _sample_process(proc: Path, pid: int, *, full: bool) -> _ProcessSample:
    """Every thread of ``pid``; with ``full`` also switches, syscall and wchan."""
    starttime = _read_stat(proc / str(pid) / "stat").starttime
    threads: dict[int, _ThreadSample] = {}
    for tid in _tids(proc, pid):
        base = proc / str(pid) / "task" / str(tid)
        try:
            stat = _read_stat(base / "stat")
            sample = _ThreadSample(tid, stat.comm, stat.state, stat.ticks, 0, 0)
            if full:
                sample.voluntary, sample.nonvoluntary = _switches(base / "status")
                sample.syscall = _syscall_name(_read(base / "syscall", optional=True))
                wchan = _read(base / "wchan", optional=True)
                sample.wchan = wchan.strip() if wchan else None
                schedstat = _read(base / "schedstat", optional=True)
                sample.runnable_ns = _runnable_ns(schedstat)
                sample.on_cpu_ns = _on_cpu_ns(schedstat)
        except _Gone:
            continue  # the thread ended while being read
        threads[tid] = sample
    if not threads:
        raise _Gone(str(proc / str(pid)))
    return _ProcessSample(pid, starttime, threads, time.monotonic())


def _all_ppids(proc: Path) -> dict[int, int]:
    ppids: dict[int, int] = {}
    try:
        names = os.listdir(proc)
    except PermissionError as exc:
        raise _denied(proc) from exc
    except OSError as exc:
        raise DiagnoseError(f"cannot read {proc}: {exc.strerror or exc}") from exc
    for name in names:
        if not name.isdigit():
            continue
        try:
            text = _read(proc / name / "stat", optional=True)
        except _Gone:
            continue
        if text is None:
            continue
        try:
            ppids[int(name)] = _parse_stat(text, proc / name / "stat").ppid
        except (DiagnoseError, ValueError):
            continue
    return ppids


def process_tree(pid: int, *, proc_root: str | os.PathLike[str] = "/proc") -> list[int]:
    """``pid`` and all its descendants, parents before children."""
    proc = Path(proc_root)
    ppids = _all_ppids(proc)
    children: dict[int, list[int]] = {}
    for child, parent in ppids.items():
        children.setdefault(parent, []).append(child)
    order = [pid]
    index = 0
    while index < len(order):
        order.extend(sorted(children.get(order[index], ())))
        index += 1
    return order


def _cmdline(proc: Path, pid: int) -> str:
    """The command line, secrets redacted argument by argument (tools/redact.py)."""
    text = _read(proc / str(pid) / "cmdline", optional=True) or ""
    return " ".join(redact_argv([part for part in text.split("\0") if part]))


def is_engine_core(comm: str, cmdline: str) -> bool:
    """vLLM titles its engine processes ``VLLM::EngineCore`` or ``..._DP<n>``."""
    return ENGINE_CORE_MARKER in cmdline or bool(_ENGINE_CORE_COMM.search(comm))


def process_kind(comm: str, cmdline: str) -> str:
    """Which of vLLM's processes this is, from the title vLLM gives it (``VLLM::Worker_TP0``,
    ``VLLM::APIServer_1``, ``VLLM::DPCoordinator``) or its command line (``vllm serve``):
    one of :data:`~.rules.PROCESS_KINDS`, ``other`` when none."""
    if is_engine_core(comm, cmdline):
        return KIND_ENGINE_CORE
    title = cmdline.split(" ", 1)[0] if cmdline else comm
    for kind, prefix in TITLE_PREFIXES.items():
        if title.startswith(prefix) or comm.startswith(prefix[:15]):
            return kind
    if _API_SERVER_COMMAND.search(cmdline):
        return KIND_API_SERVER
    return KIND_OTHER
