"""The plugin's counters on vLLM's own ``/metrics`` (API server only).

``names`` holds every metric name; ``exporter`` turns the counters of this API server
(:func:`vllm_mmcache_fix.plugin.counts`), those EngineCore sends with each heartbeat answer
and each engine's last-answer age into ``prometheus_client`` metrics, imported only once the
process serves. With ``PROMETHEUS_MULTIPROC_DIR`` set (``--api-server-count > 1``) the
same metrics go through prometheus_client's multiprocess files and vLLM's
``MultiProcessCollector`` merges them (each gauge with its own ``multiprocess_mode``).
"""
