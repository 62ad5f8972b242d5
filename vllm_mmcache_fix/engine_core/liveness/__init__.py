"""EngineCore's side of the ``/health`` round trip: a utility method that answers at once.

The API server's :mod:`vllm_mmcache_fix.api_server.engine_health` calls it through vLLM's
own utility path (the input socket, EngineCore's input thread, its busy loop), so an
answer proves that EngineCore reads and serves its input; the answer carries this
process's plugin counters back for ``/metrics``.
"""
