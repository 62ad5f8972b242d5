"""The liveness round trip's two ends on installed vLLM builds (no server).

In a process named like EngineCore, the plugin adds ``EngineCore.mmcache_fix_ping`` to
the real class and vLLM's own utility dispatch (``getattr(engine, name)(*args)``)
answers with the counters; in the API server, the real ``AsyncLLM.check_health`` is
wrapped, and a real ``AsyncMPClient`` has the call the round trip uses.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from harness.paths import REPO_ROOT
from harness.venvs import e2e_versions, venv_python

VERSIONS = e2e_versions()

CODE = r"""
import inspect, json, multiprocessing
multiprocessing.current_process().name = "EngineCore"
import vllm.v1.engine.core as core
import vllm_mmcache_fix
from vllm_mmcache_fix import plugin
plugin.instrument()
engine = object.__new__(core.EngineCore)
method = getattr(engine, "mmcache_fix_ping")  # what _handle_client_request looks up
answer = method()
multiprocessing.current_process().name = "APIServer"
import vllm.v1.engine.async_llm as async_llm
import vllm.v1.engine.core_client as cc
wrapped = async_llm.AsyncLLM.check_health
params = inspect.signature(cc.AsyncMPClient._call_utility_async).parameters
print(json.dumps({
    "answer": answer,
    "health_wrapped": getattr(wrapped, "__wrapped__", None) is not None,
    "client_call_has_engine": "engine" in params,
    "fixes": {k: v["enabled"] for k, v in vllm_mmcache_fix.status()["fixes"].items()},
}))
"""


@pytest.mark.parametrize("version", VERSIONS)
def test_both_ends_on_the_real_classes(version: str, vllm_venv) -> None:
    venv = vllm_venv(version)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "VLLM_TARGET_DEVICE": "cpu"}
    proc = subprocess.run(
        [str(venv_python(venv)), "-c", CODE],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        cwd="/",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    answer = out["answer"]
    assert answer["schema"] == 1 and isinstance(answer["pid"], int), out
    assert set(answer["counts"]) >= {"protected", "ghost_keys_dropped", "stalls"}, out
    assert out["fixes"]["engine-liveness-answer"] is True, out
    assert out["health_wrapped"] is True, out
    assert out["client_call_has_engine"] is True, out
