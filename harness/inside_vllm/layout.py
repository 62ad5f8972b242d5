"""vLLM's classes as ``vllm_mmcache_fix/vllm_layout.py`` places them, for code run in a venv.

The checks under ``harness/inside_vllm`` import vLLM's real classes; they find them through
the plugin's layout table (candidates newest first, by feature detection), so a release
that moves a class is one edit of ``vllm_layout.py`` for the plugin and its checks alike.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence

from vllm_mmcache_fix import vllm_layout as lay


def find_class(candidates: Sequence[lay.ClassLayout]) -> type:
    """The first candidate whose module imports and defines the class."""
    for candidate in candidates:
        try:
            module = importlib.import_module(candidate.module)
        except ImportError:
            continue
        cls = getattr(module, candidate.cls, None)
        if isinstance(cls, type):
            return cls
    names = ", ".join(f"{c.module}.{c.cls}" for c in candidates)
    raise LookupError(f"none of {names} in this vLLM")


def drift_class(target: str) -> type:
    """The class the drift guard patches as ``target`` ("sender", "processor", ...)."""
    for entry in lay.DRIFT_TARGETS:
        if entry.name == target:
            return find_class(entry.candidates)
    raise KeyError(f"no drift target {target!r} in vllm_layout.DRIFT_TARGETS")
