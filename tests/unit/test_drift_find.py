"""The drift guard's class lookup while a target module is still being imported."""

from __future__ import annotations

import importlib.machinery
import sys
import types

from vllm_mmcache_fix.drift_guard.fix import find
from vllm_mmcache_fix.vllm_layout import ClassLayout, DriftTarget

MODULE = "mmcache_fix_test_fake.async_llm"
TARGET = DriftTarget("generate", (ClassLayout(MODULE, "AsyncLLM", "test"),), ("generate",))


def _module(initializing: bool) -> types.ModuleType:
    mod = types.ModuleType(MODULE)
    mod.__spec__ = importlib.machinery.ModuleSpec(MODULE, None)
    mod.__spec__._initializing = initializing  # type: ignore[attr-defined]
    return mod


def test_a_module_half_imported_is_neither_found_nor_reported() -> None:
    mod = _module(initializing=True)
    sys.modules[MODULE] = mod
    try:
        assert find(TARGET) == (None, None)

        class AsyncLLM:
            def generate(self) -> None: ...

        AsyncLLM.__module__ = MODULE
        mod.AsyncLLM = AsyncLLM  # type: ignore[attr-defined]
        # The end of its import (the loader still running) finds the class.
        assert find(TARGET) == (AsyncLLM, None)
    finally:
        del sys.modules[MODULE]


def test_a_module_fully_imported_without_the_class_is_reported() -> None:
    sys.modules[MODULE] = _module(initializing=False)
    try:
        cls, reason = find(TARGET)
        assert cls is None and reason and "no class AsyncLLM" in reason
    finally:
        del sys.modules[MODULE]
