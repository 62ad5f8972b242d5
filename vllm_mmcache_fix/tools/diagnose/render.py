"""Text for humans (``--json`` uses ``Diagnosis.as_dict``)."""

from __future__ import annotations

from .results import Diagnosis, ProcessReport
from .rules import INPUT_THREAD_FUNCTION, STATE_SAMPLE_PERIOD

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
    lines.append("")
    lines.extend(LEGEND)
    return "\n".join(lines)


LEGEND = (
    "Legend:",
    "  SPIN     the thread used a core (or waited for one) the whole interval and hardly ever",
    "           blocked: the signature of a busy loop",
    "  BUSY     the same numbers where vLLM runs busy on purpose (a Worker's busy-wait, the",
    "           engine's busy loop at work, an API server serving): not the freeze",
    "  BLOCKED  the thread was stopped (T, t) or in uninterruptible sleep (D) all along",
    "  cpu      share of one core it used; runnable: share of the time it ran or waited for a CPU",
    "  vol      voluntary context switches (it waited for I/O, a lock, a queue); nonvol:",
    "           involuntary ones (it was preempted)",
    f"  states   its state every {STATE_SAMPLE_PERIOD:g} s: R running, S sleeping, D disk wait, "
    "T stopped, Z zombie",
    "           (R9S2: nine R, then two S)",
    "  syscall  where the thread waits in the kernel at the end (running: on a CPU)",
    f"  input thread  EngineCore's request reader ({INPUT_THREAD_FUNCTION}), from a py-spy dump",
)
"""What the columns and letters of the report mean (``--json`` has the same fields)."""


def _render_process(report: ProcessReport) -> list[str]:
    command = " ".join((report.cmdline or report.comm).split())
    if len(command) > _MAX_COMMAND_SHOWN:
        command = command[: _MAX_COMMAND_SHOWN - 3] + "..."
    lines = [
        f"PID {report.pid} ({report.role}"
        + (f", {report.kind}" if report.kind not in ("other", report.role) else "")
        + f", parent {report.ppid}): "
        f"{report.classification.value}: {report.reason}",
        f"  command: {command}",
    ]
    if report.threads:
        lines.append(
            f"  CPU {report.cpu_fraction:.0%} of one core, {len(report.threads)} thread(s)"
        )
    if report.input_thread_gone is not None:
        lines.append(f"  input thread: {'GONE' if report.input_thread_gone else 'alive'}")
    flagged = [t for t in report.threads if t.spinning or t.blocked]
    rest = [t for t in report.threads if not (t.spinning or t.blocked)]
    shown = flagged + rest[: max(0, _MAX_THREADS_SHOWN - len(flagged))]
    for t in shown:
        mark = ("BUSY" if t.expected else "SPIN") if t.spinning else ""
        mark = mark or ("BLOCKED" if t.blocked else "")
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
            verdict = (
                "in the mm cache eviction loop"
                if t.in_mm_cache
                else "vLLM's shared-memory busy-wait"
                if t.busy_wait
                else "elsewhere"
            )
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
