"""Sampling a process tree over an interval and classifying it."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .classify import classify_process, overall, thread_is_blocked, thread_is_spinning
from .procfs import (
    _cmdline,
    _Gone,
    _ProcessSample,
    _read,
    _read_stat,
    _sample_process,
    _ThreadSample,
    is_engine_core,
    process_kind,
    process_tree,
)
from .pyspy import check_engine_threads, check_stacks, find_py_spy
from .results import Diagnosis, ProcessReport, StackCheck, ThreadReport
from .rules import MIN_INTERVAL, REMEDIES, STATE_SAMPLE_PERIOD, C, Classification, DiagnoseError

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

    first, left_out = _first_samples(proc, pid, _own_processes(proc, pid))
    started = min(sample.time for sample, _ in first.values())
    running: list[int] = []
    states = _watch_states(proc, first, started + interval, running)
    fair = fair_share(
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1),
        running,
    )
    reports = [
        _process_report(proc, member, before, meta, states, pid, fair)
        for member, (before, meta) in first.items()
    ]
    wall = time.monotonic() - started
    py_spy = _check_hot_stacks(reports, use_py_spy, proc)
    dumped = _check_engine_threads(reports, use_py_spy, proc)
    if dumped and not any(t.spinning for r in reports for t in r.threads):
        # (not "not needed": the verdict may rest on that dump)
        py_spy = f"{dumped} dump --nonblocking (EngineCore's threads: is its input thread alive?)"
        py_spy += _paused(reports)
    for report in reports:
        if report.classification is not C.EXITED:
            checked = report.stack_check is not None and report.stack_check.status == "checked"
            report.classification, report.reason = classify_process(
                report.threads,
                report.cpu_fraction,
                checked,
                bool(report.input_thread_gone),
                kind=report.kind,
                pid=report.pid,
            )

    notes = [
        f"PID {r.pid}: {r.stack_check.detail}"
        for r in reports
        if r.stack_check is not None and r.stack_check.status == "failed"
    ]
    if not any(r.role == "EngineCore" for r in reports):
        notes.append(f"no EngineCore process among PID {pid} and its descendants")
    if left_out:
        notes.append(
            f"left out PID {', '.join(map(str, sorted(left_out)))}: this diagnosis and the "
            "processes that started it"
        )
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
        left_out=sorted(left_out),
        fair_share=fair,
    )


@dataclass
class _Meta:
    ppid: int
    comm: str
    cmdline: str


def _own_processes(proc: Path, pid: int) -> set[int]:
    """This process and its ancestors below ``pid``: run from a shell inside the server's
    container (``diagnose --pid 1``), they are descendants of ``pid`` but not vLLM's."""
    if proc.resolve() != Path("/proc"):
        return set()  # another namespace's PIDs: ours are not among them
    own: set[int] = set()
    current = os.getpid()
    for _ in range(64):  # bounded: a broken chain cannot loop forever
        if current in (pid, 0, 1):
            break
        own.add(current)
        try:
            current = _read_stat(proc / str(current) / "stat").ppid
        except (_Gone, DiagnoseError):
            break
    else:
        return own
    return own if current == pid else {os.getpid()}


def _first_samples(
    proc: Path, pid: int, own: set[int]
) -> tuple[dict[int, tuple[_ProcessSample, _Meta]], set[int]]:
    """The first sample of every process of the tree but ``own`` (this process and the
    shells that started it) and this process's children (py-spy), and the members left
    out. Other children of those shells stay: one of them may be the server."""
    first: dict[int, tuple[_ProcessSample, _Meta]] = {}
    tree = process_tree(pid, proc_root=proc)
    me = {os.getpid()}
    left_out = {m for m in tree if m != pid and (m in own or _descends_from(proc, m, me, pid))}
    for member in tree:
        if member in left_out:
            continue
        try:
            stat = _read_stat(proc / str(member) / "stat")
            sample = _sample_process(proc, member, full=True)
        except _Gone:
            if member == pid:
                raise DiagnoseError(f"no process with PID {pid}") from None
            continue  # a descendant that just ended
        first[member] = (sample, _Meta(stat.ppid, stat.comm, _cmdline(proc, member)))
    return first, left_out


