"""Run a callback right after a given module finishes importing.

vLLM loads general plugins after ``vllm.multimodal.cache`` is imported in the
processes seen so far, but a plugin must not rely on import order, nor import
a heavy module itself (the plugin also runs for ``vllm serve --help``). When
the target is not imported yet, this hook patches it the moment it is.
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


class PostImportHook(importlib.abc.MetaPathFinder):
    def __init__(self, names: Iterable[str], callback: Callback) -> None:
        self.names = frozenset(names)
        self.callback = callback
        self._local = threading.local()

    def find_spec(
        self, fullname: str, path: Any = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.names or getattr(self._local, "busy", False):
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
        spec.loader = _NotifyingLoader(spec.loader, self.callback)
        return spec


_hooks: list[PostImportHook] = []


def when_imported(names: Iterable[str], callback: Callback) -> PostImportHook:
    """Call ``callback(name)`` after any of ``names`` is imported from now on."""
    hook = PostImportHook(names, callback)
    sys.meta_path.insert(0, hook)
    _hooks.append(hook)
    return hook


def remove_hook(hook: PostImportHook) -> None:
    if hook in sys.meta_path:
        sys.meta_path.remove(hook)
    if hook in _hooks:
        _hooks.remove(hook)


def remove_hooks() -> None:
    for hook in list(_hooks):
        remove_hook(hook)


def active_hooks() -> list[PostImportHook]:
    return [hook for hook in _hooks if hook in sys.meta_path]
