"""Lifecycle of the engine liveness check in the API server: the heartbeat and ``/health``.

- ``AsyncLLM.__init__`` (``vllm_layout.HEALTH_TARGET``): once vLLM built the engine client,
  the heartbeat (:mod:`.heartbeat`) starts in the running event loop (``vllm serve`` builds
  it in uvicorn's); a client built outside a loop gets it at its first ``check_health``.
  The first heartbeat tells the metrics and the stall sentinel that this process serves.
- ``AsyncLLM.check_health``: vLLM's own check runs first and unchanged (it raises once
  EngineCore is dead); then, in a guarded block, the heartbeat's verdict is read (never
  awaited): for a stuck engine the wrapper raises a subclass of vLLM's ``EngineDeadError``,
  which vLLM's ``/health`` answers with 503.
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

from ..core import log, registry, signals
from ..core.lifecycle import DidNotEnable, Fix
from ..core.messages import LIVENESS_ACTIVE
from ..core.process import process_label
from ..core.settings import (
    ENV_HEALTH_TIMEOUT,
    Mode,
    read_health_timeout,
    read_mode,
    read_progress_timeout,
    read_step_timeout,
)
from ..vllm_layout import (
    ASYNC_CLIENT_CLASS,
    CLIENT_CALL_UTILITY,
    CLIENT_ENGINE_PARAM,
    CLIENT_OWNER_INIT,
    ENGINE_CLIENT_ATTR,
    ENGINE_DEAD_ERROR,
    HEALTH_METHOD,
    HEALTH_TARGET,
)
from .heartbeat import PING_INTERVAL_S, EngineBeat, Liveness, accepts_engine
from .owns import HEALTH_ID
from .snapshot import (
    KEY_DETAILS,
    KEY_KIND,
    KEY_SCHEMA,
    KEY_VERDICT,
    KIND_VALUE,
    SNAPSHOT_SCHEMA,
    SnapshotWriter,
    describe_request,
    oldest_request,
)

PATCH_ID = HEALTH_ID


class EngineHealth(Fix):
    id = "engine-liveness-health"
    runs_in = "API server"
    watches = (HEALTH_TARGET.module,)

    def __init__(self) -> None:
        super().__init__()
        self._site = self.errors.site("engine_health.check")
        self._beat_site = self.errors.site("engine_health.heartbeat")
        self._snapshot_site = self.errors.site("engine_health.snapshot")
        self._reset()

    def _reset(self) -> None:
        self.timeout: float | None = None
        self.step_timeout: float | None = None
        self.progress_timeout: float | None = None
        self.liveness: Liveness | None = None
        self.targets: list[str] = []
        self.switched_off: str | None = None
        self.serving = False
        self._error_classes: dict[type, type] = {}
        self.snapshots: SnapshotWriter | None = None
        """Writes the stall snapshot at a verdict (None: off, after an internal error)."""

    # -- lifecycle -----------------------------------------------------------------

    def _install(self) -> None:
        if read_mode().value == Mode.OFF:
            raise DidNotEnable("disabled by MMCACHE_FIX_MODE=off")
        setting = read_health_timeout()
        if setting.problem and self.note_problem(setting.problem):
            log.warning("%s", setting.problem)
        self.timeout = setting.value
        self.errors.reload_faults()
        if setting.value == 0:
            # The heartbeat is off (no pings, /health is vLLM's own), but this process is
            # still recognised as an API server: the stall sentinel and the metrics start.
            return
        step = read_step_timeout()
        if step.problem and self.note_problem(step.problem):
            log.warning("%s", step.problem)
        self.step_timeout = max(step.value, setting.value)
        progress = read_progress_timeout()
        if progress.problem and self.note_problem(progress.problem):
            log.warning("%s", progress.problem)
        self.progress_timeout = progress.value
        self.snapshots = SnapshotWriter()
        if self.snapshots.problem and self.note_problem(self.snapshots.problem):
            log.warning("%s", self.snapshots.problem)
        self.liveness = Liveness(
            setting.value,
            step_timeout=self.step_timeout,
            progress_timeout=progress.value,
            on_answer=signals.ENGINE_ANSWERED.send,
            guard=self._beat_site,
            enabled=lambda: self.switched_off is None,
            on_verdict=self.on_verdict,
        )

    def _uninstall(self) -> None:
        liveness = self.liveness
        registry.revert_patch(PATCH_ID)
        if liveness is not None:
            for beat in liveness._all():
                beat.stop("uninstalled")

    def _status(self) -> dict[str, Any]:
        return {
            "heartbeat": self.liveness is not None,
            "timeout_s": self.timeout,
            "step_timeout_s": self.step_timeout,
            "progress_timeout_s": self.progress_timeout,
            "ping_interval_s": PING_INTERVAL_S,
            "targets": list(self.targets),
            "switched_off": self.switched_off,
            "engines": self.liveness.status() if self.liveness else [],
            "snapshots": self._snapshot_status(),
        }

    def _snapshot_status(self) -> dict[str, Any] | None:
        writer = self.snapshots
        if writer is None:
            return None
        return {
            "directory": str(writer.directory),
            "written": writer.written,
            "failed": writer.failed,
            "last": writer.last_path,
        }

    def _on_internal_error(self, where: str, exc: BaseException) -> None:
        if where == self._snapshot_site.name:
            self.snapshots = None  # the verdicts and /health go on without snapshots
            return
        self.switched_off = f"internal error at {where}: {exc!r}"
        self.note_problem(f"switched off after an internal error at {where}: {exc!r}")
        liveness = self.liveness
        if liveness is not None:
            for beat in liveness._all():
                beat.stop("switched off after an internal error")

    def _on_import(self, name: str) -> bool:
        module = sys.modules.get(HEALTH_TARGET.module)
        cls = getattr(module, HEALTH_TARGET.cls, None)
        where = f"{HEALTH_TARGET.module}.{HEALTH_TARGET.cls}"
        if not isinstance(cls, type) or not all(
            callable(cls.__dict__.get(m)) for m in (CLIENT_OWNER_INIT, HEALTH_METHOD)
        ):
            self.note_problem(f"{where}.{HEALTH_METHOD} or {CLIENT_OWNER_INIT} not found")
            return True
        old_client = self._old_client_class()
        if old_client is not None:
            text = (
                f"{old_client}.{CLIENT_CALL_UTILITY} has no {CLIENT_ENGINE_PARAM}= parameter: "
                "the heartbeat cannot ask one engine; /health is vLLM's own"
            )
            if self.note_problem(text):
                log.warning("%s", text)
            return True
        registry.wrap(PATCH_ID, cls, CLIENT_OWNER_INIT, lambda f: wrap_init(self, f))
        registry.wrap(PATCH_ID, cls, HEALTH_METHOD, lambda f: wrap_check_health(self, f))
        self.targets = [
            f"{cls.__module__}.{cls.__qualname__}.{m}" for m in (CLIENT_OWNER_INIT, HEALTH_METHOD)
        ]
        return True

    @staticmethod
    def _old_client_class() -> str | None:
        """vLLM's async client class, named, when its utility call cannot pick one engine."""
        module = sys.modules.get(ASYNC_CLIENT_CLASS.module)
        call = getattr(getattr(module, ASYNC_CLIENT_CLASS.cls, None), CLIENT_CALL_UTILITY, None)
        if call is not None and not accepts_engine(call):
            return f"{ASYNC_CLIENT_CLASS.module}.{ASYNC_CLIENT_CLASS.cls}"
        return None

    # -- the heartbeat and the check -------------------------------------------------

    def attach(self, engine: Any) -> None:
        """Start the heartbeat of ``engine``'s client, when in its running loop (guarded)."""
        liveness = self.liveness
        if self.switched_off is not None:
            return
        if liveness is None:
            self._serving_without_heartbeat(engine)
            return
        with self._site:
            try:
                asyncio.get_running_loop()
            except RuntimeError:
                return  # built outside an event loop: started at the first check_health
            client = getattr(engine, ENGINE_CLIENT_ATTR, None)
            if not liveness.usable(client) or client in liveness.heartbeats:
                return
            if liveness.attach(client) is None:
                return
            if not self.serving:
                self.serving = True
                log.info(
                    "%s %s: a heartbeat pings every EngineCore every %g s; /health answers "
                    "from its state and fails (503) only when an EngineCore's input thread "
                    "leaves pings unanswered for %g s (%s), its busy loop stays inside one "
                    "step for %g s, or it makes no net progress for %g s while requests wait",
                    LIVENESS_ACTIVE,
                    process_label(),
                    PING_INTERVAL_S,
                    self.timeout,
                    ENV_HEALTH_TIMEOUT,
                    self.step_timeout,
                    self.progress_timeout,
                )
        signals.API_SERVER_SERVING.send()

    def _serving_without_heartbeat(self, engine: Any) -> None:
        """``MMCACHE_FIX_HEALTH_TIMEOUT=0``: no heartbeat, but an engine client with engine
        processes in a running loop still makes this an API server (sentinel, metrics)."""
        if self.serving or self.timeout != 0:
            return
        with self._site:
            try:
                asyncio.get_running_loop()
            except RuntimeError:
                return
            if not Liveness.usable(getattr(engine, ENGINE_CLIENT_ATTR, None)):
                return
            self.serving = True
            log.info(
                "engine heartbeat off in %s (%s=0): /health is vLLM's own",
                process_label(),
                ENV_HEALTH_TIMEOUT,
            )
        if self.serving:
            signals.API_SERVER_SERVING.send()

    def verdict(self, engine: Any) -> str | None:
        """Why ``/health`` fails now (None: it does not). Reads state; never waits."""
        liveness = self.liveness
        if liveness is None:
            self.attach(engine)
            return None
        if self.switched_off is not None:
            return None
        self.attach(engine)
        if self.switched_off is not None:
            return None  # attach's own work failed just now (counted once, there)
        client = getattr(engine, ENGINE_CLIENT_ATTR, None)
        beat = liveness.heartbeats.get(client) if liveness.usable(client) else None
        if beat is None:
            return None
        stuck = beat.verdict()
        for engine_beat in stuck:
            engine_beat.failed_checks += 1
            signals.ENGINE_HEALTH_FAILED.send(engine_beat.name)
        return "; ".join(b.stuck or "" for b in stuck) or None

    def on_verdict(self, beat: EngineBeat, kind: str, text: str) -> str:
        """The first verdict of a stall episode: the snapshot file is written off the event
        loop; returns what the WARNING adds (the oldest stuck request, the file)."""
        extra = ""
        with self._snapshot_site:
            details = beat.details
            oldest = oldest_request(details)
            extra = f"; {describe_request(oldest)}"
            writer = self.snapshots
            if writer is None:
                return extra
            when = time.time()
            path = writer.path_for(beat.name, when)
            data: dict[str, Any] = {
                KEY_SCHEMA: SNAPSHOT_SCHEMA,
                KEY_KIND: KIND_VALUE,
                "written_at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(when)),
                "api_server": process_label(),
                "engine": beat.name,
                KEY_VERDICT: {"class": kind, "text": text},
                "oldest_stuck_request": oldest,
                "settings": {
                    "health_timeout_s": self.timeout,
                    "step_timeout_s": self.step_timeout,
                    "progress_timeout_s": self.progress_timeout,
                },
                "last_answer": {
                    "answered_at": beat.answered_wall,
                    "round_trip_s": beat.round_trip_s,
                    "pending_pings": len(beat.pending),
                    "loop": beat.loop,
                    "progress": beat.progress,
                },
                KEY_DETAILS: details,
            }
            writer.write(data, path)
            extra += f"; snapshot: {path}"
        return extra

    def error(self, text: str) -> BaseException:
        """vLLM's ``EngineDeadError`` (a subclass saying why), or a RuntimeError without it."""
        module = sys.modules.get(ENGINE_DEAD_ERROR[0])
        base = getattr(module, ENGINE_DEAD_ERROR[1], None)
        if not (isinstance(base, type) and issubclass(base, Exception)):
            return RuntimeError(text)
        cls = self._error_classes.get(base)
        if cls is None:
            cls = self._error_classes[base] = _stuck_class(base)
        return cls(text)  # type: ignore[no-any-return,unused-ignore]


def _stuck_class(base: type) -> type:
    class EngineStuck(base):  # type: ignore[valid-type,misc,unused-ignore]
        """The plugin's heartbeat found an EngineCore stuck (see the message)."""

        def __init__(self, message: str) -> None:
            Exception.__init__(self, message)
            self.__suppress_context__ = True

    EngineStuck.__module__ = __name__
    return EngineStuck


def wrap_init(fix: EngineHealth, original: Any) -> Any:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        fix.attach(self)

    return __init__


def wrap_check_health(fix: EngineHealth, original: Any) -> Any:
    async def check_health(self: Any, *args: Any, **kwargs: Any) -> None:
        await original(self, *args, **kwargs)
        failure: str | None = None
        with fix._site:
            failure = fix.verdict(self)
        if failure is not None:
            raise fix.error(failure)

    return check_health
