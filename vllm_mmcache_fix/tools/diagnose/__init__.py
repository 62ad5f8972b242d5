"""``vllm-mmcache-fix diagnose``: is a vLLM server stuck in the multimodal cache eviction loop?

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

* A process's **kind** is which of vLLM's processes it is, from its title (``VLLM::Worker_TP0``,
  ``VLLM::APIServer_1``, ``VLLM::DPCoordinator``, ``VLLM::EngineCore_DP0``) or its command line
  (``vllm serve``). The freeze is EngineCore's; vLLM runs some threads busy on purpose, and
  such a thread spinning is **expected** (the process is ``active``): any thread of a Worker
  (it busy-waits on its shared-memory queue for the next step, ``MessageQueue.acquire_read``
  <- ``dequeue`` <- ``worker_busy_loop``, or computes one), of an API server or of the DP
  coordinator, EngineCore's main thread (its busy loop, which waits the same way for its
  Workers' output while a step runs), and any thread whose py-spy stack is in that
  busy-wait. A thread spinning in the mm cache is never expected. What remains is the
  freeze's signature: a thread of EngineCore other than its busy loop (the input thread,
  since vLLM 0.10.1; on 0.10.0 the busy loop itself spins, which only a stack tells), or
  of a process that is not vLLM's.
* A thread **spins** when, over the interval, it made at most
  ``max(1, SPIN_MAX_VOLUNTARY_PER_SEC * interval)`` voluntary context switches (it hardly
  waited for anything: a few a second come from handing the GIL to another Python
  thread) and either used at least ``SPIN_MIN_CPU_FRACTION`` of one core or was runnable
  (on a CPU or waiting for one) at least ``SPIN_MIN_RUNNABLE_FRACTION`` of the time. The
  second form keeps the rule working on a loaded machine, where a spinning thread only
  gets its share of a core; it holds only when the thread was on a CPU for at least
  ``SPIN_MIN_FAIR_SHARE`` of that share (CPUs over the machine's runnable threads, sampled
  from ``/proc/stat``), so a thread that is runnable but starved of CPU, or gives its core
  away with ``sched_yield``, is not spinning. The runnable share is the larger of two
  estimates: time running plus time queued from ``/proc/.../schedstat`` (which books a
  wait only once it ends), and the share of state samples that found the thread in
  ``R``. Rising nonvoluntary switches are kept as evidence but not required: a spinning
  thread is only preempted when something else wants its core.
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

``exited``
    gone (or a zombie) at the end of the interval.
``spinning_in_mm_cache``
    a spinning thread whose stack is in the mm cache eviction loop.
``spinning_elsewhere``
    spinning threads that are not expected, stacks checked, none in the mm cache (or not
    Python threads).
``spinning``
    spinning threads that are not expected, stacks not checked (no py-spy, or it
    failed): the numbers match the mm cache hang's signature, but that is not a
    confirmation.
``blocked``
    a blocked thread.
``engine_input_thread_gone``
    an EngineCore whose py-spy dump shows its output thread but not its input thread
    (``process_input_sockets``): up to vLLM 0.13 a failed request ends that thread and the
    engine, idle, never reads another request.
``idle``
    all threads together used at most ``IDLE_MAX_CPU_FRACTION`` of one core.
``active``
    anything else (expected busy threads included): working normally as far as the
    interval shows.

This diagnosis itself, the shells that started it (when it runs inside the server's
process tree, as ``diagnose --pid 1`` in a container) and its py-spy children are left out.

The whole takes the most severe class among its processes (order of ``SEVERITY``).
"""

from __future__ import annotations

from .classify import (
    classify_process,
    input_thread_gone,
    overall,
    stack_in_mm_cache,
    thread_is_blocked,
    thread_is_spinning,
)
from .procfs import is_engine_core, process_tree
from .pyspy import check_stacks, find_py_spy, parse_py_spy_dump
from .render import render
from .results import Diagnosis, ProcessReport, StackCheck, ThreadReport, exit_code
from .rules import EXIT_CODES, EXIT_ERROR, REMEDIES, SEVERITY, Classification, DiagnoseError
from .run import diagnose

__all__ = [
    "EXIT_CODES",
    "EXIT_ERROR",
    "REMEDIES",
    "SEVERITY",
    "Classification",
    "DiagnoseError",
    "Diagnosis",
    "ProcessReport",
    "StackCheck",
    "ThreadReport",
    "check_stacks",
    "classify_process",
    "diagnose",
    "exit_code",
    "find_py_spy",
    "input_thread_gone",
    "is_engine_core",
    "overall",
    "parse_py_spy_dump",
    "process_tree",
    "render",
    "stack_in_mm_cache",
    "thread_is_blocked",
    "thread_is_spinning",
]
