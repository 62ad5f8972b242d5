"""Tell, from outside, whether a vLLM server is stuck in the multimodal cache eviction loop.

The hang looks like this: clients time out while ``/health`` still answers, and one thread
of the EngineCore process (its input thread, ``process_input_sockets``) burns a whole core.
It never blocks, so its voluntary context switches stay flat; it is only ever preempted, so
its nonvoluntary switches may rise. Its Python stack is inside ``LRUCache.popitem`` called
from the cache's ``__setitem__`` (or ``clear``/``remove_oldest``).

:func:`diagnose` samples every thread of a process and of its descendants through ``/proc``
for ``interval`` seconds, looks at the busy threads' stacks with ``py-spy dump`` when py-spy
is available, and classifies each process and the whole. Nothing here prints; :func:`render`
builds the text for humans and :meth:`Diagnosis.as_dict` the data for ``--json``.

Rules (thresholds are the module constants below):

* A thread **spins** when, over the interval, it made at most
  ``max(1, SPIN_MAX_VOLUNTARY_PER_SEC * interval)`` voluntary context switches (it never
  waited for anything) and either used at least ``SPIN_MIN_CPU_FRACTION`` of one core or
  was runnable (on a CPU or waiting for one) at least ``SPIN_MIN_RUNNABLE_FRACTION`` of the
  time. The second form keeps the rule working on a loaded machine, where a spinning thread
  only gets its share of a core. The runnable share is the larger of two estimates: time
  running plus time queued from ``/proc/.../schedstat`` (which books a wait only once it
  ends), and the share of state samples that found the thread in ``R``. Rising nonvoluntary
  switches are kept as evidence but not required: a spinning thread is only preempted when
  something else wants its core.
* A thread is **in the mm cache** when a ``py-spy`` stack of it has a ``popitem`` frame and
  a ``__setitem__``, ``clear``, ``remove_oldest`` or ``_remove_old_if_needed`` frame, both
  in a cache file (path containing one of ``CACHE_FILE_MARKERS``). A single stack can land
  between two ``popitem`` calls, so up to ``PY_SPY_MAX_DUMPS`` dumps are taken.
* A thread is **blocked** when every state sample taken during the interval (every
  ``STATE_SAMPLE_PERIOD`` seconds) found it in ``D`` (uninterruptible sleep: disk, network
  file system, device driver), ``T`` (stopped by a signal) or ``t`` (stopped by a tracer).
  Ordinary waits (``S``: sockets, queues, locks, sleeps) are not blocked: an idle vLLM
  process waits on futexes and sockets all the time.

A process is, first rule that applies:

``EXITED``
    gone (or a zombie) at the end of the interval.
``SPINNING_IN_MM_CACHE``
    a spinning thread whose stack is in the mm cache eviction loop.
``SPINNING_ELSEWHERE``
    spinning threads, stacks checked, none in the mm cache (or not Python threads).
``SPINNING``
    spinning threads whose stacks could not be checked (no py-spy, or it failed): the
    numbers match the mm cache hang's signature, but that is not a confirmation.
``BLOCKED``
    a blocked thread.
``IDLE``
    all threads together used at most ``IDLE_MAX_CPU_FRACTION`` of one core.
``ACTIVE``
    anything else: working normally as far as the interval shows.

The whole takes the most severe class among its processes (order of ``SEVERITY``).
"""

from __future__ import annotations

import errno
import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any


class Classification(str, Enum):
    SPINNING_IN_MM_CACHE = "SPINNING_IN_MM_CACHE"
    SPINNING = "SPINNING"
    SPINNING_ELSEWHERE = "SPINNING_ELSEWHERE"
    BLOCKED = "BLOCKED"
    ACTIVE = "ACTIVE"
    IDLE = "IDLE"
    EXITED = "EXITED"

    def __str__(self) -> str:
        return self.value


C = Classification

# Most severe first; the whole takes the first class any of its processes has.
SEVERITY: tuple[Classification, ...] = (
    C.SPINNING_IN_MM_CACHE,
    C.SPINNING,
    C.SPINNING_ELSEWHERE,
    C.BLOCKED,
    C.ACTIVE,
    C.IDLE,
    C.EXITED,
)

