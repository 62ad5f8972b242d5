"""The one owner of import hooks: run callbacks when modules are imported.

vLLM loads general plugins after ``vllm.multimodal.cache`` is imported in the
processes seen so far, but a plugin must not rely on import order, nor import
a heavy module itself (the plugin also runs for ``vllm serve --help``). A fix
subscribes to the modules it patches; as with wrapt's post-import hooks, the
callback runs at once for a module already imported and right after the
import for the others, until it answers True ("done"). So no caller writes
"try now, else subscribe". Every fix shares one finder in ``sys.meta_path``.
"""

from __future__ import annotations

import os
import sys
import threading

TYPE_CHECKING = False  # as typing's, without importing typing in every vLLM process
if TYPE_CHECKING:
    import importlib.machinery
    from collections.abc import Callable, Iterable
    from types import ModuleType
    from typing import Any

    Callback = Callable[[str], bool]
    """``callback(module_name)``: True when the subscriber needs no further imports."""


class _NotifyingLoader:
    """Delegates to the real loader and reports when the module is executed.

    The import system asks a loader for ``create_module`` and ``exec_module`` only (no
    ``importlib.abc`` base: importing it costs more than everything else here)."""

    def __init__(self, loader: Any, callback: Callable[[str], None]) -> None:
        self._loader = loader
        self._callback = callback

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        # Loaders such as SourceFileLoader serve get_data() etc. to tools that
        # read module.__loader__; give them the real one back (hooks may nest).
        real = self._loader
        while isinstance(real, _NotifyingLoader):
            real = real._loader
        module.__loader__ = real
        if module.__spec__ is not None:
            module.__spec__.loader = real
        self._callback(module.__name__)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class Subscription:
    __slots__ = ("names", "callback", "done")

    def __init__(self, names: Iterable[str], callback: Callback) -> None:
        self.names = frozenset(names)
        self.callback = callback
        self.done = False


class _PostImportFinder:
    """The package's one entry in ``sys.meta_path``; fans out to subscriptions."""

    def __init__(self) -> None:
        self._local = threading.local()

    def find_spec(
        self, fullname: str, path: Any = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _watched or getattr(self._local, "busy", False):
            return None
        self._local.busy = True
        try:
            spec = None
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
        finally:
            self._local.busy = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        spec.loader = _NotifyingLoader(spec.loader, _notify)  # type: ignore[assignment]
        return spec


_lock = threading.RLock()


def _renew_lock() -> None:
    """A forked child gets a fresh lock: one held by another thread at the fork stays held
    (vLLM forks EngineCore and workers while other threads may be importing)."""
    global _lock
    _lock = threading.RLock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_renew_lock)
_subscriptions: list[Subscription] = []
_finder = _PostImportFinder()
_watched: frozenset[str] = frozenset()
"""Every subscription's names, rebuilt when one comes or goes: the finder is asked about
every import of the process and reads it without the lock."""


def _update_watched() -> None:
    global _watched
    _watched = frozenset().union(*(s.names for s in _subscriptions))


def _notify(name: str) -> None:
    with _lock:
        targets = [s for s in _subscriptions if name in s.names]
    for sub in targets:
        _deliver(sub, name)


def _deliver(sub: Subscription, name: str) -> None:
    if sub.done:
        return
    if sub.callback(name):
        sub.done = True
        cancel(sub)


def when_imported(names: Iterable[str], callback: Callback) -> Subscription:
    """Call ``callback(name)`` for each of ``names`` already imported (in the order
    given), then after each of them is imported, until it returns True."""
    ordered = list(dict.fromkeys(names))
    sub = Subscription(ordered, callback)
    with _lock:
        _subscriptions.append(sub)
        _update_watched()
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)
    for name in ordered:
        if sub.done:
            break
        if name in sys.modules:
            _deliver(sub, name)
    return sub


def cancel(sub: Subscription | None) -> None:
    if sub is None:
        return
    sub.done = True
    with _lock:
        if sub in _subscriptions:
            _subscriptions.remove(sub)
            _update_watched()
        if not _subscriptions and _finder in sys.meta_path:
            sys.meta_path.remove(_finder)


def cancel_all() -> None:
    with _lock:
        for sub in list(_subscriptions):
            cancel(sub)


def active() -> list[Subscription]:
    """Subscriptions still waiting (empty once every target was patched)."""
    with _lock:
        return [s for s in _subscriptions if not s.done] if _finder in sys.meta_path else []
