"""The lifecycle every fix shares: ``id``, ``install``, ``uninstall``, ``status``.

A fix subclasses :class:`Fix` and writes only ``_install`` (settings, "does this
apply here"), ``_uninstall`` (undo its patches, stop its threads), ``_reset`` (its own
state as built; called from its ``__init__`` too), ``_status`` and, when it patches vLLM
modules, the modules it ``watches`` and ``_on_import`` ("try to patch"). The public methods do the
bookkeeping: repeat calls are no-ops, ``install`` never raises, "does not apply here"
(:class:`DidNotEnable`) is kept apart from "broke" (an exception), the waiting for
imports is the base class's (``core/imports``), ``uninstall`` resets under the one lock
the fix keeps for its life (a fix never rebuilds itself: a new ``lock`` would let another
thread in while ``uninstall`` holds the old one), and ``status`` returns a copy with a
schema version.
"""

from __future__ import annotations

import threading
from typing import Any, ClassVar

from . import imports, log
from .guard import InternalErrors
from .messages import INTERNAL_ERROR

STATUS_SCHEMA = 1


class DidNotEnable(Exception):
    """The fix does not apply in this process; the message says why (one sentence)."""


class Fix:
    id: ClassVar[str]
    runs_in: ClassVar[str]
    """Where the fix acts: ``"every process"``, ``"API server"``, ``"EngineCore"``."""
    watches: ClassVar[tuple[str, ...]] = ()
    """Modules whose import may make the fix's targets available; ``_on_import`` is
    called for each, at once when already imported, until it returns True."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.attempted = False
        self.enabled = False
        self.not_enabled_reason: str | None = None
        self.problems: list[str] = []
        self.errors = InternalErrors(self.id, self._on_internal_error)
        self._subscription: imports.Subscription | None = None

    # -- public, shared by every fix ---------------------------------------------

    def install(self) -> None:
        """Apply the fix in this process; idempotent, never raises."""
        try:
            with self.lock:
                if self.attempted:
                    return
                self.attempted = True
                try:
                    self._install()
                except DidNotEnable as exc:
                    self.not_enabled_reason = str(exc)
                    return
                self.enabled = True
                if self.watches:
                    self._subscription = imports.when_imported(self.watches, self._imported)
        except Exception as exc:
            self.note_problem(f"{INTERNAL_ERROR} while installing: {exc!r}")
            try:
                log.warning(
                    "%s: %s while installing, vLLM left as it is: %r", self.id, INTERNAL_ERROR, exc
                )
                imports.cancel(self._subscription)
                self._subscription = None
                self._uninstall()
            except Exception:
                pass

    def uninstall(self) -> None:
        """Undo everything ``install`` did in this process."""
        with self.lock:
            imports.cancel(self._subscription)
            self._subscription = None
            self._uninstall()
            self.attempted = False
            self.enabled = False
            self.not_enabled_reason = None
            self.problems = []
            self.errors.reset()
            self._reset()

    def status(self) -> dict[str, Any]:
        with self.lock:
            data = {
                "schema_version": STATUS_SCHEMA,
                "id": self.id,
                "runs_in": self.runs_in,
                "attempted": self.attempted,
                "enabled": self.enabled,
                "not_enabled_reason": self.not_enabled_reason,
                "problems": list(self.problems),
                "internal_errors": dict(self.errors.counts),
            }
            data.update(self._status())
            return data

    @property
    def waiting_for_import(self) -> bool:
        """Installed, and still waiting for a watched module to be imported."""
        sub = self._subscription
        return sub is not None and not sub.done

    def _imported(self, name: str) -> bool:
        try:
            with self.lock:
                if not self.enabled:
                    return True
                return self._on_import(name)
        except Exception as exc:
            self.note_problem(f"{INTERNAL_ERROR} after importing {name}: {exc!r}")
            try:
                log.warning(
                    "%s: %s after importing %s, vLLM left as it is: %r",
                    self.id,
                    INTERNAL_ERROR,
                    name,
                    exc,
                )
            except Exception:
                pass
            return True

    def note_problem(self, problem: str) -> bool:
        """Keep ``problem`` once; True when it is new."""
        with self.lock:
            if problem in self.problems:
                return False
            self.problems.append(problem)
            return True

    # -- written by each fix -------------------------------------------------------

    def _install(self) -> None:
        raise NotImplementedError

    def _uninstall(self) -> None:
        raise NotImplementedError

    def _reset(self) -> None:
        """Put the fix's own state back as built (``uninstall`` calls it under ``lock``)."""

    def _status(self) -> dict[str, Any]:
        return {}

    def _on_import(self, name: str) -> bool:
        """``name`` (one of ``watches``) is imported: try to patch; True when done."""
        return True

    def _on_internal_error(self, where: str, exc: BaseException) -> None:
        """Switch off what ``where`` tracks; vLLM's own behaviour goes on."""
