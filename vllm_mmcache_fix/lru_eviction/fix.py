"""Lifecycle of the eviction fix: find the factory, wrap it, fix each cache it builds."""

from __future__ import annotations

import sys
from typing import Any

from ..core import log, registry
from ..core.lifecycle import DidNotEnable, Fix
from ..core.messages import REPAIRED
from ..core.process import process_label
from ..core.settings import Mode, read_mode
from ..core.signatures import SignatureMismatch
from . import report
from .factory import PATCH_FIX, PATCH_OBSERVE, wrap_factory
from .locate import WATCHED_MODULES, LayoutNotFound, locate_lru_class, locate_mm_cache_factory
from .owns import repair_totals
from .probe import Exposure, probe

REPAIR_LOG_INTERVAL_S = 60.0


class LruEvictionFix(Fix):
    id = "mm-lru-eviction"
    runs_in = "every process"
    watches = WATCHED_MODULES

    def __init__(self) -> None:
        super().__init__()
        self._site_build = self.errors.site("lru.cache_built")
        self._site_repair = self.errors.site("lru.repair_log")
        self._repair_limiter = log.RateLimiter(REPAIR_LOG_INTERVAL_S)
        self._reset()

    def _reset(self) -> None:
        self.mode: str | None = None
        self.installed = False
        self.target: str | None = None
        self.layout: str | None = None
        self.exposure: Exposure | None = None
        self.caches_built = 0
        self.caches_fixed = 0
        self.announcement: str | None = None
        """The "active" line, held back until vLLM's logging is set up."""
        self.warned = False

    # -- lifecycle -----------------------------------------------------------------

    def _install(self) -> None:
        setting = read_mode()
        self.mode = setting.value
        if setting.problem:
            self.note_problem(setting.problem)
            log.warning("%s", setting.problem)
        if self.mode == Mode.OFF:
            log.info("disabled by MMCACHE_FIX_MODE=off in %s; nothing patched", process_label())
            raise DidNotEnable("disabled by MMCACHE_FIX_MODE=off")

    def _uninstall(self) -> None:
        registry.revert_patch(PATCH_FIX)
        registry.revert_patch(PATCH_OBSERVE)
        fixed_cache = sys.modules.get(f"{__package__}.cache")  # imported with the first cache
        if fixed_cache is not None:
            fixed_cache.remove_repair_listener(self._on_repair)

    def _status(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "installed": self.installed,
            "waiting_for_import": self.waiting_for_import,
            "target": self.target,
            "layout": self.layout,
            "exposure": self.exposure.as_dict() if self.exposure else None,
            "caches_built": self.caches_built,
            "caches_fixed": self.caches_fixed,
            "repairs": repair_totals(),
        }

    def _on_internal_error(self, where: str, exc: BaseException) -> None:
        self.note_problem(f"{where}: {exc!r}")

    # -- finding and patching --------------------------------------------------------

    def _on_import(self, name: str) -> bool:
        return self._try_locate_and_patch(final=_all_watched_imported())

    def _try_locate_and_patch(self, *, final: bool) -> bool:
        """True when done (patched, or given up for good)."""
        try:
            factory = locate_mm_cache_factory()
        except LayoutNotFound as exc:
            if not final:
                return False
            self._give_up(f"unrecognised vLLM layout: {exc}")
            return True
        self.target = factory.qualname
        self.layout = factory.layout
        self.exposure = probe(factory.lru_class) if factory.lru_class is not None else None
        try:
            if self.mode == Mode.WARN:
                self.not_enabled_reason = "MMCACHE_FIX_MODE=warn"
                wrap_factory(PATCH_OBSERVE, factory, self._observe_build, self._on_build_error)
                return True
            if wrap_factory(PATCH_FIX, factory, self._fix_build, self._on_build_error):
                self.installed = True
                self.announcement = report.active_line(
                    factory.qualname, factory.layout, self.exposure
                )
                self._announce()
        except SignatureMismatch as exc:
            self._give_up(f"{factory.qualname} changed: {exc}")
        return True

    def _announce(self) -> None:
        """Log the "active" line once, as soon as it can reach vLLM's log."""
        if self.announcement is not None and log.has_destination():
            line, self.announcement = self.announcement, None
            log.info("%s", line)

    def _give_up(self, reason: str) -> None:
        self.not_enabled_reason = reason
        exposure = self.exposure or _probe_installed_lru()
        if exposure is None or report.needs_warning(exposure, None):
            self.warned = True
            log.warning(
                "%s", report.exposure_warning(reason, exposure or Exposure(True, True), None)
            )
        else:
            log.info("%s", report.hardening_note(reason))

    # -- called from vLLM's factory (guarded there) ----------------------------------

    def _fix_build(self, cache: Any, capacity_gb: float | None) -> Any:
        from . import cache as fixed_cache

        with self.lock:
            self.caches_built += 1
            self._announce()
        fixed_cache.add_repair_listener(self._on_repair)  # a no-op after the first cache
        reason = fixed_cache.check_compatible(cache)
        if reason is not None:
            self._warn_unprotected(f"cannot fix this cache: {reason}", capacity_gb)
            return cache
        with self._site_build:
            registry.switch_class(PATCH_FIX, cache, fixed_cache.fixed_lru_class(type(cache)))
            with self.lock:
                self.caches_fixed += 1
        return cache

    def _observe_build(self, cache: Any, capacity_gb: float | None) -> Any:
        with self.lock:
            self.caches_built += 1
        self._warn_unprotected("MMCACHE_FIX_MODE=warn", capacity_gb)
        return cache

    def _warn_unprotected(self, why: str, capacity_gb: float | None) -> None:
        with self.lock:
            if self.warned:
                return
            exposure = self.exposure or Exposure(True, True)
            if report.needs_warning(exposure, capacity_gb):
                self.warned = True
                log.warning("%s", report.exposure_warning(why, exposure, capacity_gb))

    def _on_build_error(self, exc: BaseException) -> None:
        self.errors.record("lru.cache_built", exc)
        log.warning("could not fix a multimodal cache, vLLM's own cache is used: %r", exc)

    def _on_repair(self, kind: str, count: int, cache: Any) -> None:
        with self._site_repair:
            may_log, held = self._repair_limiter.ready()
            if not may_log:
                return
            totals = ", ".join(f"{k}={v}" for k, v in repair_totals().items())
            log.warning(
                "%s in %s: %s +%d (order and data had diverged; unpatched vLLM would stall "
                "here, vllm#43941). Totals: %s%s",
                REPAIRED,
                process_label(),
                kind,
                count,
                totals,
                f"; {held} more repair events since the last line" if held else "",
            )


def _all_watched_imported() -> bool:
    return all(name in sys.modules for name in WATCHED_MODULES)


def _probe_installed_lru() -> Exposure | None:
    try:
        return probe(locate_lru_class())
    except LayoutNotFound:
        return None
