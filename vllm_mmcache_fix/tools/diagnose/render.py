"""Text for humans (``--json`` uses ``Diagnosis.as_dict``)."""

from __future__ import annotations

from .results import Diagnosis, ProcessReport

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