# Exit status of ``vllm-mmcache-fix diagnose`` per overall class. EXIT_ERROR is for
# DiagnoseError; 2 is left to command-line usage errors.
EXIT_CODES: dict[Classification, int] = {
    C.IDLE: 0,
    C.ACTIVE: 0,
    C.SPINNING_IN_MM_CACHE: 3,
    C.SPINNING: 4,
    C.SPINNING_ELSEWHERE: 5,
    C.BLOCKED: 6,
    C.EXITED: 7,
}
EXIT_ERROR = 1

SPIN_MIN_CPU_FRACTION = 0.8
"""A spinning thread uses at least this much of one core over the interval."""

SPIN_MIN_RUNNABLE_FRACTION = 0.9
"""...or is runnable (running or waiting for a CPU) at least this share of the interval..."""

SPIN_MAX_VOLUNTARY_PER_SEC = 1.0
"""...and makes at most this many voluntary switches per second (at least 1 is tolerated)."""

IDLE_MAX_CPU_FRACTION = 0.05
"""An idle process uses at most this much of one core, all threads together."""

BLOCKED_STATES = frozenset("DTt")
"""Thread states that, held for the whole interval, make a thread blocked."""

STATE_SAMPLE_PERIOD = 0.1
"""Seconds between thread-state samples during the interval."""

MIN_INTERVAL = 0.2
"""Shortest interval accepted: CPU time is counted in clock ticks (usually 10 ms)."""

PY_SPY_TIMEOUT = 10.0
"""Seconds one ``py-spy dump`` may take."""

PY_SPY_MAX_DUMPS = 5
"""Dumps taken per process until every busy Python thread is seen in the cache loop."""

PY_SPY_BUDGET = 20.0
"""Seconds all dumps of one process may take together."""

CACHE_FILE_MARKERS = ("vllm/utils/cache.py", "vllm/utils/__init__.py", "cachetools")
EVICTION_FRAMES = frozenset({"popitem"})
EVICTION_CALLERS = frozenset({"__setitem__", "clear", "remove_oldest", "_remove_old_if_needed"})

ENGINE_CORE_MARKER = "EngineCore"
# comm is cut to 15 bytes: "VLLM::EngineCore" becomes "VLLM::EngineCor".
_ENGINE_CORE_COMM = re.compile(r"EngineCor")

REMEDIES: dict[Classification, str] = {
    C.SPINNING_IN_MM_CACHE: (
        "This is the multimodal processor cache eviction hang; the process cannot recover. "
        "Restart the server. To prevent it: pip install vllm-mmcache-fix next to vLLM (it "
        "loads as a vLLM plugin), or start vLLM with --mm-processor-cache-gb 0 (no cache). "
        "See `vllm-mmcache-fix check`."
    ),
    C.SPINNING: (
        "A thread spins without ever blocking: the signature of the multimodal processor "
        "cache eviction hang, but its stack was not checked. To confirm, run again with py-spy "
        "installed (pip install py-spy) as root or as the server's user. If it is that hang: "
        "restart the server, and prevent it with pip install vllm-mmcache-fix or "
        "--mm-processor-cache-gb 0 (see `vllm-mmcache-fix check`)."
    ),
    C.SPINNING_ELSEWHERE: (
        "A thread spins, but not in the multimodal cache: this is not the hang "
        "vllm-mmcache-fix prevents. Take a few `py-spy dump --pid PID` to see where it runs."
    ),
    C.BLOCKED: (
        "Threads are stopped or in uninterruptible sleep for the whole interval. A stopped "
        "process (T) resumes with `kill -CONT PID` or when its debugger detaches; D means "
        "a wait in the kernel (disk, network file system, device driver): see wchan/syscall. "
        "This is not the multimodal cache hang."
    ),
    C.ACTIVE: "The processes are working; nothing stuck was seen in this interval.",
    C.IDLE: (
        "The processes are idle. If clients are waiting, their requests are not reaching "
        "these processes."
    ),
    C.EXITED: (
        "The process exited during the sample. If it was the server or its EngineCore, "
        "check the server's log for why."
    ),
}

# A few syscall numbers worth naming in the evidence.
_SYSCALL_NAMES: dict[str, dict[int, str]] = {
    "x86_64": {
        0: "read",
        7: "poll",
        23: "select",
        35: "nanosleep",
        45: "recvfrom",
        47: "recvmsg",
        61: "wait4",
        202: "futex",
        230: "clock_nanosleep",
        232: "epoll_wait",
        270: "pselect6",
        271: "ppoll",
        281: "epoll_pwait",
        441: "epoll_pwait2",
    },
    "aarch64": {
        22: "epoll_pwait",
        63: "read",
        72: "pselect6",
        73: "ppoll",
        98: "futex",
        101: "nanosleep",
        115: "clock_nanosleep",
        207: "recvfrom",
        212: "recvmsg",
        260: "wait4",
        441: "epoll_pwait2",
    },
}


