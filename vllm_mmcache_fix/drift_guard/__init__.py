"""The drift guard — runs in the **API server only** (where vLLM builds the sender cache).

The API server (P0) keeps a metadata-only shadow of EngineCore's (P1) cache
and sends ``data=None`` for items it believes P1 holds. A request rejected
after P0 recorded its image (the prompt-length check after placeholder
expansion, vllm#43941) leaves the two apart: the next request with that image
fails (a 500 on every retry up to 0.27, one 500 from 0.28). The guard undoes
rejected requests' cache changes (prevention) and re-sends, once, a request
whose items P1 lacks (recovery).

Its classes are patched in every process that imports them, but it acts only
where a sender cache exists; everything it does around a vLLM call is guarded
(fail-open) and an internal error switches it off for good.

- ``journal``: the pure algorithm (journals over a shadow; no vLLM, no package imports)
- ``context``: the per-request scope the wrappers share on one thread
- ``pending``: processed inputs on their way to EngineCore, deferred rollbacks
- ``attempts``: what recovery keeps of a request that sent items without data
- ``sender`` / ``processor`` / ``recovery``: the wrappers
- ``state``, ``stats``: what the wrappers read and count
- ``fix``: the lifecycle (``DriftGuard``)
"""

from __future__ import annotations

from typing import Any

from ..core.settings import ENV_DRIFT, DriftMode, read_drift_mode
from .fix import DriftGuard

__all__ = [
    "ENV_DRIFT",
    "GUARD",
    "DriftMode",
    "install",
    "read_drift_mode",
    "status",
    "uninstall",
]

GUARD = DriftGuard()
"""The process's drift guard (``plugin.FIXES`` holds the same object)."""


def install() -> dict[str, Any]:
    """Install the drift guard alone (the plugin installs it with the eviction fix)."""
    GUARD.install()
    return GUARD.status()


def uninstall() -> None:
    GUARD.uninstall()


def status() -> dict[str, Any]:
    return GUARD.status()