def _descends_from(proc: Path, pid: int, ancestors: set[int], stop: int) -> bool:
    """``pid`` has one of ``ancestors`` on its way up to ``stop`` (the diagnosed PID)."""
    current = pid
    for _ in range(64):
        if current in ancestors:
            return True
        if current in (stop, 0, 1):
            return False
        try:
            current = _read_stat(proc / str(current) / "stat").ppid
        except (_Gone, DiagnoseError):
            return False
    return False


def fair_share(cpus: int, procs_running: Sequence[int]) -> float | None:
    """The share of a CPU a thread that always wants one gets, from the machine's count of
    runnable threads (``procs_running`` of ``/proc/stat``, sampled): ``cpus`` over the mean
    count, at most 1; None without samples."""
    if not procs_running:
        return None
    mean = sum(procs_running) / len(procs_running)
    return min(1.0, max(1, cpus) / max(1.0, mean))


def _procs_running(proc: Path) -> int | None:
    try:
        text = _read(proc / "stat", optional=True)
    except _Gone:
        return None
    for line in (text or "").splitlines():
        if line.startswith("procs_running "):
            value = line.split()[1]
            return int(value) if value.isdigit() else None
    return None


def _watch_states(
    proc: Path,
    first: dict[int, tuple[_ProcessSample, _Meta]],
    end_at: float,
    running: list[int] | None = None,
) -> dict[tuple[int, int], list[str]]:
    """State letters of every thread, sampled until ``end_at`` (the first sample included);
    the machine's runnable thread count (``procs_running``) is appended to ``running``."""
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
        count = _procs_running(proc)
        if running is not None and count is not None:
            running.append(count)
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
    fair: float | None = None,
) -> ProcessReport:
    if is_engine_core(meta.comm, meta.cmdline):
        role = "EngineCore"
    else:
        role = "target" if member == target else "descendant"
    report = ProcessReport(member, meta.ppid, role, meta.comm, meta.cmdline, C.EXITED, "", 0.0)
    report.kind = process_kind(meta.comm, meta.cmdline)
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
        _thread_report(
            before.threads.get(tid), end, states.get((member, tid), []), seconds, tick, fair
        )
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
    fair: float | None = None,
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
    share = None
    if start is not None and None not in (
        start.runnable_ns,
        end.runnable_ns,
        start.on_cpu_ns,
        end.on_cpu_ns,
    ):
        queued_and_run = (end.runnable_ns or 0) - (start.runnable_ns or 0)
        run = (end.on_cpu_ns or 0) - (start.on_cpu_ns or 0)
        if queued_and_run > 0:
            share = min(1.0, max(0.0, run / queued_and_run))
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
        on_cpu_share=share,
    )
    if start is not None:
        thread.spinning = thread_is_spinning(
            thread.cpu_fraction, runnable, thread.voluntary_switches, seconds, share, fair
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
    return (
        f"{exe} dump --nonblocking"
        + (f" (failed for PID {', '.join(failed)})" if failed else "")
        + _paused(hot)
    )


def _paused(reports: Sequence[ProcessReport]) -> str:
    """What the summary of py-spy says of the dumps that paused a process."""
    pids = [str(r.pid) for r in reports if r.stack_check and r.stack_check.paused]
    if not pids:
        return ""
    return (
        f"; PID {', '.join(pids)} paused for one dump of milliseconds (Python < 3.11: "
        "py-spy tells its threads apart only so)"
    )


def _check_engine_threads(
    reports: Sequence[ProcessReport], use_py_spy: bool, proc: Path
) -> str | None:
    """One dump of each EngineCore that does not spin: is its input thread still alive?
    py-spy's path when it dumped one."""
    engines = [
        r
        for r in reports
        if r.role == "EngineCore"
        and r.classification is not C.EXITED
        and not any(t.spinning for t in r.threads)
    ]
    if not engines or not use_py_spy or proc.resolve() != Path("/proc"):
        return None
    exe = find_py_spy()
    if exe is None:
        return None
    for report in engines:
        gone, check = check_engine_threads(exe, report.pid)
        report.input_thread_gone = gone
        if report.stack_check is None:
            report.stack_check = check
    return str(exe)


def _summary(whole: Classification, reports: Sequence[ProcessReport]) -> str:
    for report in reports:
        if report.classification is whole:
            return f"{report.role} PID {report.pid}: {report.reason}"
    return "nothing sampled"
