"""On installed vLLM builds, ``register()`` loads in each process kind the fixes that act there,
and loading the others as well would patch nothing more (the lazy plugin patches what the
eager one did). ``scripts/bench-register`` times the same process kinds."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from harness.paths import REPO_ROOT
from harness.programs.bench.register import KINDS
from harness.venvs import e2e_versions, venv_python
from vllm_mmcache_fix import vllm_layout

VERSIONS = e2e_versions()

CHILD = r"""
import importlib, json, multiprocessing, sys
spec = json.loads(sys.argv[1])
multiprocessing.current_process().name = spec["name"]
for name in spec["before"]:
    importlib.import_module(name)
import vllm_mmcache_fix
from vllm_mmcache_fix import plugin
from vllm_mmcache_fix.core import registry
vllm_mmcache_fix.register()
at_register = [s.id for s in plugin._SLOTS if s.fix is not None]
modules = sorted(m for m in sys.modules if m.startswith("vllm_mmcache_fix"))
for name in spec["after"]:
    try:
        importlib.import_module(name)
    except ImportError:
        pass
later = [s.id for s in plugin._SLOTS if s.fix is not None]
lazy = sorted(f"{a.patch_id} {a.target}" for a in registry.applied())
status = vllm_mmcache_fix.status()  # builds and installs every fix, as the eager plugin did
eager = sorted(f"{a.patch_id} {a.target}" for a in registry.applied())
print("RESULT " + json.dumps({
    "at_register": at_register, "modules": modules, "later": later, "lazy": lazy, "eager": eager,
    "installed": status["installed"], "internal_errors": status["internal_errors"],
}))
"""

LRU, DRIFT = "mm-lru-eviction", "mm-drift-guard"
ANSWER, HEALTH = "engine-liveness-answer", "engine-liveness-health"
METRICS, SENTINEL = "plugin-metrics", "stall-sentinel"
EXPECTED = {
    "worker": ([LRU], [LRU]),
    "engine_core": ([LRU, ANSWER, SENTINEL], [LRU, ANSWER, SENTINEL]),
    "api_server": ([LRU, DRIFT], [LRU, DRIFT, ANSWER, HEALTH, METRICS, SENTINEL]),
    "offline_llm": ([LRU, DRIFT, ANSWER, SENTINEL], [LRU, DRIFT, ANSWER, SENTINEL]),
}
"""Kind -> (fixes built by ``register()``, fixes built once the process imported the rest)."""


def _run(version: str, venv: Path, kind: str) -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("VLLM_", "MMCACHE_FIX_", "MMCACHE_HARNESS_"))
    }
    env.update({"PYTHONPATH": str(REPO_ROOT), "VLLM_TARGET_DEVICE": "cpu"})
    proc = subprocess.run(
        [str(venv_python(venv)), "-c", CHILD, json.dumps(KINDS[kind])],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd="/",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    [line] = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    data: dict = json.loads(line[len("RESULT ") :])
    return data


@pytest.mark.parametrize("kind", list(EXPECTED))
@pytest.mark.parametrize("version", VERSIONS)
def test_each_process_kind_loads_what_acts_there(version: str, kind: str, vllm_venv) -> None:
    out = _run(version, vllm_venv(version), kind)
    at_register, later = EXPECTED[kind]
    assert out["at_register"] == at_register, out
    assert out["later"] == later, out
    assert out["installed"] is True and out["internal_errors"] == 0, out
    # Loading every fix as well (what the plugin did before) patches nothing more, but for the
    # drift guard's sender and processor classes in a worker or EngineCore: no sender cache is
    # built there, so those wrappers never acted.
    assert set(out["lazy"]) <= set(out["eager"]), out
    extra = {p.split()[0] for p in set(out["eager"]) - set(out["lazy"])}
    assert extra <= ({"mm-drift-sender", "mm-drift-processor"} if DRIFT not in later else set())
    assert any(p.startswith("mm-lru") for p in out["lazy"]), out
    if kind == "worker":
        # A worker loads the eviction fix and the core it needs: no other fix, no operator
        # tool, not the settings table (each module costs about 0.1 ms there).
        extra = [
            m
            for m in out["modules"]
            if not m.startswith(("vllm_mmcache_fix.core", "vllm_mmcache_fix.lru_eviction"))
            and m not in WORKER_ROOT_MODULES
        ]
        assert extra == [] and "vllm_mmcache_fix.core.settings_table" not in out["modules"]
        # The fixed class and its counts come with the first cache vLLM builds: none here.
        assert "vllm_mmcache_fix.lru_eviction.cache" not in out["modules"], out["modules"]
        assert "vllm_mmcache_fix.lru_eviction.stats" not in out["modules"], out["modules"]


WORKER_ROOT_MODULES = {
    "vllm_mmcache_fix",
    "vllm_mmcache_fix._version",
    "vllm_mmcache_fix.plugin",
    "vllm_mmcache_fix.vllm_layout",
}


CALLS = re.compile(r"\b(renderer_from_config|processor_cache_from_config)\(")


@pytest.mark.parametrize("version", VERSIONS)
def test_every_sender_cache_builder_loads_the_drift_guard(version: str, vllm_venv) -> None:
    """The drift guard is loaded on the import of a module that builds a sender cache: every
    module of the installed vLLM that calls the builders is one of its triggers."""
    venv = vllm_venv(version)
    [site] = list(Path(venv).glob("lib/python*/site-packages/vllm"))
    callers = set()
    for path in site.rglob("*.py"):
        rel = path.relative_to(site.parent)
        if rel.parts[1] in ("renderers", "multimodal", "tests"):
            continue  # the builders themselves
        text = path.read_text(errors="replace")
        if any(not line.lstrip().startswith("def ") for line in _calls(text)):
            callers.add(".".join(rel.with_suffix("").parts))
    assert callers, "no caller found: the scan is broken"
    assert callers <= set(vllm_layout.SENDER_BUILDER_MODULES), callers


def _calls(text: str) -> list[str]:
    return [line for line in text.splitlines() if CALLS.search(line)]
