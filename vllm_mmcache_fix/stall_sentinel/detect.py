"""The stall rule: one sample of every Python thread, compared with the last one."""

from __future__ import annotations

import os
import sys
import threading
import time
from types import CodeType, FrameType

from ..core.procfs import ThreadCounters, read_own_thread
from ..core.records import frozen
from ..vllm_layout import EVICTION_CALLERS, EVICTION_FRAMES, STACK_FILE_MARKERS

TYPE_CHECKING = False  # as typing's, without importing typing in every vLLM process
if TYPE_CHECKING:
    from collections.abc import Callable

MIN_CPU_FRACTION = 0.8
"""A stalled thread uses at least this much of one core between two samples..."""
MIN_RUNNABLE_FRACTION = 0.9
"""...or is on a CPU or waiting for one this much of the time (a busy machine)."""
MAX_VOLUNTARY_PER_SEC = 60.0
"""...and gives up the CPU of its own accord at most this often. A thread that blocks
on I/O or a lock every 10 ms exceeds it; a spinning Python thread shows some, from
handing the GIL to other Python threads (measured in a frozen EngineCore: 2 a second
next to this sampler, whose ``/proc`` reads keep the GIL; 40-73 when they went through
Python's file I/O, which is still the fallback where ``ctypes`` is missing)."""
MAX_VOLUNTARY_STARVED_PER_SEC = 10.0
"""A thread counted busy by its run-queue time alone (it got little CPU: a loaded machine)
must give up the CPU of its own accord at most this often: a spinning thread that waits
for a core is preempted (involuntary switches), while one that mostly blocks on a lock or
an event, and then waits for a core each time it wakes, shows tens a second (measured: 49 a
second, 5% CPU, 94% runnable, for a thread doing 2 ms of work between 2 ms waits next to a
loaded server)."""
MAX_DEPTH_ABOVE_ANCHOR = 4
"""The innermost frame may be at most this many calls above the frame that has not
returned since the stall began (the loop calls small helpers: ``popitem``)."""
MAX_MISSES = 1
"""Consecutive starved intervals a stall survives (the thread stays in place, but another
process took the core)."""
TOTAL_SLACK = 0.75
"""Over the whole stall, the thread must still show this share of the per-interval bar."""
REPORT_LOOKS = 20
REPORT_LOOK_GAP_S = 0.002
"""Looks at a stalled thread when reporting it (see :meth:`Detector._deepest`)."""
MAX_STACK_FRAMES = 40
"""Frames written in a report (innermost first); deeper ones are summarised."""

try:
    CLOCK_TICKS = float(os.sysconf("SC_CLK_TCK"))
except (ValueError, OSError, AttributeError):
    CLOCK_TICKS = 100.0


def _busy(
    cpu_s: float, runnable_s: float | None, voluntary: int, seconds: float, slack: float
) -> bool:
    """Burning a core over ``seconds`` (``slack`` scales the bars): on a CPU most of the
    time and rarely blocking, or, on a loaded machine, on a CPU or waiting for one nearly
    all the time and almost never blocking."""
    if voluntary <= MAX_VOLUNTARY_PER_SEC * seconds and cpu_s >= MIN_CPU_FRACTION * slack * seconds:
        return True
    return (
        runnable_s is not None
        and runnable_s >= MIN_RUNNABLE_FRACTION * slack * seconds
        and voluntary <= MAX_VOLUNTARY_STARVED_PER_SEC * seconds
    )


# The classes below are plain: ``dataclass`` compiles each class's methods from source text
# when the module loads (``core/records.py``), and EngineCore and the API server load this
# module at start-up.


@frozen
class StackLine:
    file: str
    line: int
    function: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line} {self.function}"


class Stall:
    """One stalled thread, as reported."""

    __slots__ = (
        "thread_name",
        "native_id",
        "seconds",
        "cpu_percent",
        "runnable_percent",
        "voluntary",
        "involuntary",
        "stack",
        "frames_total",
        "anchor_function",
    )

    def __init__(
        self,
        thread_name: str,
        native_id: int,
        seconds: float,
        cpu_percent: float,
        runnable_percent: float | None,
        voluntary: int,
        involuntary: int,
        stack: list[StackLine],
        frames_total: int,
        anchor_function: str = "?",
    ) -> None:
        self.thread_name = thread_name
        self.native_id = native_id
        self.seconds = seconds
        self.cpu_percent = cpu_percent
        self.runnable_percent = runnable_percent
        self.voluntary = voluntary
        self.involuntary = involuntary
        self.stack = stack
        """Innermost first."""
        self.frames_total = frames_total
        self.anchor_function = anchor_function
        """The call that has not returned since the stall began (``Cache.__setitem__``)."""

    def __repr__(self) -> str:
        inner = ", ".join(f"{name}={getattr(self, name)!r}" for name in self.__slots__)
        return f"Stall({inner})"

    @property
    def top_function(self) -> str:
        return self.stack[0].function if self.stack else "?"