class DiagnoseError(RuntimeError):
    """The diagnosis could not be made; the message says why."""


# --------------------------------------------------------------------------- results


@dataclass
class ThreadReport:
    """What one thread did during the interval."""

    tid: int
    name: str
    """The kernel's thread name (``comm``)."""
    python_name: str | None
    """The Python thread name, from py-spy."""
    states: str
    """State letters seen, in sampling order (``R`` running, ``S`` sleeping, ...)."""
    cpu_seconds: float
    cpu_fraction: float
    runnable_fraction: float | None
    """Share of the interval spent running or waiting for a CPU; None when unknown."""
    voluntary_switches: int
    nonvoluntary_switches: int
    syscall: str | None
    """At the end of the interval: ``running``, a syscall name or number, or None."""
    wchan: str | None
    spinning: bool = False
    blocked: bool = False
    new: bool = False
    """Started during the interval; its numbers cover only part of it."""
    stack: list[str] | None = None
    """Frames, innermost first, from py-spy (spinning threads only)."""
    in_mm_cache: bool | None = None
    """The stack is in the mm cache eviction loop; None when not checked."""

    @property
    def label(self) -> str:
        return self.python_name or self.name

    def as_dict(self) -> dict[str, Any]:
        return {
            "tid": self.tid,
            "name": self.name,
            "python_name": self.python_name,
            "states": self.states,
            "cpu_seconds": round(self.cpu_seconds, 3),
            "cpu_fraction": round(self.cpu_fraction, 3),
            "runnable_fraction": None
            if self.runnable_fraction is None
            else round(self.runnable_fraction, 3),
            "voluntary_switches": self.voluntary_switches,
            "nonvoluntary_switches": self.nonvoluntary_switches,
            "syscall": self.syscall,
            "wchan": self.wchan,
            "spinning": self.spinning,
            "blocked": self.blocked,
            "new": self.new,
            "stack": self.stack,
            "in_mm_cache": self.in_mm_cache,
        }


@dataclass
class StackCheck:
    """The py-spy part of one process's diagnosis."""

    status: str
    """``checked``, ``not-found``, ``disabled`` or ``failed``."""
    detail: str = ""
    dumps: int = 0
    text: str | None = None
    """The last (or the matching) dump, verbatim."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "detail": self.detail,
            "dumps": self.dumps,
            "text": self.text,
        }


@dataclass
class ProcessReport:
    pid: int
    ppid: int
    role: str
    """``EngineCore``, ``target`` (the PID asked about) or ``descendant``."""
    comm: str
    cmdline: str
    classification: Classification
    reason: str
    cpu_fraction: float
    threads: list[ThreadReport] = field(default_factory=list)
    stack_check: StackCheck | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "ppid": self.ppid,
            "role": self.role,
            "comm": self.comm,
            "cmdline": self.cmdline,
            "classification": self.classification.value,
            "reason": self.reason,
            "cpu_fraction": round(self.cpu_fraction, 3),
            "stack_check": None if self.stack_check is None else self.stack_check.as_dict(),
            "threads": [t.as_dict() for t in self.threads],
        }


@dataclass
class Diagnosis:
    pid: int
    interval: float
    """Seconds actually sampled."""
    classification: Classification
    summary: str
    remedy: str
    py_spy: str
    """How stacks were looked at, for humans."""
    processes: list[ProcessReport]
    notes: list[str] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        return exit_code(self)

    def as_dict(self) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "interval": round(self.interval, 3),
            "classification": self.classification.value,
            "exit_code": self.exit_code,
            "summary": self.summary,
            "remedy": self.remedy,
            "py_spy": self.py_spy,
            "notes": list(self.notes),
            "thresholds": {
                "spin_min_cpu_fraction": SPIN_MIN_CPU_FRACTION,
                "spin_min_runnable_fraction": SPIN_MIN_RUNNABLE_FRACTION,
                "spin_max_voluntary_per_sec": SPIN_MAX_VOLUNTARY_PER_SEC,
                "idle_max_cpu_fraction": IDLE_MAX_CPU_FRACTION,
                "blocked_states": "".join(sorted(BLOCKED_STATES)),
            },
            "processes": [p.as_dict() for p in self.processes],
        }


def exit_code(d: Diagnosis) -> int:
    """The command's exit status for a diagnosis (see ``EXIT_CODES``)."""
    return EXIT_CODES[d.classification]


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


