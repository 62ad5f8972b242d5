"""Wiring: read the mode, find the target, patch it, report.

``register`` is the ``vllm.general_plugins`` entry point. vLLM calls it in the
API server, in EngineCore and in every worker, possibly several times, with
no try/except around it: it must never raise and must stay cheap.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

from . import _log, drift, fixed_cache, importhook, registry, startup
from .config import Mode, read_mode
from .locate import WATCHED_MODULES, LayoutNotFound, locate_mm_cache_factory
from .patching import PATCH_FIX, PATCH_OBSERVE, wrap_factory
from .probe import Exposure, probe

REPAIR_LOG_INTERVAL_S = 60.0


@dataclass
class PluginState:
    mode: Mode | None = None
    attempted: bool = False
    waiting_for_import: bool = False
    hook: importhook.PostImportHook | None = None
    installed: bool = False
    target: str | None = None
    layout: str | None = None
    not_applied_reason: str | None = None
    exposure: Exposure | None = None
    caches_built: int = 0
    caches_fixed: int = 0
    announcement: str | None = None
    """The "active" line, held back until vLLM's logging is set up."""
    warned: bool = False
    problems: list[str] = field(default_factory=list)


_lock = threading.RLock()
_state = PluginState()
# Caches are mappings, hence unhashable: keep plain weak references.
_fixed_caches: list[weakref.ref[Any]] = []
_repair_limiter = _log.RateLimiter(REPAIR_LOG_INTERVAL_S)


def register() -> None:
    """Entry point for vLLM's plugin loader: never raises."""
    try:
        instrument()
    except Exception as exc:
        try:
            _log.warning("internal error, vLLM left as it is: %r", exc)
        except Exception:
            pass


def instrument() -> PluginState:
    """Apply the fix in this process according to ``MMCACHE_FIX_MODE``; idempotent."""
    with _lock:
        if _state.attempted:
            return _state
        _state.attempted = True
        setting = read_mode()
        _state.mode = setting.mode
        if setting.problem:
            _state.problems.append(setting.problem)
            _log.warning("%s", setting.problem)
        if setting.mode is Mode.OFF:
            _state.not_applied_reason = "disabled by MMCACHE_FIX_MODE=off"
            _log.info(
                "disabled by MMCACHE_FIX_MODE=off in %s; nothing patched", startup.process_label()
            )
            return _state
        fixed_cache.add_repair_listener(_on_repair)
        if setting.mode is Mode.ON:
            drift.install_drift_fix()
        if not _try_locate_and_patch(final=_all_watched_imported()):
            _state.waiting_for_import = True
            _state.hook = importhook.when_imported(WATCHED_MODULES, _on_import)
        return _state


def uninstrument() -> None:
    """Undo everything ``instrument`` did in this process (for tests)."""
    with _lock:
        drift.uninstall_drift_fix()
        importhook.remove_hooks()
        registry.revert_all()
        fixed_cache.remove_repair_listener(_on_repair)
        for ref in _fixed_caches:
            cache = ref()
            if cache is not None:
                fixed_cache.downgrade(cache)
        _fixed_caches.clear()
        global _state
        _state = PluginState()


def status() -> dict[str, Any]:
    """What this process has applied, as plain data."""
    with _lock:
        state = _state
        return {
            "mode": state.mode.value if state.mode else None,
            "attempted": state.attempted,
            "installed": state.installed,
            "waiting_for_import": state.waiting_for_import,
            "target": state.target,
            "layout": state.layout,
            "not_applied_reason": state.not_applied_reason,
            "exposure": state.exposure.as_dict() if state.exposure else None,
            "caches_built": state.caches_built,
            "caches_fixed": state.caches_fixed,
            "repairs": fixed_cache.STATS.as_dict(),
            "drift": drift.status(),
            "patches": [{"id": a.patch_id, "target": a.target} for a in registry.applied()],
            "problems": list(state.problems),
            "vllm_version": startup.vllm_version(),
            "process": startup.process_label(),
        }


def _all_watched_imported() -> bool:
    import sys

    return all(name in sys.modules for name in WATCHED_MODULES)


