"""Lifecycle of the engine liveness check: wrap ``AsyncLLM.check_health`` in the API server.

vLLM's own check runs first and unchanged (it raises once EngineCore is dead). Then,
in a guarded block, the plugin's round trip (:mod:`.probe`); when an engine has not
answered within the timeout, the wrapper raises a subclass of vLLM's
``EngineDeadError``, which vLLM's ``/health`` handler answers with 503.
"""

from __future__ import annotations

import sys
from typing import Any

from ..core import log, registry, signals
from ..core.lifecycle import DidNotEnable, Fix
from ..core.process import process_label
from ..core.settings import Mode, read_health_timeout, read_mode
from ..vllm_layout import ENGINE_CLIENT_ATTR, ENGINE_DEAD_ERROR, HEALTH_METHOD, HEALTH_TARGET
from .probe import Liveness

PATCH_ID = "engine-liveness-health"


class EngineHealth(Fix):
    id = "engine-liveness-health"
    runs_in = "API server"
    watches = (HEALTH_TARGET.module,)

    def __init__(self) -> None:
        super().__init__()
        self.timeout: float | None = None
        self.liveness: Liveness | None = None
        self.target: str | None = None
        self.switched_off: str | None = None
        self._error_classes: dict[type, type] = {}
        self._site = self.errors.site("engine_health.round_trip")

    # -- lifecycle -----------------------------------------------------------------

    def _install(self) -> None:
        if read_mode().value is Mode.OFF:
            raise DidNotEnable("disabled by MMCACHE_FIX_MODE=off")
        setting = read_health_timeout()
        if setting.problem and self.note_problem(setting.problem):
            log.warning("%s", setting.problem)
        self.timeout = setting.value
        if setting.value == 0:
            raise DidNotEnable("disabled by MMCACHE_FIX_HEALTH_TIMEOUT=0")
        self.liveness = Liveness(
            setting.value,
            on_round_trip=signals.ENGINE_ANSWERED.send,
            on_failure=signals.ENGINE_NOT_ANSWERING.send,
        )
        self.errors.reload_faults()

    def _uninstall(self) -> None:
        registry.revert_patch(PATCH_ID)
        self.timeout = None
        self.liveness = None
        self.target = None
        self.switched_off = None

    def _status(self) -> dict[str, Any]:
        return {
            "timeout_s": self.timeout,
            "target": self.target,
            "switched_off": self.switched_off,
            "engines": self.liveness.status() if self.liveness else [],
        }

    def _on_internal_error(self, where: str, exc: BaseException) -> None:
        self.switched_off = f"internal error at {where}: {exc!r}"
        self.note_problem(f"switched off after an internal error at {where}: {exc!r}")

    def _on_import(self, name: str) -> bool:
        module = sys.modules.get(HEALTH_TARGET.module)
        cls = getattr(module, HEALTH_TARGET.cls, None)
        original = cls.__dict__.get(HEALTH_METHOD) if isinstance(cls, type) else None
        if not isinstance(cls, type) or original is None or not callable(original):
            where = f"{HEALTH_TARGET.module}.{HEALTH_TARGET.cls}.{HEALTH_METHOD}"
            self.note_problem(f"{where} not found")
            return True
        registry.wrap(
            PATCH_ID, cls, HEALTH_METHOD, lambda vllm_check: wrap_check_health(self, vllm_check)
        )
        self.target = f"{cls.__module__}.{cls.__qualname__}.{HEALTH_METHOD}"
        log.info(
            "engine liveness on /health in %s: %s also waits up to %gs for every EngineCore "
            "to answer a round trip",
            process_label(),
            self.target,
            self.timeout,
        )
        return True

    # -- the check -----------------------------------------------------------------

    async def round_trip(self, engine: Any) -> str | None:
        """None when every EngineCore answered in time (or the check does not apply)."""
        liveness = self.liveness
        if liveness is None or self.switched_off is not None:
            return None
        client = getattr(engine, ENGINE_CLIENT_ATTR, None)
        if not liveness.usable(client):
            return None  # in-process engine: nothing to ask
        signals.ENGINE_CHECK_STARTING.send()
        return await liveness.check(client)

    def error(self, text: str) -> BaseException:
        """vLLM's ``EngineDeadError`` (a subclass saying why), or a RuntimeError without it."""
        module = sys.modules.get(ENGINE_DEAD_ERROR[0])
        base = getattr(module, ENGINE_DEAD_ERROR[1], None)
        if not (isinstance(base, type) and issubclass(base, Exception)):
            return RuntimeError(text)
        cls = self._error_classes.get(base)
        if cls is None:
            cls = self._error_classes[base] = _not_answering_class(base)
        return cls(text)  # type: ignore[no-any-return,unused-ignore]


def _not_answering_class(base: type) -> type:
    class EngineNotAnswering(base):  # type: ignore[valid-type,misc,unused-ignore]
        """EngineCore left the plugin's liveness round trip unanswered past the timeout."""

        def __init__(self, message: str) -> None:
            Exception.__init__(self, message)
            self.__suppress_context__ = True

    EngineNotAnswering.__module__ = __name__
    return EngineNotAnswering


def wrap_check_health(fix: EngineHealth, original: Any) -> Any:
    async def check_health(self: Any, *args: Any, **kwargs: Any) -> None:
        await original(self, *args, **kwargs)
        failure: str | None = None
        with fix._site:
            failure = await fix.round_trip(self)
        if failure is not None:
            raise fix.error(failure)

    return check_health
