"""The stall sentinel — starts only in **EngineCore and the API server**.

It is installed in every process and decides by vLLM's process name
(``EngineCore``/``EngineCore_DP<n>``, the API server's ``MainProcess``/``ApiServer_<n>``,
or the ``VLLM::EngineCore`` / ``VLLM::APIServer`` process title) and does nothing in
workers and other helper processes.

A daemon thread samples every second ``sys._current_frames()`` and, for each
Python thread, its CPU time, run-queue time and context switches from
``/proc/self/task/<tid>/``. A thread that stays in the same code (a frame that
has not returned, at most a few calls above the innermost one) while it burns
a core (>= 80% CPU, or >= 90% on a CPU or waiting for one) with flat
voluntary switches for longer than ``MMCACHE_FIX_STALL_SECONDS`` gets one
WARNING with its stack; it is reported again only after it moved on and
stalled anew. Any error of its own stops the sentinel (one log line); vLLM
goes on.

- ``detect``: the sampling and the stall rule (no vLLM, no threads of its own)
- ``fix``: the lifecycle (``StallSentinelFix``) and the thread
"""
