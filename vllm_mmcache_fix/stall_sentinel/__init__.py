"""The stall sentinel: starts only in **EngineCore and the API server**, positively identified.

It is installed in every process and starts its thread only when the process shows what it
is: an EngineCore busy loop starts (``signals.ENGINE_CORE_RUNNING``, any process model), or
an API server's engine client starts its heartbeat (``signals.API_SERVER_SERVING``). A
user's ``LLM(...)`` script, a launcher, workers and other helpers never run it.

A daemon thread samples every second ``sys._current_frames()`` and, for each
Python thread, its CPU time, run-queue time and context switches from
``/proc/self/task/<tid>/``. A thread that stays in the same code (a frame that
has not returned, at most a few calls above the innermost one) while it burns
a core (>= 80% CPU, or >= 90% on a CPU or waiting for one) with flat
voluntary switches for longer than ``MMCACHE_FIX_STALL_SECONDS`` gets one
WARNING with its stack; it is reported again only after it moved on and
stalled anew. The report names vllm#43941 only when the stack holds the multimodal
cache's eviction frames (``vllm_layout.EVICTION_FRAMES`` and ``EVICTION_CALLERS``);
any other stall reads "thread busy in one call", counted with ``cause="busy"``. Any error
of its own stops the sentinel (one log line); vLLM goes on.

- ``detect``: the sampling, the stall rule and the eviction rule (no vLLM, no threads)
- ``fix``: the lifecycle (``StallSentinelFix``) and the thread
"""
