"""Real servers of the e2e tier: one per (release, settings), shared by the tests that can.

The tests whose workload leaves the server as it found it share one
(:mod:`harness.shared_servers`): ``shared_server(version, kind)`` gives the running
server of that release and kind, started on first use and kept until a test asks for
another. Each test sends items (images, videos) the server has not seen
(``shared_server.new_items()``).

Tests that need a server of their own (a freeze, injected faults, other flags or
settings) start it themselves; the shared server is stopped first (one server at a
time). ``tests/conftest.py`` orders the tier so that the tests of one shared server run
one after another (:func:`harness.shared_servers.server_order`). The watched 0.23.0
replays are session fixtures: the health, stall sentinel and incident tests read them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.shared_servers import STALL_SECONDS, SharedServers, WatchedReplay, watched_replay
from vllm_mmcache_fix.core.settings import ENV_MODE, ENV_STALL_SECONDS

_made: list[SharedServers] = []


@pytest.fixture(scope="session")
def _shared_servers(plugin_wheel: Path) -> Iterator[SharedServers]:
    servers = SharedServers(plugin_wheel)
    _made.append(servers)
    try:
        yield servers
    finally:
        servers.close()


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Leaving the tier: its shared server stops (the next tiers take the lock themselves)."""
    if nextitem is None or nextitem.path.parent != item.path.parent:
        for servers in _made:
            servers.close()


@pytest.fixture
def shared_server(_shared_servers: SharedServers) -> SharedServers:
    """``shared_server(version, kind)``: the running server of that release and kind."""
    return _shared_servers


@pytest.fixture(autouse=True)
def _one_server_at_a_time(request: pytest.FixtureRequest, _shared_servers: SharedServers) -> None:
    """A test with a server of its own runs with no shared server up."""
    if "shared_server" not in request.fixturenames:
        _shared_servers.close()


@pytest.fixture(scope="session")
def frozen_in_warn_mode(_shared_servers: SharedServers) -> WatchedReplay:
    """The plugin loaded, its eviction fix off (``warn``): EngineCore freezes; liveness
    (5 s) and the stall sentinel (3 s) watch."""
    env = {ENV_MODE: "warn", ENV_STALL_SECONDS: str(STALL_SECONDS)}
    return watched_replay(_shared_servers, env)


@pytest.fixture(scope="session")
def fixed_with_short_thresholds(_shared_servers: SharedServers) -> WatchedReplay:
    """The plugin with its defaults but liveness at 5 s and the stall sentinel at 3 s: no freeze,
    and neither may fire."""
    return watched_replay(_shared_servers, {ENV_STALL_SECONDS: str(STALL_SECONDS)})


@pytest.fixture(scope="session")
def frozen_without_plugin(_shared_servers: SharedServers) -> WatchedReplay:
    """The plugin installed but kept out: EngineCore freezes, vLLM's /health stays 200."""
    return watched_replay(_shared_servers, {}, disable_plugin=True, with_diagnosis=True)
