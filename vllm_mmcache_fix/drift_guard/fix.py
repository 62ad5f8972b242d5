"""Lifecycle of the drift guard: find its targets, wrap them, switch off on internal error."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

from ..core import log, registry
from ..core.lifecycle import DidNotEnable, Fix
from ..core.messages import DRIFT_GUARD_ACTIVE, DRIFT_RECOVERY_ACTIVE
from ..core.process import process_label
from ..core.settings import DriftMode, Mode, read_drift_mode, read_mode
from ..core.signatures import SignatureMismatch
from ..vllm_layout import DRIFT_TARGETS, DRIFT_WATCHED_MODULES, DriftTarget
from . import handoff, processor, recovery, sender
from .state import FIX_ID, GuardState

PATCH_PREFIX = "mm-drift"

Wrapper = Callable[[Any, Any], Any]

WRAPPERS: dict[str, tuple[tuple[str, Wrapper], ...]] = {
    "sender": sender.WRAPPERS,
    "processor": (
        ("_merge_mm_kwargs", processor.wrap_merge),
        ("apply", processor.wrap_apply),
        ("_get_cache_missing_items", processor.wrap_lookup),
    ),
    "process_inputs": (("process_inputs", processor.wrap_process_inputs),),
    "generate": (
        ("generate", recovery.wrap_generate),
        ("add_request", handoff.wrap_add_request),
        ("check_admission", handoff.wrap_check_admission),
    ),
}
"""Target name (``vllm_layout.DRIFT_TARGETS``) -> (method, wrapper factory); a factory
takes the :class:`DriftGuard` and vLLM's function."""

NEEDED = frozenset({"sender", "processor", "process_inputs"})


def patch_id(target: str) -> str:
    return f"{PATCH_PREFIX}-{target}"


class DriftGuard(Fix):
    id = FIX_ID
    runs_in = "API server"
    watches = DRIFT_WATCHED_MODULES

    def __init__(self) -> None:
        super().__init__()
        self.state = GuardState(fix=self, errors=self.errors)
        """Everything the wrappers read and change; they reach it through this fix."""
        self._reset()

    # -- lifecycle -----------------------------------------------------------------

    def _install(self) -> None:
        mode = read_mode().value
        if mode != Mode.ON:
            raise DidNotEnable(f"MMCACHE_FIX_MODE={mode}: only 'on' guards the sender cache")
        setting = read_drift_mode()
        self.state.mode = setting.value
        if setting.problem:
            self.note(setting.problem)
        if setting.value == DriftMode.OFF:
            raise DidNotEnable("disabled by MMCACHE_FIX_DRIFT=off")
        self.errors.reload_faults()
        self.state.installed = True

    def _uninstall(self) -> None:
        for target in DRIFT_TARGETS:
            registry.revert_patch(patch_id(target.name))
        self.state.reset()  # also where a failed install undoes itself (no _reset there)

    def _reset(self) -> None:
        self.state.reset()
        self.announced = False
        self.recovery_announced = False

    def _status(self) -> dict[str, Any]:
        return {
            "mode": self.state.mode,
            "installed": self.state.installed,
            "patched": dict(self.state.patched),
            "tracking": self.state.live,
            "switched_off": self.state.switched_off,
            "pending": self.state.pending.pending(),
            "recoverable": self.state.attempts.attempts(),
            "counts": self.state.stats.as_dict(),
        }

    def _on_internal_error(self, where: str, exc: BaseException) -> None:
        self.switch_off(where, exc)

    def switch_off(self, where: str, exc: BaseException) -> None:
        """An internal error at ``where``: stop all tracking for good, vLLM's behaviour from
        now on (with the eviction fix still in place)."""
        with self.state.lock:
            if self.state.switched_off is None:
                self.state.switched_off = f"internal error at {where}: {exc!r}"
            for shadow in self.state.live_shadows():
                sender.detach(self.state, shadow)
            self.state.pending.clear()
        self.state.attempts.clear()
        self.note_problem(f"switched off after an internal error at {where}: {exc!r}")

    def note(self, problem: str) -> None:
        if self.note_problem(problem):
            log.info("drift guard: %s", problem)

    # -- finding and patching --------------------------------------------------------

    def _on_import(self, name: str) -> bool:
        self._patch_available()
        return len(self.state.patched) == len(DRIFT_TARGETS)

    def _patch_available(self) -> None:
        with self.state.lock:
            for target in DRIFT_TARGETS:
                if target.name in self.state.patched:
                    continue
                cls, reason = find(target)
                if cls is None:
                    if reason:
                        self.note(f"{target.name}: {reason}")
                    continue
                problem = self._patch(target, cls)
                if problem is not None:
                    self.note(f"{target.name}: not patched, {problem}")
                    continue
                self.state.patched[target.name] = f"{cls.__module__}.{cls.__qualname__}"
                if target.name == "sender":
                    self.state.sender_types = (cls,)
            self.announce()

    def _patch(self, target: DriftTarget, cls: type) -> str | None:
        """Wrap ``cls``'s methods for ``target``; all or none. Returns why not, or None."""
        for attr, make in WRAPPERS[target.name]:
            if not callable(cls.__dict__.get(attr)):
                continue  # optional method absent in this release
            try:
                registry.wrap(patch_id(target.name), cls, attr, functools.partial(make, self))
            except SignatureMismatch as exc:
                if attr in target.optional:
                    continue  # an older shape of an optional method (0.10.0's lookup)
                registry.revert_patch(patch_id(target.name))
                return str(exc)
        return None

    def announce(self) -> None:
        if not NEEDED <= set(self.state.patched):
            return
        if not log.has_destination():
            return  # vLLM's logging is not set up yet; the sender cache retries
        recovery_on = self.state.recovery
        if not self.announced:
            self.announced = True
            log.info(
                "%s %s (mode=%s): %s; recovery from EngineCore misses %s",
                DRIFT_GUARD_ACTIVE,
                process_label(),
                self.state.mode or "?",
                ", ".join(f"{k}={v}" for k, v in sorted(self.state.patched.items())),
                "on" if recovery_on else "waits for vllm.v1.engine.async_llm",
            )
            self.recovery_announced = recovery_on
        elif recovery_on and not self.recovery_announced:
            self.recovery_announced = True
            log.info(
                "%s %s: %s", DRIFT_RECOVERY_ACTIVE, process_label(), self.state.patched["generate"]
            )


def find(target: DriftTarget) -> tuple[type | None, str | None]:
    """(class, None) when found; (None, reason) when a candidate module is loaded but unusable."""
    reasons = []
    for candidate in target.candidates:
        module: ModuleType | None = sys.modules.get(candidate.module)
        if module is None:
            continue
        cls = getattr(module, candidate.cls, None)
        if cls is None and _initializing(module):
            # Still executing (another watched module imported from inside it, as
            # vllm.v1.engine.async_llm imports vllm.v1.engine.processor on 0.11): the
            # class comes later, and the end of its import calls back here.
            continue
        if not isinstance(cls, type) or cls.__module__ != candidate.module:
            reasons.append(f"{candidate.module}: no class {candidate.cls} defined there")
            continue
        missing = [a for a in target.required if not callable(cls.__dict__.get(a))]
        if missing:
            reasons.append(f"{candidate.module}.{candidate.cls}: no {', '.join(missing)}")
            continue
        return cls, None
    return None, "; ".join(reasons) or None


def _initializing(module: ModuleType) -> bool:
    """The module's import has started and not finished yet."""
    spec = getattr(module, "__spec__", None)
    return bool(getattr(spec, "_initializing", False))
