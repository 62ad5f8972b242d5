"""The rules as functions: when a thread spins, is blocked, or is in the mm cache."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ...vllm_layout import EVICTION_CALLERS, EVICTION_FRAMES
from .results import ThreadReport
from .rules import (
    BLOCKED_STATES,
    BUSY_WAIT_FILE_MARKERS,
    BUSY_WAIT_FRAMES,
    CACHE_FILE_MARKERS,
    IDLE_MAX_CPU_FRACTION,
    INPUT_THREAD_FUNCTION,
    KIND_API_SERVER,
    KIND_DP_COORDINATOR,
    KIND_ENGINE_CORE,
    KIND_OTHER,
    KIND_WORKER,
    OUTPUT_THREAD_FUNCTION,
    SEVERITY,
    SPIN_MAX_VOLUNTARY_PER_SEC,
    SPIN_MIN_CPU_FRACTION,
    SPIN_MIN_FAIR_SHARE,
    SPIN_MIN_RUNNABLE_FRACTION,
    C,
    Classification,
)

# --------------------------------------------------------------------------- classification


def thread_is_spinning(
    cpu_fraction: float,
    runnable_fraction: float | None,
    voluntary_switches: int,
    seconds: float,
    on_cpu_share: float | None = None,
    fair_share: float | None = None,
) -> bool:
    """Few voluntary switches, and a core used, or runnable all along while on a CPU for at
    least ``SPIN_MIN_FAIR_SHARE`` of the share a thread that always wants a CPU gets on this
    machine now (``fair_share``; 1 when unknown). ``on_cpu_share``: of the time it was
    runnable, the share it ran (schedstat). A thread that is runnable but gets much less
    than that (it polls with ``sched_yield``, or is starved) is not spinning."""
    if voluntary_switches > max(1.0, SPIN_MAX_VOLUNTARY_PER_SEC * seconds):
        return False
    if cpu_fraction >= SPIN_MIN_CPU_FRACTION:
        return True
    if runnable_fraction is None or runnable_fraction < SPIN_MIN_RUNNABLE_FRACTION:
        return False
    if on_cpu_share is None:
        return True
    return on_cpu_share >= SPIN_MIN_FAIR_SHARE * (1.0 if fair_share is None else fair_share)


def stack_busy_waits(frames: Iterable[tuple[str, str]]) -> bool:
    """``frames`` are ``(function, file)``: the stack polls vLLM's shared-memory queue."""
    for function, filename in frames:
        path = filename.replace("\\", "/")
        if function.rsplit(".", 1)[-1] in BUSY_WAIT_FRAMES and any(
            marker in path for marker in BUSY_WAIT_FILE_MARKERS
        ):
            return True
    return False


def expected_spin(thread: ThreadReport, kind: str, pid: int) -> str | None:
    """Why a spinning thread of a process of ``kind`` is not the freeze, or None when it
    counts. The freeze spins a thread of EngineCore: its input thread since vLLM 0.10.1, its
    busy loop on 0.10.0 (there only a stack dump tells it from a busy engine)."""
    if thread.in_mm_cache:
        return None
    if thread.busy_wait:
        return "polls vLLM's shared-memory message queue (a busy-wait by design)"
    if kind == KIND_WORKER:
        return (
            "a Worker: it busy-waits for its next step or computes one"
            if thread.stack is None
            else "a Worker computing a step"
        )
    if kind in (KIND_API_SERVER, KIND_DP_COORDINATOR):
        return f"the {kind} process serves; the freeze is EngineCore's"
    if kind == KIND_ENGINE_CORE and thread.tid == pid:
        return "EngineCore's busy loop (its main thread) at work: a busy engine"
    return None


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


def input_thread_gone(threads: Sequence[tuple[str | None, Sequence[str]]]) -> bool | None:
    """From one stack dump of an EngineCore process, ``(thread name, function names)`` per
    Python thread: True when its output thread runs and its input thread is gone, False when
    the input thread is there, None when the dump shows neither (not a multiprocess engine)."""

    def runs(function: str) -> bool:
        return any(
            (name is not None and function in name)
            or any(f.rsplit(".", 1)[-1] == function for f in frames)
            for name, frames in threads
        )

    if runs(INPUT_THREAD_FUNCTION):
        return False
    if runs(OUTPUT_THREAD_FUNCTION):
        return True
    return None


def classify_process(
    threads: Sequence[ThreadReport],
    cpu_fraction: float,
    stack_checked: bool,
    input_gone: bool = False,
    kind: str = KIND_OTHER,
    pid: int = 0,
) -> tuple[Classification, str]:
    """Class and reason of a live process from its thread reports (and, for an EngineCore,
    whether a stack dump found its input thread gone). ``kind`` and ``pid`` say which of
    vLLM's processes it is: spinning threads that are expected there
    (:func:`expected_spin`) make it ``active``, not spinning."""
    for t in threads:
        t.expected = expected_spin(t, kind, pid) if t.spinning else None
    spinning = [t for t in threads if t.spinning and t.expected is None]
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
    if input_gone:
        return C.ENGINE_INPUT_THREAD_GONE, (
            f"its output thread ({OUTPUT_THREAD_FUNCTION}) runs but its input thread "
            f"({INPUT_THREAD_FUNCTION}) is gone: it reads no more requests "
            f"({cpu_fraction:.0%} CPU)"
        )
    busy = [t for t in threads if t.spinning and t.expected is not None]
    if busy:
        why = "; ".join(f"{_thread_brief(t)}: {t.expected}" for t in busy)
        return C.ACTIVE, f"{cpu_fraction:.0%} CPU; busy without blocking, as expected: {why}"
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
