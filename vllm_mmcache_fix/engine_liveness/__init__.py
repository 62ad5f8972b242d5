"""Engine liveness on ``/health``: the API server's check and EngineCore's answer.

- ``health`` (acts in the API server): wraps ``AsyncLLM.check_health``
  (``vllm_layout.HEALTH_TARGET``) so that an EngineCore that has not answered within
  ``MMCACHE_FIX_HEALTH_TIMEOUT`` seconds makes it raise, and vLLM answers ``/health``
  with 503;
- ``probe`` (API server): the round trip, asyncio only, never blocking the event loop;
- ``answer`` (acts in EngineCore): the utility method EngineCore answers with, carrying
  its plugin counters back for ``/metrics``.
"""