_Token = tuple[int, CodeType]
"""A frame not held: its address and its code. A new call of the same code at the same
address passes for the old one until the next sample, which holds it."""


def _tokens(frames: list[FrameType]) -> list[_Token]:
    return [(id(frame), frame.f_code) for frame in frames]


class _Track:
    __slots__ = (
        "native_id",
        "anchor",
        "tail",
        "counters",
        "at",
        "since",
        "cpu_s",
        "runnable_s",
        "voluntary",
        "involuntary",
        "reported",
        "misses",
    )

    def __init__(
        self,
        native_id: int,
        anchor: list[FrameType],
        tail: list[_Token],
        counters: ThreadCounters,
        at: float,
        since: float,
    ) -> None:
        self.native_id = native_id
        self.anchor = anchor
        """Outermost first: the calls that have not returned since the stall began, each
        seen in two samples at least, busy in between. Held as objects, so a new call is
        never taken for one that returned; only such a long, busy call, if it then returns,
        has its locals kept until the next sample."""
        self.tail = tail
        """The rest of the last sample's stack, not held: a call that returns in the
        meantime must not keep its locals (a forward pass's tensors) alive until the next
        sample."""
        self.counters = counters
        self.at = at
        self.since = since
        self.cpu_s = 0.0
        self.runnable_s: float | None = 0.0
        self.voluntary = 0
        self.involuntary = 0
        self.reported = False
        self.misses = 0
        """Consecutive intervals in place but not busy (a loaded machine can starve one)."""


class Detector:
    """Feed it :meth:`sample` every interval; it calls ``on_stall`` once per stall."""

    def __init__(
        self,
        threshold_s: float,
        on_stall: Callable[[Stall], None],
        read_counters: Callable[[int], ThreadCounters] = read_own_thread,
        clock: Callable[[], float] = time.monotonic,
        ignore_idents: set[int] | None = None,
    ) -> None:
        self.threshold_s = threshold_s
        self.on_stall = on_stall
        self.read_counters = read_counters
        self.clock = clock
        self.ignore_idents: set[int] = set() if ignore_idents is None else ignore_idents
        self.tracks: dict[int, _Track] = {}
        self.stalls = 0
        self.samples = 0

    def sample(self) -> None:
        now = self.clock()
        frames = sys._current_frames()
        names = {t.ident: t for t in threading.enumerate()}
        seen: set[int] = set()
        for ident, frame in frames.items():
            if ident in self.ignore_idents:
                continue
            thread = names.get(ident)
            native_id = getattr(thread, "native_id", None)
            if thread is None or native_id is None:
                continue
            try:
                counters = self.read_counters(native_id)
            except OSError:
                continue  # the thread ended meanwhile
            seen.add(ident)
            self._step(ident, thread, frame, counters, now)
        for ident in list(self.tracks):
            if ident not in seen:
                del self.tracks[ident]
        self.samples += 1
        del frames

    def _step(
        self,
        ident: int,
        thread: threading.Thread,
        frame: FrameType,
        counters: ThreadCounters,
        now: float,
    ) -> None:
        stack = _frames(frame)
        track = self.tracks.get(ident)
        if track is None or track.native_id != thread.native_id:
            self.tracks[ident] = _Track(
                thread.native_id or 0, [], _tokens(stack), counters, now, now
            )
            return
        elapsed = now - track.at
        if elapsed <= 0:
            return
        cpu_s = (counters.ticks - track.counters.ticks) / CLOCK_TICKS
        voluntary = counters.voluntary - track.counters.voluntary
        involuntary = counters.involuntary - track.counters.involuntary
        runnable_s: float | None = None
        if counters.runnable_ns is not None and track.counters.runnable_ns is not None:
            runnable_s = (counters.runnable_ns - track.counters.runnable_ns) / 1e9
        busy = _busy(cpu_s, runnable_s, voluntary, elapsed, 1.0)
        common = _match(track, stack)
        in_place = common > 0 and len(stack) - common <= MAX_DEPTH_ABOVE_ANCHOR
        track.counters, track.at = counters, now
        if track.reported:
            # Reported once: the stall lasts until the call it was found in returns, however
            # busy the thread looks from one interval to the next (one WARNING per stall).
            if common >= len(track.anchor):
                track.tail = _tokens(stack[len(track.anchor) :])
                return
            in_place = False
        if in_place and not busy and track.misses < MAX_MISSES:
            # One starved interval (the machine's other work took the core) does not end a
            # stall; the totals below still have to show a busy thread.
            track.misses += 1
            busy = True
        elif busy:
            track.misses = 0
        if not (busy and in_place):
            track.anchor, track.tail, track.since = [], _tokens(stack), now
            track.cpu_s, track.runnable_s = 0.0, 0.0
            track.voluntary = track.involuntary = 0
            track.reported = False
            track.misses = 0
            return
        track.anchor, track.tail = stack[:common], _tokens(stack[common:])
        track.cpu_s += cpu_s
        if runnable_s is None or track.runnable_s is None:
            track.runnable_s = None
        else:
            track.runnable_s += runnable_s
        track.voluntary += voluntary
        track.involuntary += involuntary
        seconds = now - track.since
        if track.reported or seconds < self.threshold_s or track.misses:
            return
        if not _busy(track.cpu_s, track.runnable_s, track.voluntary, seconds, TOTAL_SLACK):
            return
        track.reported = True
        self.stalls += 1
        frames, held = self._deepest(ident, stack)
        if held is not None:
            # A call the looks saw return was never part of the stall (a new call that took
            # a returned one's address); a call they all saw held names the loop best.
            del track.anchor[held:]
        else:
            held = len(track.anchor)
        lines, total = stack_lines(frames)
        anchor_at = total - held  # innermost-first index of the innermost held call
        anchor = lines[anchor_at].function if 0 <= anchor_at < len(lines) else "?"
        self.on_stall(
            Stall(
                thread_name=thread.name,
                native_id=track.native_id,
                seconds=seconds,
                cpu_percent=100.0 * track.cpu_s / seconds,
                runnable_percent=None
                if track.runnable_s is None
                else 100.0 * track.runnable_s / seconds,
                voluntary=track.voluntary,
                involuntary=track.involuntary,
                stack=lines,
                frames_total=total,
                anchor_function=anchor,
            )
        )

    def _deepest(self, ident: int, stack: list[FrameType]) -> tuple[list[FrameType], int | None]:
        """(the deepest of a few quick looks at the stalled thread, outermost first, as it
        was when looked at; how many calls of
        ``stack``, outermost first, every look saw still running, or None without a look).

        One sample can catch the loop between two calls (in ``Cache.__setitem__`` rather than
        in the ``popitem`` it keeps calling); the report should show the innermost code. The
        stall's anchor can also be shallower than the loop (the first sample came just before
        the loop was entered, in its caller); the calls held through every look name the loop.
        At most :data:`REPORT_LOOKS` looks, :data:`REPORT_LOOK_GAP_S` apart, once per stall.
        The stack is kept as the list seen, not re-read from its innermost frame later: a
        generator frame that has since been suspended has no caller any more.
        """
        best = stack
        held: int | None = None
        for _ in range(REPORT_LOOKS):
            time.sleep(REPORT_LOOK_GAP_S)
            now = sys._current_frames().get(ident)
            if now is None:
                break
            look = _frames(now)
            del now
            common = _common_prefix(stack, look)
            if common == 0:
                continue
            held = common if held is None else min(held, common)
            if len(look) > len(best):
                best = look
        return best, held


