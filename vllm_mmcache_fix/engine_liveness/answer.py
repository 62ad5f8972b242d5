"""Adds ``EngineCore.mmcache_fix_ping`` in EngineCore's process (``vllm_layout.ENGINE_CORE_CLASS``).

vLLM runs a utility call by looking the method up by name on the EngineCore object, so
a plain method on the class is all the round trip needs. It does no more than read a
few counters: it runs in EngineCore's busy loop, between two engine steps.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

from ..core import log, registry
from ..core.lifecycle import DidNotEnable, Fix
from ..core.process import process_label, process_name
from ..core.settings import Mode, read_mode
from ..vllm_layout import ENGINE_CORE_CLASS, ENGINE_CORE_PROCESS, ENGINE_PING_METHOD

PATCH_ID = "engine-liveness-answer"
ANSWER_SCHEMA = 1

Counts = Callable[[], "dict[str, int]"]


class EngineLivenessAnswer(Fix):
    id = "engine-liveness-answer"
    runs_in = "EngineCore"
    watches = (ENGINE_CORE_CLASS.module,)

    def __init__(self, counts: Counts) -> None:
        super().__init__()
        self.counts = counts
        self.target: str | None = None
        self.answers = 0
        self._site = self.errors.site("engine_liveness.answer")

    def _install(self) -> None:
        if read_mode().value is Mode.OFF:
            raise DidNotEnable("disabled by MMCACHE_FIX_MODE=off")
        if not process_name().startswith(ENGINE_CORE_PROCESS):
            raise DidNotEnable(f"not an {ENGINE_CORE_PROCESS} process")

    def _uninstall(self) -> None:
        registry.revert_patch(PATCH_ID)
        self.target = None
        self.answers = 0

    def _status(self) -> dict[str, Any]:
        return {"target": self.target, "answers": self.answers}

    def _on_import(self, name: str) -> bool:
        return self._patch()

    @staticmethod
    def _engine_core_class() -> type | None:
        module = sys.modules.get(ENGINE_CORE_CLASS.module)
        cls = getattr(module, ENGINE_CORE_CLASS.cls, None)
        return cls if isinstance(cls, type) else None

    def _patch(self) -> bool:
        cls = self._engine_core_class()
        if cls is None:
            return False
        if ENGINE_PING_METHOD in cls.__dict__ and not registry.is_patched(cls, ENGINE_PING_METHOD):
            self.note_problem(f"{cls.__qualname__} already has {ENGINE_PING_METHOD}; left alone")
            return True
        registry.apply(PATCH_ID, cls, ENGINE_PING_METHOD, make_answer(self))
        self.target = f"{cls.__module__}.{cls.__qualname__}.{ENGINE_PING_METHOD}"
        log.debug("engine liveness answer in place in %s: %s", process_label(), self.target)
        return True

    def answer(self) -> dict[str, Any]:
        """What EngineCore sends back: its pid and its counters (counters left out on error)."""
        reply: dict[str, Any] = {"schema": ANSWER_SCHEMA, "pid": os.getpid()}
        with self._site:
            self.answers += 1
            reply["counts"] = dict(self.counts())
        return reply


def make_answer(fix: EngineLivenessAnswer) -> Callable[[Any], dict[str, Any]]:
    def mmcache_fix_ping(self: Any) -> dict[str, Any]:
        return fix.answer()

    return mmcache_fix_ping