@dataclass
class _Stat:
    comm: str
    state: str
    ppid: int
    ticks: int
    starttime: int


def _parse_stat(text: str, path: Path) -> _Stat:
    # The name is in parentheses and may itself contain spaces and parentheses.
    open_paren = text.find("(")
    close_paren = text.rfind(")")
    rest = text[close_paren + 2 :].split()
    if open_paren < 0 or close_paren < open_paren or len(rest) < 20:
        raise DiagnoseError(f"cannot parse {path}: {text[:80]!r}")
    return _Stat(
        comm=text[open_paren + 1 : close_paren],
        state=rest[0],
        ppid=int(rest[1]),
        ticks=int(rest[11]) + int(rest[12]),
        starttime=int(rest[19]),
    )


def _read_stat(path: Path) -> _Stat:
    text = _read(path)
    assert text is not None
    return _parse_stat(text, path)


def _switches(path: Path) -> tuple[int, int]:
    text = _read(path)
    assert text is not None
    voluntary = nonvoluntary = 0
    for line in text.splitlines():
        if line.startswith("voluntary_ctxt_switches:"):
            voluntary = int(line.split(":", 1)[1])
        elif line.startswith("nonvoluntary_ctxt_switches:"):
            nonvoluntary = int(line.split(":", 1)[1])
    return voluntary, nonvoluntary


def _runnable_ns(text: str | None) -> int | None:
    fields = (text or "").split()
    if len(fields) < 2 or not (fields[0].isdigit() and fields[1].isdigit()):
        return None
    return int(fields[0]) + int(fields[1])


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
    ticks: int
    voluntary: int
    nonvoluntary: int
    syscall: str | None = None
    wchan: str | None = None
    runnable_ns: int | None = None
    """Time on a CPU plus time waiting for one, from schedstat."""


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
                sample.runnable_ns = _runnable_ns(_read(base / "schedstat", optional=True))
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
    text = _read(proc / str(pid) / "cmdline", optional=True) or ""
    return " ".join(part for part in text.split("\0") if part)


def is_engine_core(comm: str, cmdline: str) -> bool:
    """vLLM titles its engine processes ``VLLM::EngineCore`` or ``..._DP<n>``."""
    return ENGINE_CORE_MARKER in cmdline or bool(_ENGINE_CORE_COMM.search(comm))


# --------------------------------------------------------------------------- classification


def thread_is_spinning(
    cpu_fraction: float,
    runnable_fraction: float | None,
    voluntary_switches: int,
    seconds: float,
) -> bool:
    if voluntary_switches > max(1.0, SPIN_MAX_VOLUNTARY_PER_SEC * seconds):
        return False
    if cpu_fraction >= SPIN_MIN_CPU_FRACTION:
        return True
    return runnable_fraction is not None and runnable_fraction >= SPIN_MIN_RUNNABLE_FRACTION


def thread_is_blocked(states: str) -> bool:
    return len(states) >= 2 and all(state in BLOCKED_STATES for state in states)


def stack_in_mm_cache(frames: Iterable[tuple[str, str]]) -> bool:
    """``frames`` are ``(function, file)``; see the module docstring for the rule."""
    names: set[str] = set()
    for function, filename in frames:
        path = filename.replace("\\", "/")
        if any(marker in path for marker in CACHE_FILE_MARKERS):
            names.add(function.rsplit(".", 1)[-1])
    return bool(names & EVICTION_FRAMES) and bool(names & EVICTION_CALLERS)