def _frames(frame: FrameType | None) -> list[FrameType]:
    """Outermost first."""
    frames: list[FrameType] = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    frames.reverse()
    return frames


def _match(track: _Track, stack: list[FrameType]) -> int:
    """How many calls of ``stack``, outermost first, are the ones the track last saw."""
    common = _common_prefix(track.anchor, stack)
    if common < len(track.anchor):
        return common
    for (address, code), frame in zip(track.tail, stack[common:]):
        if id(frame) != address or frame.f_code is not code:
            break
        common += 1
    return common


def _common_prefix(a: list[FrameType], b: list[FrameType]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x is not y:
            break
        n += 1
    return n


def function_name(frame: FrameType) -> str:
    code = frame.f_code
    return getattr(code, "co_qualname", None) or code.co_name


def stack_lines(frames: list[FrameType]) -> tuple[list[StackLine], int]:
    """(the innermost ``MAX_STACK_FRAMES`` of ``frames`` (outermost first), innermost first;
    the stack's depth)."""
    lines = [
        StackLine(frame.f_code.co_filename, frame.f_lineno or 0, function_name(frame))
        for frame in reversed(frames[-MAX_STACK_FRAMES:])
    ]
    return lines, len(frames)


def in_cache_eviction(stack: list[StackLine]) -> bool:
    """Whether a stalled stack is the multimodal cache's eviction loop (vllm#43941): an
    eviction frame (``popitem``) and one of its callers, both in the LRU's files."""
    names: set[str] = set()
    for line in stack:
        path = line.file.replace("\\", "/")
        if any(marker in path for marker in STACK_FILE_MARKERS):
            names.add(line.function.rsplit(".", 1)[-1])
    return bool(names & EVICTION_FRAMES) and bool(names & EVICTION_CALLERS)
