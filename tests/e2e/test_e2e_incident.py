"""Real servers: the incident replay of ``scripts/e2e``, without and with the plugin.

The replay (tiny weightless Qwen2-VL, 1 MB multimodal processor cache) sends: (a) a long
prompt with image 0 that is rejected after the image was processed, (b) image 0 again,
(c) 20 new images. Without the plugin, vLLM 0.23.0 answers 400, 500, then hangs with
EngineCore spinning; 0.27.1 and 0.32.0 answer 400, 500 and then serve the new images.
With the plugin nothing hangs, every new image is served and EngineCore does not spin.

The replays with the plugin run on each release's shared plugin server, those without it
on the shared server that keeps the installed plugin out, with images those servers have
not seen; 0.23.0's freeze is a server of its own (``frozen_without_plugin``). With every
guarded site of the plugin failing, the replay gets a new server. Cases marked "one per
commit" rotate (:func:`harness.rotation.per_commit`; ``MMCACHE_HARNESS_ROTATE=off`` runs
them all).

Versions: ``MMCACHE_HARNESS_E2E_VERSIONS`` (spaces or commas), default
:data:`harness.venvs.DEFAULT_VERSIONS`. A version without a complete venv
(``scripts/make-venv VERSION``) fails.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from harness import runner
from harness.programs import incident
from harness.readme import guide_blocks
from harness.rotation import per_commit
from harness.shared_servers import FREEZE_VERSION, SharedServers, WatchedReplay, diagnose
from harness.venvs import complete_venv, e2e_versions
from vllm_mmcache_fix.core.messages import INTERNAL_ERROR, PREFIX
from vllm_mmcache_fix.core.settings import ENV_FAIL_AT
from vllm_mmcache_fix.tools.diagnose import EXIT_CODES, Classification

VERSIONS = e2e_versions()

# What step (b) and the new images do without the plugin, per version.
UNPATCHED = {"0.23.0": "hang", "0.27.1": "error-then-ok", "0.32.0": "error-then-ok"}
SERVING = per_commit([v for v in VERSIONS if UNPATCHED.get(v) != "hang"])
"""A release whose server keeps serving without the plugin, one per commit (the release
matrix has every release's replay without the plugin); it shares a server with the drift
run without the plugin."""


def _report(result: incident.RunResult) -> str:
    return "\n" + incident.format_result(result)


def _assert_rejected_first(result: incident.RunResult) -> None:
    assert result.started, result.error
    assert not result.plugin_lines, _report(result)
    a = result.step("a:long+img0")
    assert a is not None and a.status == 400, _report(result)
    assert "maximum context length" in a.detail, _report(result)


@pytest.mark.shared_server("noplugin")
@pytest.mark.parametrize("version", SERVING)
def test_incident_without_plugin(version: str, shared_server: SharedServers) -> None:
    session = shared_server(version, "noplugin")
    result = incident.replay_on(
        session, n_images=20, first_item=shared_server.new_items(), inspect=diagnose
    )
    print(_report(result))
    _assert_rejected_first(result)
    if version not in UNPATCHED:
        return
    b = result.step("b:short+img0")
    assert b is not None and b.status == 500, _report(result)
    new_images = [s for s in result.steps if s.step.startswith("c:")]
    assert not result.hung, _report(result)
    assert len(new_images) == 20 and all(s.ok for s in new_images), _report(result)
    assert isinstance(result.inspection, dict)
    diagnosis = json.loads(result.inspection["report"])
    assert diagnosis["verdict"] in ("idle", "active"), result.inspection


def test_incident_freezes_without_plugin(frozen_without_plugin: WatchedReplay) -> None:
    """0.23.0: the freeze, recognised from the API server's PID on the live process."""
    result = frozen_without_plugin.result
    print(_report(result))
    _assert_rejected_first(result)
    assert UNPATCHED[FREEZE_VERSION] == "hang"
    b = result.step("b:short+img0")
    assert b is not None and b.status == 500, _report(result)
    new_images = [s for s in result.steps if s.step.startswith("c:")]
    assert result.hung, _report(result)
    assert new_images[-1].timed_out, _report(result)
    assert result.spin_after is not None and result.spin_after.spinning, _report(result)
    assert isinstance(result.inspection, dict)
    diagnosis = json.loads(result.inspection["report"])
    assert diagnosis["verdict"] == "spinning_in_mm_cache", result.inspection
    assert result.inspection["rc"] == EXIT_CODES[Classification.SPINNING_IN_MM_CACHE]


@pytest.mark.shared_server("plugin")
@pytest.mark.parametrize("version", VERSIONS)
def test_incident_with_plugin(version: str, shared_server: SharedServers) -> None:
    session = shared_server(version, "plugin")
    result = incident.replay_on(session, n_images=20, first_item=shared_server.new_items())
    print(_report(result))
    assert result.started, result.error
    assert result.plugin_installed and not result.plugin_disabled
    assert not result.hung, _report(result)
    a, b = result.step("a:long+img0"), result.step("b:short+img0")
    assert a is not None and a.status == 400, _report(result)
    assert b is not None and not b.timed_out and b.status is not None, _report(result)
    new_images = [s for s in result.steps if s.step.startswith("c:")]
    assert len(new_images) == 20 and all(s.ok for s in new_images), _report(result)
    # The engine is idle once the load stops (< 5% of a core over the sample).
    assert result.spin_after is not None and not result.spin_after.spinning, _report(result)
    assert result.spin_after.cpu_percent < 5.0, _report(result)
    # Both the API server (P0) and EngineCore (P1) said they are protected.
    active = {p for p, lines in result.plugin_lines.items() if any("active in" in x for x in lines)}
    assert any("EngineCore" in p for p in active), _report(result)
    assert any("APIServer" in p or "MainProcess" in p for p in active), _report(result)
    # The README's "confirm that every process is patched" step, on this log.
    grep = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", guide_blocks()["confirm-logs"][1]],
        env={**os.environ, "VLLM_LOG": result.log_path},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert grep.returncode == 0 and len(grep.stdout.splitlines()) >= 2, grep


FAULT_VERSIONS = per_commit([v for v in VERSIONS if v in ("0.23.0", "0.32.0")] or VERSIONS[:1])
"""0.23.0 (where the fix's failure would bring the freeze back) or 0.32.0, one per commit."""


@pytest.mark.parametrize("version", FAULT_VERSIONS)
def test_incident_with_the_plugin_failing_inside(version: str, plugin_wheel: Path) -> None:
    """Every guarded site of the plugin raises (``MMCACHE_FIX_FAIL_AT=*``): the server
    answers at least as well as without the plugin, and the log says what failed."""
    venv = complete_venv(version)
    with runner.plugin_state(venv, plugin_wheel, purpose="plugin failing inside") as lock:
        options = incident.IncidentOptions(n_images=20, env={ENV_FAIL_AT: "*"})
        result = incident.run_incident(venv, options=options, lock=lock)
    print(_report(result))
    assert result.started, result.error
    assert not result.hung, _report(result)
    a, b = result.step("a:long+img0"), result.step("b:short+img0")
    assert a is not None and a.status == 400, _report(result)
    # Without the plugin: a 500 here (and on 0.23.0 the freeze later on).
    assert b is not None and not b.timed_out and b.status in (200, 500), _report(result)
    new_images = [s for s in result.steps if s.step.startswith("c:")]
    assert len(new_images) == 20 and all(s.ok for s in new_images), _report(result)
    log = Path(result.log_path).read_text(errors="replace")
    assert f"{PREFIX}{INTERNAL_ERROR} in mm-drift-guard" in log, _report(result)
    assert "vLLM goes on as without it" in log
