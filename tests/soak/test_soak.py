"""Soak: a real vLLM server with the plugin under mixed multimodal traffic stays healthy.

One version (``MMCACHE_HARNESS_SOAK_VERSION``, default 0.32.0), one server, a shortened
run of ``scripts/soak`` (harness/programs/soak.py; ``MMCACHE_HARNESS_SOAK_REQUESTS`` requests,
default 600; the
script's own default is 2000): new and reused images, long prompts rejected after
placeholder expansion, two-image prompts. Pass criteria: no timeout, no 5xx for a
valid request, every long request answered 400, EngineCore idle (< 5% CPU) once the
load stops, and no server process grows its RSS by more than 10% from the end of
the first quarter (after warm-up) to the end of the last.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from harness import runner
from harness.programs import soak
from harness.rotation import SOAKS, this_turn

VERSION = os.environ.get("MMCACHE_HARNESS_SOAK_VERSION", "0.32.0").strip()
REQUESTS = int(os.environ.get("MMCACHE_HARNESS_SOAK_REQUESTS", "600"))
TURN = this_turn(SOAKS, "MMCACHE_HARNESS_SOAKS")
"""CI runs one soak per commit; ``MMCACHE_HARNESS_SOAKS=all`` (or a name) chooses."""


@pytest.mark.skipif("sequential" not in TURN, reason="the other soak's turn")
def test_soak_with_the_plugin(plugin_wheel: Path, vllm_venv) -> None:
    venv = vllm_venv(VERSION)
    with runner.plugin_state(venv, plugin_wheel, purpose="soak test") as lock:
        result = soak.run_soak(venv, soak.SoakOptions(requests=REQUESTS), lock=lock)
    print()
    print(soak.format_result(result))

    assert result.started, result.error
    assert not result.error, result.error
    assert result.plugin_installed
    assert result.plugin.active_in, "no process logged the plugin as active"
    assert result.sent == REQUESTS, result.unexpected[:5]
    assert result.timeouts == 0, result.unexpected[:5]
    assert result.connection_errors == 0, result.unexpected[:5]
    assert result.valid_5xx == 0, result.unexpected[:5]
    assert result.long_not_400 == 0, result.unexpected[:5]
    assert result.status_counts.get("400", 0) >= REQUESTS // 10, result.status_counts
    cpu = result.engine_cpu_after_percent
    assert cpu is not None, "EngineCore CPU was not measured"
    assert cpu < soak.MAX_ENGINE_CPU_PERCENT, result.engine_after
    assert result.processes, "no server process was sampled"
    for proc in result.processes:
        growth = proc.growth_percent
        assert growth is not None, f"{proc.name}: RSS missing for a quarter {proc.quarters_mb}"
        assert growth <= soak.MAX_RSS_GROWTH_PERCENT, (proc.name, proc.quarters_mb)
    assert result.failures() == []