def classify_process(
    threads: Sequence[ThreadReport],
    cpu_fraction: float,
    stack_checked: bool,
) -> tuple[Classification, str]:
    """Class and reason of a live process from its thread reports."""
    spinning = [t for t in threads if t.spinning]
    if spinning:
        hot = ", ".join(_thread_brief(t) for t in spinning)
        if not stack_checked:
            return C.SPINNING, (
                f"spinning thread(s) {hot}; stack not checked: this matches the mm cache "
                "hang's signature"
            )
        in_cache = [t for t in spinning if t.in_mm_cache]
        if in_cache:
            where = _stack_brief(in_cache[0].stack or [])
            return C.SPINNING_IN_MM_CACHE, (
                f"thread {_thread_brief(in_cache[0])} spins in the mm cache eviction loop"
                + (f" ({where})" if where else "")
            )
        return C.SPINNING_ELSEWHERE, f"spinning thread(s) {hot}; stack not in the mm cache"
    blocked = [t for t in threads if t.blocked]
    if blocked:
        details = ", ".join(
            f"{_thread_brief(t, cpu=False)} state {t.states[-1]}"
            + (f" wchan {t.wchan}" if t.wchan and t.wchan != "0" else "")
            for t in blocked
        )
        return C.BLOCKED, f"blocked thread(s): {details}"
    if cpu_fraction <= IDLE_MAX_CPU_FRACTION:
        return C.IDLE, f"all {len(threads)} thread(s) idle, {cpu_fraction:.0%} CPU"
    return C.ACTIVE, f"{cpu_fraction:.0%} CPU, no thread spinning"


def _thread_brief(t: ThreadReport, *, cpu: bool = True) -> str:
    text = f"{t.tid} {t.label!r}"
    if not cpu:
        return text
    text += f" at {t.cpu_fraction:.0%} CPU"
    if t.runnable_fraction is not None and t.cpu_fraction < SPIN_MIN_CPU_FRACTION:
        text += f" (runnable {t.runnable_fraction:.0%} of the time)"
    return text


def _stack_brief(stack: Sequence[str]) -> str:
    names = [frame.split(" (", 1)[0] for frame in stack]
    picked = [n for n in names if n.rsplit(".", 1)[-1] in EVICTION_FRAMES | EVICTION_CALLERS]
    return " <- ".join(picked[:4])


def overall(classes: Iterable[Classification]) -> Classification:
    present = set(classes)
    for candidate in SEVERITY:
        if candidate in present:
            return candidate
    return C.EXITED


# --------------------------------------------------------------------------- py-spy


def find_py_spy() -> str | None:
    """The py-spy executable: next to this interpreter, in its scripts dir, or on PATH."""
    candidates = [Path(sys.executable).parent / "py-spy"]
    scripts = sysconfig.get_path("scripts")
    if scripts:
        candidates.append(Path(scripts) / "py-spy")
    for candidate in candidates:
        try:
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return str(candidate)
        except OSError:  # a directory this user may not enter
            continue
    return shutil.which("py-spy")


_THREAD_LINE = re.compile(r'^Thread (0x[0-9a-fA-F]+|\d+) \(([^)]*)\)(?::\s*"(.*)")?\s*$')
_FRAME_LINE = re.compile(r"^\s+(.+?) \((.+?)(?::(\d+))?\)\s*$")


@dataclass
class _DumpThread:
    ident: str
    status: str
    name: str | None
    frames: list[tuple[str, str, int | None]]

    @property
    def tid(self) -> int | None:
        return None if self.ident.startswith("0x") else int(self.ident)

    def lines(self) -> list[str]:
        return [f"{f} ({p}{'' if n is None else f':{n}'})" for f, p, n in self.frames]


def parse_py_spy_dump(text: str) -> list[_DumpThread]:
    """Threads of a ``py-spy dump --full-filenames`` text."""
    threads: list[_DumpThread] = []
    current: _DumpThread | None = None
    for line in text.splitlines():
        header = _THREAD_LINE.match(line)
        if header:
            current = _DumpThread(header.group(1), header.group(2), header.group(3), [])
            threads.append(current)
            continue
        frame = _FRAME_LINE.match(line)
        if frame and current is not None:
            number = frame.group(3)
            current.frames.append(
                (frame.group(1), frame.group(2), None if number is None else int(number))
            )
        elif line.strip() and not line.startswith((" ", "\t")):
            current = None
    return threads


_DENIED = re.compile(r"permission denied|operation not permitted|ptrace", re.IGNORECASE)
PTRACE_DENIED = (
    "py-spy was denied access to the process (it needs ptrace permission: run as root or as "
    "the server's user; in a container add CAP_SYS_PTRACE)"
)


def _run_py_spy(exe: str, pid: int) -> tuple[str | None, str, bool]:
    """(dump text or None, error, whether trying again is pointless)."""
    cmd = [exe, "dump", "--nonblocking", "--full-filenames", "--pid", str(pid)]
    try:
        done = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            errors="replace",
            timeout=PY_SPY_TIMEOUT,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return None, f"py-spy dump timed out after {PY_SPY_TIMEOUT:.0f} s", False
    except OSError as exc:
        return None, f"py-spy could not run: {exc}", True
    if done.returncode != 0:
        lines = [ln for ln in (done.stderr or done.stdout).splitlines() if ln.strip()]
        first = lines[0].strip() if lines else f"exit status {done.returncode}"
        if _DENIED.search(first):
            return None, PTRACE_DENIED, True
        return None, f"py-spy dump failed: {first}", False
    return done.stdout, "", False


