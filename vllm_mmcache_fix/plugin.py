"""Composition root: the ``vllm.general_plugins`` entry point installs each fix.

vLLM calls :func:`register` in the API server, in EngineCore and in every
worker, possibly several times, with no try/except around it: it must never
raise and must stay cheap. Each fix decides for itself whether it applies in
this process (the drift guard only acts where vLLM builds a sender cache, that
is in the API server).

A fix's package is imported only in a process that may need it: :func:`register`
subscribes each fix to the vLLM modules its targets live in (:data:`TRIGGERS`) and
imports and installs the fix when the first of them is imported (at once when one
already is). A worker imports the eviction fix only; EngineCore adds the heartbeat's
answer and the stall sentinel; the API server everything. Once installed, a fix
behaves as it always did: it subscribes to the modules it ``watches`` itself and patches
what it finds. The metrics and the stall sentinel act on signals that only the engine
liveness fixes send, so they come with those fixes' modules.

This module lists the fixes (:data:`_SLOTS`) and when each is imported (:data:`TRIGGERS`);
everything a fix owns (patches, counts, metrics, settings, "active" line, how it is built)
is in its declaration, ``<fix>/owns.py`` (``docs/new-fix.md``).

Looking a fix up (``FIXES``, ``LRU_EVICTION``, ... or :func:`status`) imports it, and
installs it when :func:`register` ran: what every process did before it was lazy.
:func:`counts` imports nothing (a fix not imported has counted nothing).

This module imports ``core.imports`` and ``vllm_layout`` only; the operator tools
(``tools/``) are never imported from here.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading

from .core import imports
from .vllm_layout import (
    ENGINE_CORE_CLASS,
    FACTORY_WATCHED_MODULES,
    HEALTH_TARGET,
    METRICS_ROUTE_MODULES,
    SENDER_BUILDER_MODULES,
)

TYPE_CHECKING = False  # as typing's, without importing typing in every vLLM process
if TYPE_CHECKING:
    from typing import Any

    from .core.declaration import Declaration
    from .core.lifecycle import Fix
    from .core.settings_table import SettingSpec

_HEALTH = (HEALTH_TARGET.module,)
_ANSWER = (ENGINE_CORE_CLASS.module,)

TRIGGERS: dict[str, tuple[str, ...]] = {
    "mm-lru-eviction": FACTORY_WATCHED_MODULES,
    # Where a sender cache can be built: the guard acts on nothing else. Once installed it
    # watches all of DRIFT_WATCHED_MODULES itself (vllm.multimodal.cache among them, which
    # every worker imports).
    "mm-drift-guard": SENDER_BUILDER_MODULES,
    "engine-liveness-answer": _ANSWER,
    "engine-liveness-health": _HEALTH,
    # The metrics start on the /metrics route's import or on the health fix's signals.
    "plugin-metrics": (*METRICS_ROUTE_MODULES, *_HEALTH),
    # The sentinel starts on the signals of the answer (EngineCore) and health (API server).
    "stall-sentinel": (*_ANSWER, *_HEALTH),
}
"""Fix id -> the modules whose import means the fix may act in this process: the fix is
imported and installed when the first of them is."""


_ENV_MODE = "MMCACHE_FIX_MODE"
"""``core.settings.ENV_MODE`` (not imported: the settings come with the first fix)."""

_lock = threading.RLock()


def _renew_lock() -> None:
    """A forked child gets a fresh lock: one held by another thread at the fork stays held."""
    global _lock
    _lock = threading.RLock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_renew_lock)


class _Slot:
    """One fix of :data:`FIXES`: built (its package imported) on first need."""

    __slots__ = ("id", "name", "owns", "fix", "wanted", "subscription", "problem")

    def __init__(self, fix_id: str, name: str, owns: str) -> None:
        self.id = fix_id
        self.name = name
        """The module attribute it answers to (``plugin.LRU_EVICTION``)."""
        self.owns = owns
        """``<module>:<attribute>`` of its :class:`~.core.declaration.Declaration`."""
        self.fix: Fix | None = None
        self.wanted = False
        """:func:`register` ran: install the fix once it is built."""
        self.subscription: imports.Subscription | None = None
        self.problem: str | None = None
        """Why the fix could not be built (a broken install); vLLM goes on without it."""

    def get(self) -> Fix:
        """The fix, built (and installed, when wanted) now if it was not yet."""
        with _lock:
            if self.fix is None:
                self.fix = self.declaration().build(sys.modules[__name__])
            fix = self.fix
        if self.wanted:
            fix.install()
        return fix

    def declaration(self) -> Declaration:
        """What the fix owns (imports its ``owns`` module, not the fix)."""
        module, _, attr = self.owns.partition(":")
        declaration: Declaration = getattr(importlib.import_module(module), attr)
        return declaration

    def loaded_declaration(self) -> Declaration | None:
        """The declaration if its module is imported already, else None (imports nothing)."""
        module, _, attr = self.owns.partition(":")
        return getattr(sys.modules.get(module), attr, None)

    def install(self, *, now: bool = False) -> None:
        """Install the fix when a trigger is imported, or ``now``."""
        if now:
            with _lock:
                self.wanted = True
            self.get()
            return
        with _lock:
            self.wanted = True
            fix = self.fix
            if fix is None and self.subscription is not None and not self.subscription.done:
                return  # waiting for a trigger
        if fix is not None:
            fix.install()
            return
        # Outside the lock: a trigger already imported builds the fix at once, and another
        # thread's import of a trigger may be waiting for the lock meanwhile.
        subscription = imports.when_imported(TRIGGERS[self.id], self._triggered)
        with _lock:
            self.subscription = subscription

    def uninstall(self) -> None:
        with _lock:
            self.wanted = False
            imports.cancel(self.subscription)
            self.subscription = None
            fix = self.fix
        if fix is not None:
            fix.uninstall()

    def _triggered(self, module: str) -> bool:
        """One of :data:`TRIGGERS` is imported: build and install the fix. Never raises (it
        runs at the end of vLLM's import of ``module``)."""
        try:
            self.get()
        except Exception as exc:
            with _lock:
                first = self.problem is None
                self.problem = f"cannot load {self.id} after importing {module}: {exc!r}"
            if first:
                try:
                    from .core import log

                    log.warning("internal error, vLLM left as it is: %s", self.problem)
                except Exception:
                    pass
        return True


_P = __name__.rpartition(".")[0]

_SLOTS: tuple[_Slot, ...] = (
    _Slot("mm-lru-eviction", "LRU_EVICTION", f"{_P}.lru_eviction.owns:DECLARATION"),
    _Slot("mm-drift-guard", "DRIFT_GUARD", f"{_P}.drift_guard.owns:DECLARATION"),
    _Slot("engine-liveness-answer", "ENGINE_ANSWER", f"{_P}.engine_liveness.owns:ANSWER"),
    _Slot("engine-liveness-health", "ENGINE_HEALTH", f"{_P}.engine_liveness.owns:HEALTH"),
    _Slot("plugin-metrics", "METRICS", f"{_P}.metrics.owns:DECLARATION"),
    _Slot("stall-sentinel", "STALL_SENTINEL", f"{_P}.stall_sentinel.owns:DECLARATION"),
)
"""The fixes: installed in this order; each decides for itself whether it acts in this
process. Everything a fix owns is in its declaration (``docs/new-fix.md``)."""

_BY_NAME = {slot.name: slot for slot in _SLOTS}


def built_fixes() -> tuple[Fix, ...]:
    """The fixes built in this process so far, in :data:`FIXES` order; imports nothing
    (safe where no import may happen, e.g. right after a fork)."""
    return tuple(slot.fix for slot in _SLOTS if slot.fix is not None)


def __getattr__(name: str) -> Any:
    """``FIXES`` and each fix by name (``LRU_EVICTION``...), built on first use."""
    if name == "FIXES":
        return tuple(slot.get() for slot in _SLOTS)
    slot = _BY_NAME.get(name)
    if slot is not None:
        return slot.get()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if TYPE_CHECKING:
    from .drift_guard.fix import DriftGuard
    from .engine_liveness.answer import EngineLivenessAnswer
    from .engine_liveness.health import EngineHealth
    from .lru_eviction.fix import LruEvictionFix
    from .metrics.fix import PluginMetrics
    from .stall_sentinel.fix import StallSentinelFix

    FIXES: tuple[Fix, ...]
    LRU_EVICTION: LruEvictionFix
    DRIFT_GUARD: DriftGuard
    ENGINE_ANSWER: EngineLivenessAnswer
    ENGINE_HEALTH: EngineHealth
    METRICS: PluginMetrics
    STALL_SENTINEL: StallSentinelFix


def register() -> None:
    """Entry point for vLLM's plugin loader: never raises."""
    try:
        install()
    except Exception as exc:
        try:
            from .core import log

            log.warning("internal error, vLLM left as it is: %r", exc)
        except Exception:
            pass


def install() -> None:
    """Install each fix when this process may need it; idempotent. Imports a fix only
    when one of its :data:`TRIGGERS` is imported."""
    # MMCACHE_FIX_MODE=off: every fix says so at once and no import hook is left behind.
    off = os.environ.get(_ENV_MODE, "").strip().lower() == "off"
    for slot in _SLOTS:
        slot.install(now=off)


def instrument() -> dict[str, Any]:
    """Install every fix that applies in this process; idempotent. Returns :func:`status`."""
    install()
    return status()


def uninstrument() -> None:
    """Undo everything :func:`instrument` did in this process."""
    for slot in reversed(_SLOTS):
        slot.uninstall()
    imports.cancel_all()
    registry = sys.modules.get(f"{__package__}.core.registry")
    if registry is not None:
        registry.revert_all()
    counters = sys.modules.get(f"{__package__}.core.counters")
    if counters is not None:
        counters.reset()
    cache_stats = sys.modules.get(f"{__package__}.lru_eviction.stats")
    if cache_stats is not None:
        cache_stats.reset()


def _built() -> list[Fix]:
    with _lock:
        return list(built_fixes())


def built(fix_id: str) -> Fix | None:
    """The fix with this id if this process built it, else None; imports nothing."""
    for slot in _SLOTS:
        if slot.id == fix_id:
            return slot.fix
    return None


def internal_errors() -> int:
    """Fixes that could not load plus every built fix's guarded internal errors."""
    with _lock:
        broken = sum(1 for slot in _SLOTS if slot.problem is not None)
    return broken + sum(fix.errors.total for fix in _built())


def declarations() -> tuple[Declaration, ...]:
    """Every fix's declaration, in :data:`FIXES` order (imports the ``owns`` modules, builds
    nothing)."""
    return tuple(slot.declaration() for slot in _SLOTS)


def settings() -> tuple[SettingSpec, ...]:
    """Every ``MMCACHE_FIX_*`` setting: the plugin's own and each fix's (``check``'s table)."""
    from .core.settings_table import SETTINGS_AFTER_FIXES, SETTINGS_BEFORE_FIXES

    declared = tuple(spec for d in declarations() for spec in d.settings)
    return (*SETTINGS_BEFORE_FIXES, *declared, *SETTINGS_AFTER_FIXES)


def counts() -> dict[str, int]:
    """This process's counters as plain numbers: what ``/metrics`` exports (and what
    EngineCore sends with each answer to the heartbeat): the counts each fix declares, for
    the fixes whose declaration is loaded (a fix not loaded has counted nothing), and the
    internal errors. Imports nothing."""
    from .core.declaration import INTERNAL_ERRORS_COUNT, read_counts

    root: Any = sys.modules[__name__]
    loaded = [d for d in (slot.loaded_declaration() for slot in _SLOTS) if d is not None]
    return {
        INTERNAL_ERRORS_COUNT.key: INTERNAL_ERRORS_COUNT.read(root),
        **read_counts(loaded, root),
    }


def status() -> dict[str, Any]:
    """What this process has applied, as plain data (a copy; ``schema_version`` first).
    Builds every fix (see the module's docstring)."""
    from .core import registry
    from .core.lifecycle import STATUS_SCHEMA
    from .core.process import process_label, vllm_version

    fixes = [slot.get() for slot in _SLOTS]
    lru_fix, drift_fix, sentinel = (
        _BY_NAME["LRU_EVICTION"].get(),
        _BY_NAME["DRIFT_GUARD"].get(),
        _BY_NAME["STALL_SENTINEL"].get(),
    )
    lru = lru_fix.status()
    return {
        "schema_version": STATUS_SCHEMA,
        "process": process_label(),
        "vllm_version": vllm_version(),
        # The eviction fix's fields at the top level, as the log line and check read them.
        "mode": lru["mode"],
        "attempted": lru["attempted"],
        "installed": lru["installed"],
        "waiting_for_import": lru["waiting_for_import"],
        "target": lru["target"],
        "layout": lru["layout"],
        "not_applied_reason": lru["not_enabled_reason"],
        "exposure": lru["exposure"],
        "caches_built": lru["caches_built"],
        "caches_fixed": lru["caches_fixed"],
        "repairs": lru["repairs"],
        "problems": lru["problems"],
        "drift": drift_fix.status(),
        "stall_sentinel": sentinel.status(),
        "fixes": {fix.id: fix.status() for fix in fixes},
        "internal_errors": internal_errors(),
        "patches": [{"id": a.patch_id, "target": a.target} for a in registry.applied()],
        "instance_patches": [
            {"id": pid, "target": what} for pid, what in registry.instance_changes()
        ],
    }
