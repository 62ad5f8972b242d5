"""The plugin's counters on vLLM's own ``/metrics`` (API server only).

``names`` holds every metric name; ``exporter`` turns the counters of this API server
(:func:`vllm_mmcache_fix.plugin.counts`) and those EngineCore sent back with the
``/health`` round trip into ``prometheus_client`` metrics, imported only once the
process serves. With ``PROMETHEUS_MULTIPROC_DIR`` set (``--api-server-count > 1``) the
same metrics go through prometheus_client's multiprocess files and vLLM's
``MultiProcessCollector`` adds them up.
"""
