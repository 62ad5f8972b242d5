"""``vllm-mmcache-fix diagnose`` on a healthy real server under load: ``active``, not frozen.

The shared 0.32.0 server with the plugin (EngineCore and its spawned Worker, which
busy-waits on vLLM's shared-memory queue between steps) serves concurrent image requests
while the README's ``diagnose --pid <API server>`` runs, with py-spy and without. 33a6648
answered ``spinning_elsewhere`` (13) with py-spy and ``spinning`` (12) without on this
server. The freeze itself still answers ``spinning_in_mm_cache``
(``test_e2e_incident.py::test_incident_freezes_without_plugin``). TP=2, DP=2 and idle
servers: ``scripts/diagnose-shapes`` (``compat/diagnose-shapes.json``).
"""

from __future__ import annotations

import time

import pytest

from harness.programs.diagnose_shapes import Load, run_diagnose
from harness.shared_servers import SharedServers
from harness.venvs import e2e_versions
from vllm_mmcache_fix.tools.diagnose import find_py_spy

VERSION = "0.32.0"
HEALTHY = ("idle", "active")


@pytest.mark.shared_server("plugin")
@pytest.mark.skipif(VERSION not in e2e_versions(), reason=f"{VERSION} not in the e2e versions")
def test_diagnose_a_busy_healthy_server(shared_server: SharedServers) -> None:
    session = shared_server(VERSION, "plugin")
    assert session.pid is not None
    with Load(session.base_url, first_item=shared_server.new_items()) as load:
        deadline = time.monotonic() + 60
        while len(load.statuses) < 4 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert load.statuses, "no request answered within 60 s"
        runs = {"no_py_spy": run_diagnose(session.pid, py_spy=False, interval=2.0)}
        if find_py_spy() is not None:
            runs["py_spy"] = run_diagnose(session.pid, py_spy=True, interval=2.0)
        served_meanwhile = len(load.statuses)
    assert all(s == 200 for s in load.statuses), load.statuses
    for name, run in runs.items():
        assert run["verdict"] in HEALTHY and run["rc"] == 0, (name, run)
        kinds = {p["role"] if p["role"] == "EngineCore" else p["kind"] for p in run["processes"]}
        assert "EngineCore" in kinds and "Worker" in kinds, (name, run)
    assert served_meanwhile > 4, served_meanwhile
