"""Engine liveness on ``/health``: a heartbeat from the API server, answered by EngineCore.

- ``health`` (acts in the API server): wraps ``AsyncLLM.__init__`` (the heartbeat starts)
  and ``AsyncLLM.check_health`` (``vllm_layout.HEALTH_TARGET``), which reads the heartbeat's
  verdict and raises for a stuck engine, so vLLM answers ``/health`` with 503; it never
  waits on EngineCore;
- ``heartbeat`` (API server): the pings, asyncio only, and the rules that call an engine
  stuck (its input thread silent, or its busy loop inside one step, past the timeout);
- ``answer`` (acts in EngineCore): EngineCore's input thread answers the ping, with the busy
  loop's state and the process's plugin counters (for ``/metrics``);
- ``busy_loop``: the busy loop's state, as the answer reports it.
"""
