"""Stack dumps with ``py-spy dump``, when py-spy is installed."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from .classify import input_thread_gone, stack_busy_waits, stack_in_mm_cache
from .results import StackCheck, ThreadReport
from .rules import PY_SPY_BUDGET, PY_SPY_MAX_DUMPS, PY_SPY_TIMEOUT

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


def _run_py_spy(exe: str, pid: int, pause: bool = False) -> tuple[str | None, str, bool]:
    """(dump text or None, error, whether trying again is pointless). ``pause``: let py-spy
    stop the process while it reads it (milliseconds), as it does by default."""
    cmd = [exe, "dump", *(() if pause else ("--nonblocking",)), "--full-filenames"]
    cmd += ["--pid", str(pid)]
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


def _unmapped(threads: Sequence[_DumpThread]) -> bool:
    """A dump that names no thread by the OS's thread id: py-spy without pausing the process
    gives the ``pthread_t`` of each Python thread below Python 3.11 (3.10: ``Thread
    0x7F32A8833B80 (active)``), and on 3.9 no thread names either."""
    return bool(threads) and all(d.tid is None for d in threads)


def _nameless(threads: Sequence[_DumpThread]) -> bool:
    return bool(threads) and all(d.name is None for d in threads)


def _dump(
    exe: str, pid: int, lacking: Callable[[Sequence[_DumpThread]], bool], pause: bool = False
) -> tuple[str | None, list[_DumpThread], str, bool, bool]:
    """One dump without pausing the process; once more pausing it (milliseconds) when the
    first one ``lacking`` what the check needs (``pause``: known to lack it, the paused one
    only). (text or None, its threads, error, whether trying again is pointless, whether the
    process was paused)."""
    text, error, fatal = _run_py_spy(exe, pid, pause=pause)
    if text is not None and pause:
        return text, parse_py_spy_dump(text), "", False, True
    if text is None:
        return None, [], error, fatal, False
    threads = parse_py_spy_dump(text)
    if lacking(threads):
        again, _, _ = _run_py_spy(exe, pid, pause=True)
        if again is not None:
            paused = parse_py_spy_dump(again)
            if paused and not lacking(paused):
                return again, paused, "", False, True
    return text, threads, "", False, False


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
        # Once a dump had to pause the process, the next ones go straight to pausing it.
        text, dump, error, fatal, paused = _dump(exe, pid, _unmapped, pause=check.paused)
        if text is None:
            if check.status != "checked":
                check.detail = error
            if fatal:
                break
            continue
        check.status = "checked"
        check.detail = ""
        check.text = text
        check.paused = check.paused or paused
        seen = {d.tid: d for d in dump if d.tid is not None}
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
            report.busy_wait = stack_busy_waits((f, p) for f, p, _ in dumped.frames)
            if report.in_mm_cache or (report.busy_wait and not report.in_mm_cache):
                del pending[tid]
        if not pending:
            break
    if check.status == "checked":
        for report in hot:
            if report.in_mm_cache is None:
                report.in_mm_cache = False
            if report.busy_wait is None:
                report.busy_wait = False
    return check


def check_engine_threads(exe: str, pid: int) -> tuple[bool | None, StackCheck]:
    """One dump of an EngineCore that does not spin: is its input thread still there?

    ``(True, check)`` when the output thread runs without the input thread; ``None`` when
    the dump failed or shows neither thread."""
    check = StackCheck(status="failed")
    for _ in range(2):
        check.dumps += 1
        text, dump, error, fatal, paused = _dump(exe, pid, _nameless)
        if text is not None:
            check.status, check.detail, check.text = "checked", "", text
            check.paused = paused
            threads = [(d.name, [f for f, _, _ in d.frames]) for d in dump]
            return input_thread_gone(threads), check
        check.detail = error
        if fatal:
            break
    return None, check
