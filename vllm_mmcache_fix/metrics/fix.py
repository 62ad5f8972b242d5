"""Lifecycle of the metrics: start the exporter once this process serves.

It starts when the API server attaches ``/metrics`` (the watched import), or when the engine
heartbeat tells it this process is an API server (``signals.API_SERVER_SERVING``), whichever
comes first; never in a process that serves nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..core import signals
from ..core.declaration import Declaration
from ..core.lifecycle import DidNotEnable, Fix
from ..core.settings import Mode, read_mode
from ..vllm_layout import METRICS_ROUTE_MODULES
from .exporter import Exporter


class PluginMetrics(Fix):
    id = "plugin-metrics"
    runs_in = "API server"
    watches = METRICS_ROUTE_MODULES

    def __init__(
        self,
        local: Callable[[], Mapping[str, Any]],
        engines: Callable[[], list[Mapping[str, Any]] | None],
        ages: Callable[[], Mapping[str, float] | None] = lambda: None,
        declarations: Sequence[Declaration] | None = None,
        progress: Callable[[], list[Mapping[str, Any]] | None] = lambda: None,
    ) -> None:
        super().__init__()
        self.exporter = Exporter(local, engines, self._sync_failed, ages, declarations, progress)
        self._site = self.errors.site("metrics.start")
        self._sync_site = self.errors.site("metrics.sync")  # recorded by _sync_failed
        self._reset()

    def _reset(self) -> None:
        self.switched_off: str | None = None

    def _install(self) -> None:
        if read_mode().value == Mode.OFF:
            raise DidNotEnable("disabled by MMCACHE_FIX_MODE=off")
        signals.API_SERVER_SERVING.connect(self.start)
        signals.ENGINE_ANSWERED.connect(self.observe_round_trip)
        signals.ENGINE_HEALTH_FAILED.connect(self.health_check_failed)

    def _uninstall(self) -> None:
        signals.API_SERVER_SERVING.disconnect(self.start)
        signals.ENGINE_ANSWERED.disconnect(self.observe_round_trip)
        signals.ENGINE_HEALTH_FAILED.disconnect(self.health_check_failed)
        self.exporter.unregister()

    def _status(self) -> dict[str, Any]:
        return {
            "started": self.exporter.started,
            "multiprocess": self.exporter.multiprocess,
            "switched_off": self.switched_off,
            "failed_syncs": self.exporter.failed_syncs,
            "last_failed_sync": self.exporter.last_failure,
        }

    def _on_import(self, name: str) -> bool:
        self.start()
        return True

    def start(self) -> None:
        """Create the metrics in this (serving) process; idempotent, never raises."""
        if not self.attempted:
            return
        if self.exporter.started or self.switched_off is not None:
            return
        with self._site:
            self.exporter.start()

    def observe_round_trip(self, engine: str, seconds: float) -> None:
        with self._site:
            self.exporter.observe_round_trip(engine, seconds)

    def health_check_failed(self, engine: str) -> None:
        with self._site:
            self.exporter.health_check_failed(engine)

    def _sync_failed(self, exc: BaseException) -> None:
        """The exporter gave up after a long run of failed syncs (a persistent error)."""
        self.errors.record(self._sync_site.name, exc)

    def _on_internal_error(self, where: str, exc: BaseException) -> None:
        self.switched_off = f"internal error at {where}: {exc!r}"
        self.exporter.stop()
