"""Fail-open: the plugin's own work inside a vLLM call can never fail the call.

Each place where a fix does bookkeeping around a vLLM call is a :class:`Site`.
Its ``with`` block holds the plugin's work only, never vLLM's call. When that
work raises, the exception stops at the block: it is counted, logged once per
site with its traceback (and rate-limited after that), the fix is told so it
switches the affected tracking off for good, and the wrapper goes on with
vLLM's own call and result as if the plugin were absent.

``MMCACHE_FIX_FAIL_AT=site,site`` (or ``*``) makes the named sites fail as
their block ends, as if the plugin's work had raised there: the
fault-injection tests use it on real servers. A wrapper therefore never uses
what a block computed without checking that its tracking is still on.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import TracebackType

from . import log
from .messages import INTERNAL_ERROR
from .settings import read_fail_at

LOG_INTERVAL_S = 60.0


class InjectedFault(RuntimeError):
    """Raised inside a guarded block on purpose (``MMCACHE_FIX_FAIL_AT``)."""


class InternalErrors:
    """The internal errors of one fix: counts per site, one log line per site."""

    def __init__(self, fix_id: str, on_error: Callable[[str, BaseException], None]) -> None:
        self.fix_id = fix_id
        self.on_error = on_error
        self.counts: dict[str, int] = {}
        self.sites: dict[str, Site] = {}
        self._lock = threading.Lock()
        self._limiter = log.RateLimiter(LOG_INTERVAL_S)
        self._fail_at = read_fail_at()

    def site(self, name: str) -> Site:
        with self._lock:
            site = self.sites.get(name)
            if site is None:
                site = self.sites[name] = Site(self, name)
            return site

    def reset(self) -> None:
        """As built: no errors counted, the injected faults read again (the sites stay)."""
        with self._lock:
            self.counts.clear()
        self.reload_faults()

    def reload_faults(self, fail_at: frozenset[str] | None = None) -> None:
        self._fail_at = read_fail_at() if fail_at is None else fail_at
        for site in self.sites.values():
            site.fail = self._fails(site.name)

    def _fails(self, name: str) -> bool:
        return "*" in self._fail_at or name in self._fail_at

    @property
    def total(self) -> int:
        with self._lock:  # record() may add a site meanwhile (another thread)
            return sum(self.counts.values())

    def record(self, where: str, exc: BaseException) -> None:
        try:
            with self._lock:
                first = where not in self.counts
                self.counts[where] = self.counts.get(where, 0) + 1
            may_log, held = self._limiter.ready()
            if first or may_log:
                log.exception(
                    "%s in %s (%s): %r; this part of the plugin is switched off in this "
                    "process, vLLM goes on as without it%s",
                    exc,
                    INTERNAL_ERROR,
                    self.fix_id,
                    where,
                    exc,
                    f"; {held} more internal errors since the last line" if held else "",
                )
        except Exception:
            pass
        try:
            self.on_error(where, exc)
        except Exception:
            pass


class Site:
    """``with site:`` around the plugin's own work; swallows and records its errors."""

    __slots__ = ("errors", "name", "fail")

    def __init__(self, errors: InternalErrors, name: str) -> None:
        self.errors = errors
        self.name = name
        self.fail = errors._fails(name)

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        if exc is None:
            if self.fail:
                self.errors.record(self.name, InjectedFault(f"fault injected at {self.name}"))
            return False
        if not isinstance(exc, Exception):
            return False  # KeyboardInterrupt, SystemExit, GeneratorExit: not ours to stop
        self.errors.record(self.name, exc)
        return True
