"""What the diagnosis decides from: classes, thresholds, exit codes, remedies."""

from __future__ import annotations

import re

from ...vllm_layout import (
    ENGINE_CORE_PROCESS,
    ENGINE_INPUT_THREAD,
    ENGINE_OUTPUT_THREAD,
    STACK_FILE_MARKERS,
)
from .. import exits

Classification = exits.Verdict
"""What a process, or a whole server, is found doing: ``diagnose``'s verdicts are
:class:`exits.Verdict` members (``SEVERITY`` lists them)."""

C = Classification

# Most severe first; the whole takes the first class any of its processes has.
SEVERITY: tuple[Classification, ...] = (
    C.SPINNING_IN_MM_CACHE,
    C.ENGINE_INPUT_THREAD_GONE,
    C.SPINNING,
    C.SPINNING_ELSEWHERE,
    C.BLOCKED,
    C.ACTIVE,
    C.IDLE,
    C.EXITED,
)

# Exit status of ``vllm-mmcache-fix diagnose`` per overall class: the command line's one
# table (tools/exits.py). EXIT_ERROR is for DiagnoseError.
EXIT_CODES: dict[Classification, int] = {c: c.code.code for c in SEVERITY}
EXIT_ERROR = exits.ERROR.code

SPIN_MIN_CPU_FRACTION = 0.8
"""A spinning thread uses at least this much of one core over the interval."""

SPIN_MIN_RUNNABLE_FRACTION = 0.9
"""...or is runnable (running or waiting for a CPU) at least this share of the interval..."""

SPIN_MAX_VOLUNTARY_PER_SEC = 5.0
"""...and makes at most this many voluntary switches per second (at least 1 is tolerated).

A thread spinning in Python still hands the GIL to another Python thread that wakes up
and then waits to get it back: the plugin's stall sentinel, sampling once a second,
costs the spinning thread about 2 voluntary switches a second (measured in a frozen vLLM
0.23.0 EngineCore; 0 without the sentinel). A thread that waits on I/O, a lock or a
queue even every 100 ms makes 10 or more."""

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

CACHE_FILE_MARKERS = STACK_FILE_MARKERS

ENGINE_CORE_MARKER = ENGINE_CORE_PROCESS
INPUT_THREAD_FUNCTION = ENGINE_INPUT_THREAD
OUTPUT_THREAD_FUNCTION = ENGINE_OUTPUT_THREAD
# /proc/<pid>/comm holds 15 bytes: "VLLM::EngineCore" becomes "VLLM::EngineCor".
_ENGINE_CORE_COMM = re.compile(re.escape(ENGINE_CORE_PROCESS[:9]))

KIND_ENGINE_CORE = "EngineCore"
KIND_WORKER = "Worker"
KIND_API_SERVER = "APIServer"
KIND_DP_COORDINATOR = "DPCoordinator"
KIND_OTHER = "other"
PROCESS_KINDS = (KIND_ENGINE_CORE, KIND_WORKER, KIND_API_SERVER, KIND_DP_COORDINATOR, KIND_OTHER)
"""What a process of the tree is. The freeze is EngineCore's: a Worker, an API server or
the DP coordinator burning a core is not it (a Worker busy-waits for its next step)."""

TITLE_PREFIXES = {
    KIND_WORKER: "VLLM::Worker",
    KIND_API_SERVER: "VLLM::APIServer",
    KIND_DP_COORDINATOR: "VLLM::DPCoordinator",
}
"""vLLM's process titles (``set_process_title``; ``VLLM`` is ``VLLM_PROCESS_NAME_PREFIX``)."""

_API_SERVER_COMMAND = re.compile(
    r"(?:^|[\s/])vllm(?:\s+serve\b|\.entrypoints\.(?:cli\.main\s+serve|openai\.api_server))"
)
"""The single API server keeps its command line: ``vllm serve``,
``python -m vllm.entrypoints.cli.main serve``, ``python -m vllm.entrypoints.openai.api_server``."""

BUSY_WAIT_FRAMES = frozenset({"acquire_read", "spinloop", "dequeue", "worker_busy_loop"})
BUSY_WAIT_FILE_MARKERS = ("shm_broadcast", "multiproc_executor")
"""A stack with one of these functions in one of these files busy-waits on vLLM's
shared-memory message queue (``MessageQueue.acquire_read`` <- ``dequeue`` <-
``worker_busy_loop``): a Worker waiting for its next step, or EngineCore for its
Workers' output. It polls without blocking by design."""

SPIN_MIN_FAIR_SHARE = 0.5
"""...and, when only the runnable form holds, was on a CPU for at least this part of its
fair share of the time it was runnable: ``schedstat``'s time on a CPU over time on a CPU
plus time queued, against (CPUs / runnable threads of the machine, ``procs_running`` of
``/proc/stat``, sampled). A spinning thread on a loaded machine gets its fair share; a
thread that is runnable but gets far less (it polls with ``sched_yield``, as a busy-wait
does, or is starved) is not spinning."""

REMEDIES: dict[Classification, str] = {
    C.SPINNING_IN_MM_CACHE: (
        "This is the multimodal processor cache eviction hang; the process cannot recover. "
        "Restart the server; keep this output and the server log. To prevent it: install "
        "vllm-mmcache-fix next to vLLM (it loads as a vLLM plugin), or start vLLM with "
        "--mm-processor-cache-gb 0 (no cache) until you can. See `vllm-mmcache-fix check`."
    ),
    C.SPINNING: (
        "A thread spins without ever blocking: the signature of the multimodal processor "
        "cache eviction hang, but its stack was not checked. To confirm, run again with py-spy "
        "installed (pip install py-spy) as root or as the server's user (in a container: "
        "CAP_SYS_PTRACE). If it is that hang: restart the server, and prevent it with "
        "vllm-mmcache-fix or --mm-processor-cache-gb 0 (see `vllm-mmcache-fix check`)."
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
        "these processes. On vLLM 0.13 and older an EngineCore whose input thread died after "
        "a failed request looks exactly like this: run again with py-spy installed to tell "
        "(the verdict is then engine_input_thread_gone); either way, restart the server."
    ),
    C.ENGINE_INPUT_THREAD_GONE: (
        "EngineCore's input thread has died, so EngineCore never reads another request: "
        "every request waits forever while the server looks idle and /health may still say "
        "200. It does not recover: restart the server. Keep the server log (the input "
        "thread's traceback is in it). On vLLM 0.13 and older a multimodal request that "
        "fails EngineCore's cache lookup (`Expected a cached item`) ends the thread; "
        "vllm-mmcache-fix's drift guard prevents that (see `vllm-mmcache-fix check`)."
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
