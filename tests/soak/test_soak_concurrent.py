"""Concurrent soak: a real vLLM server with the plugin under concurrent mixed traffic.

One version (``MMCACHE_HARNESS_SOAK_VERSION``, default 0.32.0), one server, ``CLIENTS``
concurrent clients (``MMCACHE_HARNESS_SOAK_CLIENTS``, default 8) sending
``MMCACHE_HARNESS_SOAK_CONCURRENT_REQUESTS`` requests (default 600; ``scripts/concurrent
--soak --requests 2000`` is the full soak) of harness/programs/concurrent.py's mixed plan. The
pass criteria are the soak's own (:meth:`harness.programs.soak.SoakResult.failures`): no
timeout, no 5xx for a valid request, every long request answered 400, EngineCore
below 5% CPU once the load stops, and no server process growing its RSS by more than
10% from the end of the first quarter to the end of the last.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from harness import runner
from harness.programs import concurrent
from harness.rotation import SOAKS, this_turn

VERSION = os.environ.get("MMCACHE_HARNESS_SOAK_VERSION", "0.32.0").strip()
CLIENTS = int(os.environ.get("MMCACHE_HARNESS_SOAK_CLIENTS", "8"))
REQUESTS = int(os.environ.get("MMCACHE_HARNESS_SOAK_CONCURRENT_REQUESTS", "600"))
TURN = this_turn(SOAKS, "MMCACHE_HARNESS_SOAKS")


@pytest.mark.skipif("concurrent" not in TURN, reason="the other soak's turn")
def test_concurrent_soak_with_the_plugin(plugin_wheel: Path, vllm_venv) -> None:
    venv = vllm_venv(VERSION)
    with runner.plugin_state(venv, plugin_wheel, purpose="concurrent soak test") as lock:
        options = concurrent.ConcurrentOptions(
            requests=REQUESTS, clients=CLIENTS, max_seconds=3600.0
        )
        result = concurrent.run_concurrent(venv, options, plugin=True, lock=lock)
    data = result.to_dict()
    print()
    print(concurrent.format_table([data]))
    print(concurrent.format_details(data, soak_criteria=True))

    assert result.started, result.error
    assert result.plugin.active_in, "no process logged the plugin as active"
    assert result.sent == REQUESTS, result.unexpected[:5]
    assert result.expected_400 >= REQUESTS // 10, result.status_counts
    assert result.processes, "no server process was sampled"
    assert result.failures() == [], result.unexpected[:5]
