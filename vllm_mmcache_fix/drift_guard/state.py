"""What the drift guard's wrappers read on every call: one state object, one error book."""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

from ..core.guard import InternalErrors
from ..core.settings import DriftMode
from .journal import Shadow

FIX_ID = "mm-drift-guard"


@dataclass
class GuardState:
    mode: DriftMode | None = None
    installed: bool = False
    tracking: bool = False
    """A sender cache is tracked in this process (so this is the API server)."""
    switched_off: str | None = None
    """Why tracking was switched off for good (an internal error), or None."""
    patched: dict[str, str] = field(default_factory=dict)
    sender_types: tuple[type, ...] = ()
    lock: threading.RLock = field(default_factory=threading.RLock)
    fix: Any = None
    """The :class:`~.fix.DriftGuard` that owns this state."""

    @property
    def live(self) -> bool:
        """Wrappers do their bookkeeping only while this holds."""
        return self.tracking and self.switched_off is None

    @property
    def prevent(self) -> bool:
        return self.mode is DriftMode.ON and "process_inputs" in self.patched

    @property
    def recovery(self) -> bool:
        return "generate" in self.patched


STATE = GuardState()


def _on_error(where: str, exc: BaseException) -> None:
    fix = STATE.fix
    if fix is not None:
        fix.switch_off(where, exc)


ERRORS = InternalErrors(FIX_ID, _on_error)


shadows: weakref.WeakSet[Shadow] = weakref.WeakSet()
"""The tracked sender caches: attached on whichever thread first uses one, read on the
event loop; changed and copied under ``_shadows_lock`` only (:func:`live_shadows`)."""
_shadows_lock = threading.Lock()


def add_shadow(shadow: Shadow) -> None:
    with _shadows_lock:
        shadows.add(shadow)


def discard_shadow(shadow: Shadow) -> None:
    with _shadows_lock:
        shadows.discard(shadow)


def live_shadows() -> list[Shadow]:
    """A copy of the tracked shadows (iterating the set itself races with attaching)."""
    with _shadows_lock:
        return list(shadows)


def clear_shadows() -> None:
    with _shadows_lock:
        shadows.clear()
