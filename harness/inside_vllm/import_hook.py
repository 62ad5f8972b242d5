"""Run a function on a vLLM module once it is imported, from a site hook.

The site hooks under ``harness/inside_vllm`` (and the topologies' fork hook) are
``sitecustomize.py`` files put on a vLLM server's ``PYTHONPATH``; each changes one vLLM
module right after vLLM imports it. They load this file by its path (the repository root
is not on the server's ``sys.path``), ``runpy.run_path(path)["after_import"]``, and call
:func:`after_import`.
Standard library only.
"""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

Hooks = Mapping[str, Callable[[ModuleType], None]]


class _Finder(importlib.abc.MetaPathFinder):
    """Finds a hooked module with the finders after it and runs its hook after its code."""

    def __init__(self, hooks: Hooks) -> None:
        self.hooks = hooks

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        hook = self.hooks.get(name)
        if hook is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                break
        else:
            return None
        exec_module = spec.loader.exec_module

        def exec_then_hook(module: ModuleType) -> None:
            exec_module(module)
            hook(module)

        spec.loader.exec_module = exec_then_hook  # type: ignore[method-assign]
        return spec


def after_import(hooks: Hooks) -> None:
    """Run each hook on its module: now if it is imported already, else right after import."""
    waiting = {}
    for name, hook in hooks.items():
        if name in sys.modules:
            hook(sys.modules[name])
        else:
            waiting[name] = hook
    if waiting:
        sys.meta_path.insert(0, _Finder(waiting))
