"""Real servers under concurrent clients: with the plugin, no client sees a 5xx or a timeout.

For each vLLM version of :func:`harness.venvs.e2e_versions`, a shortened
``scripts/concurrent`` run (harness/programs/concurrent.py) on the release's shared plugin server
(with images it has not seen):
``CLIENTS`` concurrent clients (default 8) send ``REQUESTS`` requests (default 150) of
the seeded mixed plan (new and reused images, long prompts rejected after placeholder
expansion, two-image prompts, ``n=2`` requests) to a 1 MB multimodal processor cache.

Pass: every request answered, no timeout, no 5xx among valid requests, every long
prompt answered 400 (and some were sent), and EngineCore idle once the load stops.
A frozen server fails the test through the per-request timeout, it does not hang it.
"""

from __future__ import annotations

import os

import pytest

from harness.programs import concurrent, soak
from harness.shared_servers import SharedServers
from harness.venvs import e2e_versions

VERSIONS = e2e_versions()
CLIENTS = int(os.environ.get("MMCACHE_HARNESS_CONCURRENT_CLIENTS", "8"))
REQUESTS = int(os.environ.get("MMCACHE_HARNESS_CONCURRENT_REQUESTS", "150"))


@pytest.mark.shared_server("plugin")
@pytest.mark.parametrize("version", VERSIONS)
def test_concurrent_clients_with_the_plugin(version: str, shared_server: SharedServers) -> None:
    session = shared_server(version, "plugin")
    result = concurrent.drive(
        session,
        concurrent.plan_requests(REQUESTS, 7),
        concurrent.ConcurrentOptions(clients=CLIENTS, request_timeout=60.0, max_seconds=600.0),
        first_image=shared_server.new_items(),
    )
    data = result.to_dict()
    print()
    print(concurrent.format_table([data]))
    print(concurrent.format_details(data, soak_criteria=False))

    assert result.started, result.error
    assert not result.error, result.error
    assert result.plugin.active_in, "no process logged the plugin as active"
    assert result.sent == REQUESTS, result.unexpected[:5]
    assert result.timeouts == 0, result.unexpected[:5]
    assert result.connection_errors == 0, result.unexpected[:5]
    assert result.valid_5xx == 0, result.unexpected[:5]
    assert result.valid_other_non_200 == 0, result.unexpected[:5]
    assert result.long_not_400 == 0, result.unexpected[:5]
    assert result.expected_400 >= REQUESTS // 10, result.status_counts
    assert result.n2_requests > 0
    cpu = result.engine_cpu_after_percent
    assert cpu is not None, "EngineCore CPU was not measured"
    assert cpu < soak.MAX_ENGINE_CPU_PERCENT, result.engine_after
    assert result.load_failures() == []