def check_stacks(exe: str, pid: int, threads: Sequence[ThreadReport]) -> StackCheck:
    """Dump ``pid`` until every spinning Python thread is seen in the cache loop (or give up).

    Fills ``python_name`` of all ``threads``, and ``stack`` and ``in_mm_cache`` of the
    spinning ones, in place.
    """
    hot = [t for t in threads if t.spinning]
    pending = {t.tid: t for t in hot}
    check = StackCheck(status="failed")
    deadline = time.monotonic() + PY_SPY_BUDGET
    while check.dumps < PY_SPY_MAX_DUMPS and time.monotonic() < deadline:
        check.dumps += 1
        text, error, fatal = _run_py_spy(exe, pid)
        if text is None:
            if check.status != "checked":
                check.detail = error
            if fatal:
                break
            continue
        check.status = "checked"
        check.detail = ""
        check.text = text
        seen = {d.tid: d for d in parse_py_spy_dump(text) if d.tid is not None}
        for report in threads:
            dumped = seen.get(report.tid)
            if dumped is not None and dumped.name:
                report.python_name = dumped.name
        for tid, report in list(pending.items()):
            dumped = seen.get(tid)
            if dumped is None:
                # py-spy lists Python threads only: a hot native thread is not the cache.
                report.in_mm_cache = False
                report.stack = None
                del pending[tid]
                continue
            report.stack = dumped.lines()
            report.in_mm_cache = stack_in_mm_cache((f, p) for f, p, _ in dumped.frames)
            if report.in_mm_cache:
                del pending[tid]
        if not pending:
            break
    if check.status == "checked":
        for report in hot:
            if report.in_mm_cache is None:
                report.in_mm_cache = False
    return check


# --------------------------------------------------------------------------- diagnose


def diagnose(
    pid: int,
    *,
    interval: float = 2.0,
    use_py_spy: bool = True,
    proc_root: str | os.PathLike[str] = "/proc",
) -> Diagnosis:
    """Sample ``pid`` and its descendants for ``interval`` seconds and classify them.

    ``pid`` may be the API server (its EngineCore children are found) or an EngineCore.
    ``proc_root`` is where procfs is mounted; py-spy is only used with ``/proc``, where
    PIDs are this namespace's. Raises :class:`DiagnoseError` for a PID that does not exist,
    a required /proc file that cannot be read, or a bad interval.
    """
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        raise DiagnoseError(f"invalid PID {pid!r}")
    if not interval >= MIN_INTERVAL:
        raise DiagnoseError(f"interval must be at least {MIN_INTERVAL} s, got {interval}")
    proc = Path(proc_root)
    if not (proc / str(pid)).is_dir():
        raise DiagnoseError(f"no process with PID {pid}")

    first = _first_samples(proc, pid)
    started = min(sample.time for sample, _ in first.values())
    states = _watch_states(proc, first, started + interval)
    reports = [
        _process_report(proc, member, before, meta, states, pid)
        for member, (before, meta) in first.items()
    ]
    wall = time.monotonic() - started
    py_spy = _check_hot_stacks(reports, use_py_spy, proc)
    for report in reports:
        if report.classification is not C.EXITED:
            checked = report.stack_check is not None and report.stack_check.status == "checked"
            report.classification, report.reason = classify_process(
                report.threads, report.cpu_fraction, checked
            )

    notes = [
        f"PID {r.pid}: {r.stack_check.detail}"
        for r in reports
        if r.stack_check is not None and r.stack_check.status == "failed"
    ]
    if not any(r.role == "EngineCore" for r in reports):
        notes.append(f"no EngineCore process among PID {pid} and its descendants")
    whole = overall(r.classification for r in reports)
    return Diagnosis(
        pid=pid,
        interval=wall,
        classification=whole,
        summary=_summary(whole, reports),
        remedy=REMEDIES[whole],
        py_spy=py_spy,
        processes=reports,
        notes=notes,
    )


@dataclass
class _Meta:
    ppid: int
    comm: str
    cmdline: str


