"""Named events one fix sends and another receives, without knowing each other.

The engine liveness check tells the metrics what it saw (an engine answered, a ``/health``
failed because of an engine) and tells the metrics and the stall sentinel where they are (an API
server, an EngineCore) by sending a signal; the receivers connect to the signals they need.
A receiver's exception never reaches the sender: it is the receiver's own internal error
(each receiver guards itself), and a receiver that still raises is skipped.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

Receiver = Callable[..., None]


class Signal:
    __slots__ = ("name", "_receivers", "_lock")

    def __init__(self, name: str) -> None:
        self.name = name
        self._receivers: tuple[Receiver, ...] = ()
        self._lock = threading.Lock()

    def connect(self, receiver: Receiver) -> None:
        with self._lock:
            if receiver not in self._receivers:
                self._receivers = (*self._receivers, receiver)

    def disconnect(self, receiver: Receiver) -> None:
        with self._lock:
            self._receivers = tuple(r for r in self._receivers if r != receiver)

    @property
    def receivers(self) -> tuple[Receiver, ...]:
        return self._receivers

    def send(self, *args: Any) -> None:
        for receiver in self._receivers:
            try:
                receiver(*args)
            except Exception:
                pass

    def __repr__(self) -> str:
        return f"Signal({self.name!r})"


API_SERVER_SERVING = Signal("api-server-serving")
"""This process is an API server (no arguments): an ``AsyncLLM`` talks to EngineCore processes
from a running event loop, and the engine heartbeat started. Sent once per engine client; the
metrics and the stall sentinel start here (never in a user's ``LLM(...)`` script or a
launcher, which build no such client)."""
ENGINE_CORE_RUNNING = Signal("engine-core-running")
"""This process runs an EngineCore busy loop (no arguments): vLLM's ``EngineCoreProc`` entered
its loop, in whatever process model (spawned, forked, Ray actor). The stall sentinel starts
here."""
ENGINE_ANSWERED = Signal("engine-answered")
"""``(engine name, round-trip seconds)``: an EngineCore answered a heartbeat ping."""
ENGINE_HEALTH_FAILED = Signal("engine-health-failed")
"""``(engine name,)``: a ``/health`` check failed because this EngineCore is stuck."""
