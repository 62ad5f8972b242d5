"""Locks the ping's answer takes, made new in a forked child.

A forked EngineCore (``fork`` start method: GPU and Ascend images, ``LLM(...)`` scripts)
inherits every lock of the API server in the state it had at the fork. A lock held then by
one of the parent's threads (the stall sentinel counting a stall, the event loop's drift
guard, another fix patching) is held forever in the child, where that thread does not
exist: the child's first ping answer would block on it and the engine would look silent.
So, after a fork, the child replaces the locks made at import that the answer path and the
adoption of the engine take (the counters, the signals, the registry of patches, the import
hooks, each fix's own). What they guarded is plain counters and tables: at worst one count
is lost, never a thread blocked. Only modules already imported are touched. (The cache
counters, ``lru_eviction.stats``, start over in the child by themselves: the caches they
tracked are the parent's.)
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

_LOCK = type(threading.Lock())
_RLOCK = type(threading.RLock())
_registered = False


def _renew(owner: Any, attr: str) -> None:
    lock = getattr(owner, attr, None)
    if isinstance(lock, _RLOCK):
        setattr(owner, attr, threading.RLock())
    elif isinstance(lock, _LOCK):
        setattr(owner, attr, threading.Lock())


def lock_owners() -> list[tuple[Any, str]]:
    """``(object, attribute)`` of every lock made at import that the answer path takes."""
    package = __name__.rsplit(".", 2)[0]
    owners: list[tuple[Any, str]] = []
    for name, attr in (
        ("core.counters", "_lock"),
        ("core.registry", "_lock"),
        ("core.imports", "_lock"),
    ):
        module = sys.modules.get(f"{package}.{name}")
        if module is not None:
            owners.append((module, attr))
    stats = getattr(sys.modules.get(f"{package}.lru_eviction.cache"), "STATS", None)
    if stats is not None:
        owners.append((stats, "_lock"))
    guard = getattr(sys.modules.get(f"{package}.drift_guard"), "GUARD", None)
    drift_stats = getattr(getattr(guard, "state", None), "stats", None)
    if drift_stats is not None:
        owners.append((drift_stats, "_lock"))
    signals = sys.modules.get(f"{package}.core.signals")
    if signals is not None:
        kind = getattr(signals, "Signal", None)
        for value in list(vars(signals).values()):
            if isinstance(kind, type) and isinstance(value, kind):
                owners.append((value, "_lock"))
    plugin = sys.modules.get(f"{package}.plugin")
    # Only the fixes built here: ``plugin.FIXES`` would build (import) the others in the child.
    built = getattr(plugin, "built_fixes", None)
    for fix in built() if callable(built) else ():
        owners.append((fix, "lock"))
        errors = getattr(fix, "errors", None)
        if errors is not None:
            owners.append((errors, "_lock"))
            owners.append((getattr(errors, "_limiter", None), "_lock"))
    return owners


SITE = "engine_liveness.fork"
"""The answer fix's guarded site where a failed renewal is counted (in the child)."""
ANSWER_FIX_ID = "engine-liveness-answer"


def renew_locks_in_child() -> None:
    """``os.register_at_fork(after_in_child=...)``: never raises (a fork must go on)."""
    try:
        for owner, attr in lock_owners():
            if owner is not None:
                _renew(owner, attr)
    except Exception as exc:  # noqa: BLE001 - nothing may stop the child
        _count_in_child(exc)


def _count_in_child(exc: BaseException) -> None:
    """The renewal broke half-way: the error books' own locks are made new first (each on
    its own), then the answer fix counts and logs the error once; the child goes on."""
    try:
        plugin = sys.modules.get(f"{__name__.rsplit('.', 2)[0]}.plugin")
        built = getattr(plugin, "built_fixes", None)
        fixes = built() if callable(built) else ()
        for fix in fixes:
            errors = getattr(fix, "errors", None)
            for owner in (errors, getattr(errors, "_limiter", None)):
                try:
                    _renew(owner, "_lock")
                except Exception:  # noqa: BLE001
                    pass
        for fix in fixes:
            if getattr(fix, "id", None) == ANSWER_FIX_ID:
                fix.errors.record(SITE, exc)
    except Exception:  # noqa: BLE001 - the child keeps the locks it has
        pass


def register() -> None:
    """Renew the locks in every forked child of this process (once per process)."""
    global _registered
    if not _registered and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=renew_locks_in_child)
        _registered = True