def _first_samples(proc: Path, pid: int) -> dict[int, tuple[_ProcessSample, _Meta]]:
    first: dict[int, tuple[_ProcessSample, _Meta]] = {}
    for member in process_tree(pid, proc_root=proc):
        try:
            stat = _read_stat(proc / str(member) / "stat")
            sample = _sample_process(proc, member, full=True)
        except _Gone:
            if member == pid:
                raise DiagnoseError(f"no process with PID {pid}") from None
            continue  # a descendant that just ended
        first[member] = (sample, _Meta(stat.ppid, stat.comm, _cmdline(proc, member)))
    return first


def _watch_states(
    proc: Path, first: dict[int, tuple[_ProcessSample, _Meta]], end_at: float
) -> dict[tuple[int, int], list[str]]:
    """State letters of every thread, sampled until ``end_at`` (the first sample included)."""
    states: dict[tuple[int, int], list[str]] = {}
    for member, (sample, _) in first.items():
        for tid, thread in sample.threads.items():
            states[(member, tid)] = [thread.state]
    while True:
        remaining = end_at - time.monotonic()
        if remaining <= 0:
            return states
        time.sleep(min(STATE_SAMPLE_PERIOD, remaining))
        if time.monotonic() >= end_at:
            return states
        for member, (sample, _) in first.items():
            try:
                now = _sample_process(proc, member, full=False)
            except _Gone:
                continue
            if now.starttime == sample.starttime:
                for tid, thread in now.threads.items():
                    states.setdefault((member, tid), []).append(thread.state)


def _process_report(
    proc: Path,
    member: int,
    before: _ProcessSample,
    meta: _Meta,
    states: dict[tuple[int, int], list[str]],
    target: int,
) -> ProcessReport:
    if is_engine_core(meta.comm, meta.cmdline):
        role = "EngineCore"
    else:
        role = "target" if member == target else "descendant"
    report = ProcessReport(member, meta.ppid, role, meta.comm, meta.cmdline, C.EXITED, "", 0.0)
    try:
        after = _sample_process(proc, member, full=True)
        end_state = _read_stat(proc / str(member) / "stat").state
    except _Gone:
        report.reason = "exited during the sample"
        return report
    if after.starttime != before.starttime:
        report.reason = "exited during the sample (its PID is now another process's)"
        return report
    if end_state in ("Z", "X"):
        report.reason = "exited: a zombie not yet reaped by its parent"
        return report
    seconds = max(after.time - before.time, 1e-6)
    tick = float(os.sysconf("SC_CLK_TCK"))
    threads = [
        _thread_report(before.threads.get(tid), end, states.get((member, tid), []), seconds, tick)
        for tid, end in after.threads.items()
    ]
    report.threads = sorted(threads, key=lambda t: (-t.cpu_seconds, t.tid))
    report.cpu_fraction = sum(t.cpu_seconds for t in threads) / seconds
    report.classification = C.IDLE  # placeholder until the stacks are checked
    return report


def _thread_report(
    start: _ThreadSample | None,
    end: _ThreadSample,
    seen: list[str],
    seconds: float,
    tick: float,
) -> ThreadReport:
    seen = seen + [end.state]
    cpu = (end.ticks - (start.ticks if start else 0)) / tick
    # schedstat counts a wait for a CPU only once it ends, so a thread still queued at the
    # end of a loaded interval looks less runnable than it was: take the larger estimate.
    estimates: list[float] = []
    if start is not None:
        if start.runnable_ns is not None and end.runnable_ns is not None:
            estimates.append((end.runnable_ns - start.runnable_ns) / 1e9 / seconds)
        if len(seen) >= 2:
            estimates.append(seen.count("R") / len(seen))
    runnable = min(1.0, max(estimates)) if estimates else None
    thread = ThreadReport(
        tid=end.tid,
        name=end.comm,
        python_name=None,
        states="".join(seen),
        cpu_seconds=cpu,
        cpu_fraction=cpu / seconds,
        runnable_fraction=runnable,
        voluntary_switches=end.voluntary - (start.voluntary if start else 0),
        nonvoluntary_switches=end.nonvoluntary - (start.nonvoluntary if start else 0),
        syscall=end.syscall,
        wchan=end.wchan,
        new=start is None,
    )
    if start is not None:
        thread.spinning = thread_is_spinning(
            thread.cpu_fraction, runnable, thread.voluntary_switches, seconds
        )
        thread.blocked = thread_is_blocked(thread.states)
    return thread


