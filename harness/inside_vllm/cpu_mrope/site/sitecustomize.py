"""Give vLLM 0.10.x's ``MRotaryEmbedding`` the ``forward_cpu`` of 0.11.0.

See harness.inside_vllm.cpu_mrope."""

from __future__ import annotations

import importlib.abc
import sys
from types import ModuleType
from typing import Any

TARGET = "vllm.model_executor.layers.rotary_embedding.mrope"


def _give_forward_cpu(module: ModuleType) -> None:
    cls = getattr(module, "MRotaryEmbedding", None)
    if cls is not None and "forward_cpu" not in vars(cls) and hasattr(cls, "forward_native"):
        cls.forward_cpu = cls.forward_native
        print(
            "[harness] MRotaryEmbedding.forward_cpu = forward_native (as vLLM 0.11.0 has it)",
            file=sys.stderr,
            flush=True,
        )


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                break
        else:
            return None
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_then_fix(module: ModuleType) -> None:
            exec_module(module)
            _give_forward_cpu(module)

        loader.exec_module = exec_then_fix  # type: ignore[method-assign]
        return spec


if TARGET in sys.modules:
    _give_forward_cpu(sys.modules[TARGET])
else:
    sys.meta_path.insert(0, _Finder())
