"""The one owner of import hooks: run callbacks right after modules import.

vLLM loads general plugins after ``vllm.multimodal.cache`` is imported in the
processes seen so far, but a plugin must not rely on import order, nor import
a heavy module itself (the plugin also runs for ``vllm serve --help``). When
a target is not imported yet, its fix subscribes here and patches it the
moment it is. Every fix shares one finder in ``sys.meta_path``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any

Callback = Callable[[str], None]


class _NotifyingLoader(importlib.abc.Loader):
    """Delegates to the real loader and reports when the module is executed."""

    def __init__(self, loader: Any, callback: Callback) -> None:
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


class _Subscription:
    __slots__ = ("names", "callback")

    def __init__(self, names: Iterable[str], callback: Callback) -> None:
        self.names = frozenset(names)
        self.callback = callback


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """The package's one entry in ``sys.meta_path``; fans out to subscriptions."""

    def __init__(self) -> None:
        self._local = threading.local()

    def find_spec(
        self, fullname: str, path: Any = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _watched() or getattr(self._local, "busy", False):
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
        spec.loader = _NotifyingLoader(spec.loader, _notify)
        return spec


_lock = threading.RLock()
_subscriptions: list[_Subscription] = []
_finder = _PostImportFinder()


def _watched() -> frozenset[str]:
    with _lock:
        return frozenset().union(*(s.names for s in _subscriptions))


def _notify(name: str) -> None:
    with _lock:
        targets = [s.callback for s in _subscriptions if name in s.names]
    for callback in targets:
        callback(name)


def when_imported(names: Iterable[str], callback: Callback) -> _Subscription:
    """Call ``callback(name)`` after any of ``names`` is imported from now on."""
    sub = _Subscription(names, callback)
    with _lock:
        _subscriptions.append(sub)
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)
    return sub


def cancel(sub: _Subscription | None) -> None:
    if sub is None:
        return
    with _lock:
        if sub in _subscriptions:
            _subscriptions.remove(sub)
        if not _subscriptions and _finder in sys.meta_path:
            sys.meta_path.remove(_finder)


def cancel_all() -> None:
    with _lock:
        for sub in list(_subscriptions):
            cancel(sub)


def active() -> list[_Subscription]:
    """Subscriptions still waiting (empty once every target was patched)."""
    with _lock:
        return list(_subscriptions) if _finder in sys.meta_path else []