def _on_import(name: str) -> None:
    try:
        with _lock:
            if not _state.waiting_for_import:
                return
            if _try_locate_and_patch(final=_all_watched_imported()):
                _state.waiting_for_import = False
                _drop_hook()
    except Exception as exc:
        _log.warning("internal error after importing %s, vLLM left as it is: %r", name, exc)


def _try_locate_and_patch(*, final: bool) -> bool:
    """True when done (patched, or given up for good)."""
    try:
        factory = locate_mm_cache_factory()
    except LayoutNotFound as exc:
        if not final:
            return False
        _give_up(f"unrecognised vLLM layout: {exc}")
        return True
    _state.target = factory.qualname
    _state.layout = factory.layout
    _state.exposure = probe(factory.lru_class) if factory.lru_class is not None else None
    if _state.mode is Mode.WARN:
        _state.not_applied_reason = "MMCACHE_FIX_MODE=warn"
        wrap_factory(PATCH_OBSERVE, factory, _observe_build, _on_build_error)
        return True
    if wrap_factory(PATCH_FIX, factory, _fix_build, _on_build_error):
        _state.installed = True
        _state.announcement = startup.active_line(factory.qualname, factory.layout, _state.exposure)
        _announce()
    return True


def _announce() -> None:
    """Log the "active" line once, as soon as it can reach vLLM's log."""
    if _state.announcement is not None and _log.has_destination():
        line, _state.announcement = _state.announcement, None
        _log.info("%s", line)


def _drop_hook() -> None:
    if _state.hook is not None:
        importhook.remove_hook(_state.hook)
        _state.hook = None


def _give_up(reason: str) -> None:
    _state.not_applied_reason = reason
    _state.waiting_for_import = False
    _drop_hook()
    exposure = _state.exposure or _probe_installed_lru()
    if exposure is None or startup.needs_warning(exposure, None):
        _state.warned = True
        _log.warning("%s", startup.exposure_warning(reason, exposure or Exposure(True, True), None))
    else:
        _log.info("%s", startup.hardening_note(reason))


def _probe_installed_lru() -> Exposure | None:
    from .locate import locate_lru_class

    try:
        return probe(locate_lru_class())
    except LayoutNotFound:
        return None


def _fix_build(cache: Any, capacity_gb: float | None) -> Any:
    with _lock:
        _state.caches_built += 1
        _announce()
    reason = fixed_cache.check_compatible(cache)
    if reason is not None:
        _warn_unprotected(f"cannot fix this cache: {reason}", capacity_gb)
        return cache
    fixed_cache.upgrade(cache)
    with _lock:
        _state.caches_fixed += 1
        _fixed_caches[:] = [ref for ref in _fixed_caches if ref() is not None]
        _fixed_caches.append(weakref.ref(cache))
    _log.debug("fixed multimodal cache built (%s GiB)", capacity_gb)
    return cache


def _observe_build(cache: Any, capacity_gb: float | None) -> Any:
    with _lock:
        _state.caches_built += 1
    _warn_unprotected("MMCACHE_FIX_MODE=warn", capacity_gb)
    return cache


def _warn_unprotected(why: str, capacity_gb: float | None) -> None:
    with _lock:
        if _state.warned:
            return
        exposure = _state.exposure or Exposure(True, True)
        if startup.needs_warning(exposure, capacity_gb):
            _state.warned = True
            _log.warning("%s", startup.exposure_warning(why, exposure, capacity_gb))


def _on_build_error(exc: BaseException) -> None:
    with _lock:
        _state.problems.append(f"cache build hook failed: {exc!r}")
    _log.warning("could not fix a multimodal cache, vLLM's own cache is used: %r", exc)


def _on_repair(kind: str, count: int, cache: Any) -> None:
    may_log, held = _repair_limiter.ready()
    if not may_log:
        return
    totals = ", ".join(f"{k}={v}" for k, v in fixed_cache.STATS.as_dict().items())
    _log.warning(
        "repaired a multimodal cache in %s: %s +%d (order and data had diverged; "
        "unpatched vLLM would stall here, vllm#43941). Totals: %s%s",
        startup.process_label(),
        kind,
        count,
        totals,
        f"; {held} more repair events since the last line" if held else "",
    )