def _check_hot_stacks(reports: Sequence[ProcessReport], use_py_spy: bool, proc: Path) -> str:
    """Run py-spy on processes with spinning threads; how stacks were looked at."""
    hot = [r for r in reports if any(t.spinning for t in r.threads)]
    exe = None
    if not use_py_spy:
        status, why = "disabled", "py-spy disabled"
    elif proc.resolve() != Path("/proc"):
        status, why = "disabled", f"py-spy not used: PIDs under {proc} may be another namespace's"
    else:
        exe = find_py_spy()
        status, why = "not-found", "py-spy not found (pip install py-spy)"
    if exe is None:
        for report in hot:
            report.stack_check = StackCheck(status=status, detail=why)
        return why
    if not hot:
        return f"{exe} (not needed: no spinning thread)"
    for report in hot:
        report.stack_check = check_stacks(exe, report.pid, report.threads)
    failed = [str(r.pid) for r in hot if r.stack_check and r.stack_check.status == "failed"]
    return f"{exe} dump --nonblocking" + (
        f" (failed for PID {', '.join(failed)})" if failed else ""
    )


def _summary(whole: Classification, reports: Sequence[ProcessReport]) -> str:
    for report in reports:
        if report.classification is whole:
            return f"{report.role} PID {report.pid}: {report.reason}"
    return "nothing sampled"


# --------------------------------------------------------------------------- rendering

_MAX_THREADS_SHOWN = 8
_MAX_COMMAND_SHOWN = 160


def render(d: Diagnosis) -> str:
    """A human-readable report."""
    lines = [
        f"PID {d.pid}: {d.classification.value}",
        f"  {d.summary}",
        f"  sampled {d.interval:.1f} s; stacks: {d.py_spy}",
        "",
    ]
    for report in d.processes:
        lines.extend(_render_process(report))
        lines.append("")
    lines.extend(f"note: {note}" for note in d.notes)
    lines.append(f"What to do: {d.remedy}")
    return "\n".join(lines)


def _render_process(report: ProcessReport) -> list[str]:
    command = " ".join((report.cmdline or report.comm).split())
    if len(command) > _MAX_COMMAND_SHOWN:
        command = command[: _MAX_COMMAND_SHOWN - 3] + "..."
    lines = [
        f"PID {report.pid} ({report.role}, parent {report.ppid}): "
        f"{report.classification.value}: {report.reason}",
        f"  command: {command}",
    ]
    if report.threads:
        lines.append(
            f"  CPU {report.cpu_fraction:.0%} of one core, {len(report.threads)} thread(s)"
        )
    flagged = [t for t in report.threads if t.spinning or t.blocked]
    rest = [t for t in report.threads if not (t.spinning or t.blocked)]
    shown = flagged + rest[: max(0, _MAX_THREADS_SHOWN - len(flagged))]
    for t in shown:
        mark = "SPIN" if t.spinning else ("BLOCKED" if t.blocked else "")
        lines.append(
            f"  {mark:7} TID {t.tid:<7} {t.label[:24]:24} cpu {t.cpu_fraction:4.0%} "
            f"runnable {_percent(t.runnable_fraction):>4} "
            f"vol +{t.voluntary_switches:<5} nonvol +{t.nonvoluntary_switches:<6} "
            f"states {_squeeze(t.states):8} syscall {t.syscall or '?'}"
            + (f" wchan {t.wchan}" if t.wchan and t.wchan != "0" else "")
        )
    if len(report.threads) > len(shown):
        lines.append(f"          (+{len(report.threads) - len(shown)} less busy thread(s))")
    for t in flagged:
        if t.stack:
            verdict = "in the mm cache eviction loop" if t.in_mm_cache else "elsewhere"
            lines.append(f"  stack of TID {t.tid} ({verdict}), innermost first:")
            lines.extend(f"    {frame}" for frame in t.stack)
    check = report.stack_check
    if check is not None and check.status != "checked":
        lines.append(f"  stack not checked: {check.detail}")
    return lines


def _percent(value: float | None) -> str:
    return "?" if value is None else f"{value:.0%}"


def _squeeze(states: str) -> str:
    """``RRRRSS`` -> ``R4S2``."""
    out: list[str] = []
    for state in states:
        if out and out[-1][0] == state:
            count = int(out[-1][1:] or "1") + 1
            out[-1] = f"{state}{count}"
        else:
            out.append(state)
    return "".join(out)
