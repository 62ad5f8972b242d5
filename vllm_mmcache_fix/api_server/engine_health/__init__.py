"""Engine liveness on ``/health``: vLLM's health check also asks every EngineCore to answer.

``probe`` is the round trip (asyncio only, never blocking the event loop); ``fix``
wraps ``AsyncLLM.check_health`` (``vllm_layout.HEALTH_TARGET``) so that an EngineCore
that has not answered within ``MMCACHE_FIX_HEALTH_TIMEOUT`` seconds makes it raise,
and vLLM answers ``/health`` with 503.
"""
