"""What a diagnosis returns: per thread, per process, overall (``as_dict`` for --json)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields
from typing import Any

from .. import exits
from .rules import (
    BLOCKED_STATES,
    EXIT_CODES,
    IDLE_MAX_CPU_FRACTION,
    SPIN_MAX_VOLUNTARY_PER_SEC,
    SPIN_MIN_CPU_FRACTION,
    SPIN_MIN_FAIR_SHARE,
    SPIN_MIN_RUNNABLE_FRACTION,
    Classification,
)

# --------------------------------------------------------------------------- results


def _plain(record: Any) -> dict[str, Any]:
    """A record's fields in their order, as JSON takes them (:func:`_json_value`)."""
    return {spec.name: _json_value(getattr(record, spec.name)) for spec in fields(record)}


def _json_value(value: Any) -> Any:
    """Floats rounded to 3 places, enums by value, records by their ``as_dict``, lists item
    by item."""
    if isinstance(value, float):
        return round(value, 3)
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, list):
        return [_json_value(item) for item in value]
    if hasattr(value, "as_dict"):
        return value.as_dict()
    return value


class _Record:
    """A result whose ``--json`` form is its fields (:func:`_plain`)."""

    def as_dict(self) -> dict[str, Any]:
        return _plain(self)


@dataclass
class ThreadReport(_Record):
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
    on_cpu_share: float | None = None
    """Of the time it was runnable, the share it was on a CPU (schedstat); None when unknown.
    Low means starved: it waited for a CPU far longer than it ran."""
    busy_wait: bool | None = None
    """The stack polls vLLM's shared-memory message queue (a Worker waiting for its next
    step, EngineCore for its Workers); None when not checked."""
    expected: str | None = None
    """Why a spinning thread is not the freeze (a Worker's busy-wait, EngineCore's busy
    loop at work, ...); None for a thread that counts."""

    @property
    def label(self) -> str:
        return self.python_name or self.name


@dataclass
class StackCheck(_Record):
    """The py-spy part of one process's diagnosis."""

    status: str
    """``checked``, ``not-found``, ``disabled`` or ``failed``."""
    detail: str = ""
    dumps: int = 0
    text: str | None = None
    """The last (or the matching) dump, verbatim."""
    paused: bool = False
    """A dump paused the process for its milliseconds: the server's Python is older than 3.11,
    where py-spy can tell which OS thread a Python thread is only that way."""


@dataclass
class ProcessReport(_Record):
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
    input_thread_gone: bool | None = None
    """EngineCore only: its input thread is gone (True), there (False), not checked (None)."""
    kind: str = "other"
    """Which of vLLM's processes: ``EngineCore``, ``Worker``, ``APIServer``,
    ``DPCoordinator`` or ``other`` (rules.PROCESS_KINDS)."""


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
    left_out: list[int] = field(default_factory=list)
    """Descendants of the PID that are this diagnosis itself or the shell that started it."""
    fair_share: float | None = None
    """The share of a CPU a thread that always wants one got on this machine meanwhile."""

    @property
    def exit_code(self) -> int:
        return exit_code(self)

    def as_dict(self) -> dict[str, Any]:
        data = _plain(self)
        del data["classification"]  # the envelope's verdict
        data["thresholds"] = {
            "spin_min_cpu_fraction": SPIN_MIN_CPU_FRACTION,
            "spin_min_runnable_fraction": SPIN_MIN_RUNNABLE_FRACTION,
            "spin_max_voluntary_per_sec": SPIN_MAX_VOLUNTARY_PER_SEC,
            "spin_min_fair_share": SPIN_MIN_FAIR_SHARE,
            "idle_max_cpu_fraction": IDLE_MAX_CPU_FRACTION,
            "blocked_states": "".join(sorted(BLOCKED_STATES)),
        }
        return exits.envelope("diagnose", self.classification.value, data)


def exit_code(d: Diagnosis) -> int:
    """The command's exit status for a diagnosis (see ``EXIT_CODES``)."""
    return EXIT_CODES[d.classification]
