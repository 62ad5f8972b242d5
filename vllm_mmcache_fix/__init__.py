"""vllm-mmcache-fix: multimodal processor caches that cannot freeze vLLM.

Installed next to vLLM, the ``mmcache_fix`` general plugin installs one package per
feature (``plugin.FIXES``); each decides for itself where it acts (``runs_in``):

- ``lru_eviction``: the LRU behind vLLM's multimodal processor caches gets an
  eviction that always makes progress (every process);
- ``drift_guard``: the API server's sender cache stays in step with EngineCore's,
  and a request EngineCore cannot serve is re-sent with its data (API server);
- ``engine_liveness``: ``/health`` also fails when an EngineCore stops answering
  (the check in the API server, the answer in EngineCore);
- ``metrics``: the plugin's counters on vLLM's ``/metrics`` (API server);
- ``stall_sentinel``: a thread that logs the stack of any thread stuck burning a
  core in one place (EngineCore and API server).

``core/`` holds what they share, ``tools/`` the operator commands (``check``,
``diagnose``, ``patch``), ``catalogue`` and ``vllm_layout`` the data.
Importing this package never imports vLLM.
"""

from __future__ import annotations

from ._version import version as _read_version

TYPE_CHECKING = False  # as typing's: vLLM imports this package in every process
if TYPE_CHECKING:
    from typing import Any

__version__ = _read_version()
"""This build's version: ``0.3.0.dev0+g<commit>`` between releases (``_version.py``)."""

__all__ = ["__version__", "instrument", "register", "status", "uninstrument"]


def register() -> None:
    """The ``vllm.general_plugins`` entry point (see :mod:`vllm_mmcache_fix.plugin`).

    vLLM calls it without a ``try``: not even a broken install may raise from here."""
    try:
        from .plugin import register as _register
    except Exception as exc:
        try:
            import logging

            logging.getLogger("vllm.mmcache_fix").warning(
                "vllm-mmcache-fix: internal error, vLLM left as it is: cannot import the "
                "plugin: %r",
                exc,
            )
        except Exception:
            pass
        return
    _register()


def instrument() -> dict[str, Any]:
    from .plugin import instrument as _instrument

    return _instrument()


def uninstrument() -> None:
    from .plugin import uninstrument as _uninstrument

    _uninstrument()


def status() -> dict[str, Any]:
    from .plugin import status as _status

    return _status()
