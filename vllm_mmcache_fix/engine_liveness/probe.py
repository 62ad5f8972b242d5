"""The round trip to each EngineCore, and what a late or missing answer means.

One utility call per engine is in flight at most: a ``/health`` that comes while the
previous call is still unanswered waits for that same call (never a second message),
so a frozen EngineCore gets one message however often ``/health`` is polled, and each
check waits at most until that call is ``timeout`` seconds old.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..core import log
from ..core.messages import ENGINE_ANSWERS_AGAIN, ENGINE_NOT_ANSWERING
from ..core.process import process_label
from ..vllm_layout import CLIENT_CALL_UTILITY, CLIENT_ENGINES, CLIENT_INDEX, ENGINE_PING_METHOD

CallUtility = Callable[..., Awaitable[Any]]


def engine_name(index: int, count: int) -> str:
    """vLLM's own name of the process: ``EngineCore`` alone, ``EngineCore_DP<N>`` with DP."""
    return "EngineCore" if count == 1 else f"EngineCore_DP{index}"


def _clock(wall: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(wall)) + " UTC"


@dataclass
class EngineProbe:
    name: str
    identity: Any
    task: asyncio.Future[Any] | None = None
    sent_at: float = 0.0
    """``time.monotonic()`` when the call in flight was sent."""
    sent_wall: float = 0.0
    answered_wall: float | None = None
    """When EngineCore last answered (wall clock)."""
    last_round_trip_s: float | None = None
    counts: dict[str, Any] | None = None
    """The counters EngineCore sent with its last answer."""
    error: str | None = None
    """The last call that came back as an error (the engine did answer)."""
    failing: bool = False
    answers: int = 0
    failures: int = 0

    def status(self) -> dict[str, Any]:
        return {
            "engine": self.name,
            "answers": self.answers,
            "failures": self.failures,
            "failing": self.failing,
            "last_round_trip_s": self.last_round_trip_s,
            "answered_at": self.answered_wall,
            "error": self.error,
        }


@dataclass
class Liveness:
    """The probes of every engine client in this process."""

    timeout: float
    on_round_trip: Callable[[str, float], None] = lambda engine, seconds: None
    on_failure: Callable[[str], None] = lambda engine: None
    clients: weakref.WeakKeyDictionary[Any, list[EngineProbe]] = field(
        default_factory=weakref.WeakKeyDictionary
    )

    @staticmethod
    def usable(client: Any) -> bool:
        """Whether ``client`` talks to EngineCore processes through utility calls."""
        return callable(getattr(client, CLIENT_CALL_UTILITY, None)) and isinstance(
            getattr(client, CLIENT_ENGINES, None), Sequence
        )

    def probes(self, client: Any) -> list[EngineProbe]:
        engines = list(getattr(client, CLIENT_ENGINES))
        probes = self.clients.get(client)
        if probes is None or [p.identity for p in probes] != engines:
            # First call, or the engines changed (elastic DP): keep the probes still valid.
            old = {p.identity: p for p in probes or ()}
            probes = [
                old.get(e) or EngineProbe(engine_name(i, len(engines)), e)
                for i, e in enumerate(engines)
            ]
            for i, p in enumerate(probes):
                p.name = engine_name(i, len(engines))
            self.clients[client] = probes
        return probes

    async def check(self, client: Any) -> str | None:
        """None when every engine answered in time, else one sentence on those that did not."""
        call: CallUtility = getattr(client, CLIENT_CALL_UTILITY)
        probes = self.probes(client)
        results = await asyncio.gather(*(self._check_one(p, call) for p in probes))
        failures = [r for r in results if r]
        return "; ".join(failures) if failures else None

    async def _check_one(self, probe: EngineProbe, call: CallUtility) -> str | None:
        now = time.monotonic()
        if probe.task is None or probe.task.done():
            probe.sent_at = now
            probe.sent_wall = time.time()
            probe.task = asyncio.ensure_future(self._round_trip(probe, call))
        remaining = probe.sent_at + self.timeout - now
        if remaining > 0:
            await asyncio.wait({probe.task}, timeout=remaining)
        if probe.task.done():
            return None
        return self._failed(probe)

    async def _round_trip(self, probe: EngineProbe, call: CallUtility) -> None:
        started = time.monotonic()
        try:
            reply = await call(ENGINE_PING_METHOD, engine=probe.identity)
            error = None
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # EngineCore answered with an error: it is alive
            reply, error = None, f"{type(exc).__name__}: {exc}"
        seconds = time.monotonic() - started
        probe.last_round_trip_s = seconds
        probe.answered_wall = time.time()
        probe.answers += 1
        probe.error = error
        if isinstance(reply, dict) and isinstance(reply.get("counts"), dict):
            probe.counts = reply["counts"]
        self.on_round_trip(probe.name, seconds)
        if probe.failing:
            probe.failing = False
            log.warning(
                "%s in %s: %s answered after %.1f s (the round trip sent at %s)",
                ENGINE_ANSWERS_AGAIN,
                process_label(),
                probe.name,
                seconds,
                _clock(probe.sent_wall),
            )

    def _failed(self, probe: EngineProbe) -> str:
        age = time.monotonic() - probe.sent_at
        last = _clock(probe.answered_wall) if probe.answered_wall else "never"
        text = (
            f"{probe.name} has not answered for {age:.1f} s (round trip sent at "
            f"{_clock(probe.sent_wall)}; last answer: {last}; MMCACHE_FIX_HEALTH_TIMEOUT="
            f"{self.timeout:g})"
        )
        probe.failures += 1
        self.on_failure(probe.name)
        if not probe.failing:
            probe.failing = True
            log.warning(
                "%s in %s: %s; /health now fails. EngineCore may be stuck: run "
                "'vllm-mmcache-fix diagnose --pid <API server pid>'",
                ENGINE_NOT_ANSWERING,
                process_label(),
                text,
            )
        return text

    def engine_counts(self) -> list[Mapping[str, Any]] | None:
        """EngineCore's counters for ``/metrics``, from the first API server only (else None)."""
        for _ in range(3):  # read from the metrics thread while the event loop may add a client
            try:
                clients = list(self.clients.items())
                break
            except RuntimeError:
                continue
        else:
            return None
        for client, probes in clients:
            if getattr(client, CLIENT_INDEX, 0) != 0:
                continue
            return [p.counts for p in probes if p.counts is not None]
        return None

    def status(self) -> list[dict[str, Any]]:
        return [p.status() for probes in list(self.clients.values()) for p in probes]
