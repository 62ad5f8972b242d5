"""Named events one fix sends and another receives, without knowing each other.

The engine liveness check tells the metrics what it saw (an engine answered, an engine
stopped answering) by sending a signal; the metrics connect to the signals they export.
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


ENGINE_CHECK_STARTING = Signal("engine-check-starting")
"""The API server is about to check its engines (no arguments); the metrics start here
in a process that serves ``/health`` before ``/metrics`` was attached."""
ENGINE_ANSWERED = Signal("engine-answered")
"""``(engine name, round-trip seconds)``: an EngineCore answered the liveness round trip."""
ENGINE_NOT_ANSWERING = Signal("engine-not-answering")
"""``(engine name,)``: a liveness check found an EngineCore past its deadline."""
