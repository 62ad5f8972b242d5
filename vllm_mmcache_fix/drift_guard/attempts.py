"""The attempts table: what recovery keeps of a request that sent items without data.

Recovery needs, for a request that sent items without data, their hashes and
the means to process its inputs again (which holds the decoded images or
frames). Only a request that can be recovered gets it: one inside the
``AsyncLLM.generate`` wrapper, which opens a :class:`Slot` for its prompt
before vLLM processes it; ``process_inputs`` fills the slot of that very prompt
object (never one found by the client's request id, which need not be
unique). Pooling requests (``encode``), streaming-input sessions and offline
engines open no slot, so nothing is kept for them. A slot lives as long as its
``generate`` call waits for the first output, however the request ends; the
decoded inputs of all open slots together are bounded in bytes
(:data:`MAX_REPLAY_BYTES`): past that, a request keeps only its hashes and a
drift of it reaches the client as vLLM's error.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Callable, Mapping
from typing import Any

from .journal import Key

MAX_REPLAY_BYTES = 256 * 2**20
"""Decoded inputs kept for re-sending, over all requests waiting for their first output."""
# Walking a request's inputs to size them stops after this many objects.
_SIZE_WALK_LIMIT = 4096


class Attempt:
    """What ``process_inputs`` saw of a recoverable request that sent items without data."""

    __slots__ = ("hashes", "replay", "_refund", "__weakref__")

    def __init__(
        self,
        hashes: list[Key],
        replay: Callable[[], Any] | None,
        size: int,
        budget: ReplayBudget,
    ) -> None:
        self.hashes = hashes
        self.replay = replay
        self._refund = weakref.finalize(self, budget.refund, size) if replay is not None else None

    def release(self) -> None:
        """Drop the inputs kept for re-sending (the hashes stay)."""
        self.replay = None
        if self._refund is not None:
            self._refund()


class Slot:
    """One ``generate`` call's place for the attempt of its prompt, open while vLLM adds it."""

    __slots__ = ("prompt", "attempt", "__weakref__")

    def __init__(self, prompt: Any) -> None:
        self.prompt = prompt
        self.attempt: Attempt | None = None


class ReplayBudget:
    """Bytes of decoded inputs held by attempts, against :data:`MAX_REPLAY_BYTES`."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self.count = 0
        self.refused = 0
        self._lock = threading.Lock()

    def admit(self, size: int) -> bool:
        with self._lock:
            if self.held + size > self.limit:
                self.refused += 1
                return False
            self.held += size
            self.count += 1
            return True

    def refund(self, size: int) -> None:
        with self._lock:
            self.held -= size
            self.count -= 1


class AttemptTable:
    """The open slots of recoverable ``generate`` calls, by ``id(prompt)``, and the byte
    budget of the decoded inputs their attempts keep."""

    def __init__(self, limit: int = MAX_REPLAY_BYTES) -> None:
        # id(prompt) -> slots of the generate calls adding that prompt object now
        self._slots: dict[int, list[Slot]] = {}
        self._lock = threading.Lock()
        self.replays = ReplayBudget(limit)

    def clear(self) -> None:
        with self._lock:
            slots = [slot for group in self._slots.values() for slot in group]
            self._slots.clear()
        for slot in slots:
            if slot.attempt is not None:
                slot.attempt.release()
                slot.attempt = None

    def attempts(self) -> dict[str, int]:
        """Open slots, and the attempts holding decoded inputs with their bytes."""
        with self._lock:
            open_slots = sum(len(group) for group in self._slots.values())
        replays = self.replays
        return {
            "open": open_slots,
            "holding_inputs": replays.count,
            "input_bytes": replays.held,
            "refused_for_size": replays.refused,
        }

    def open_slot(self, prompt: Any) -> Slot:
        """A recoverable ``generate`` call is about to have ``prompt`` added."""
        slot = Slot(prompt)
        with self._lock:
            self._slots.setdefault(id(prompt), []).append(slot)
        return slot

    def close_slot(self, slot: Slot) -> Attempt | None:
        """The call has its first output (or ended): its attempt, which nothing else holds now."""
        with self._lock:
            group = self._slots.get(id(slot.prompt))
            if group is not None:
                try:
                    group.remove(slot)
                except ValueError:
                    pass
                if not group:
                    del self._slots[id(slot.prompt)]
        attempt, slot.attempt = slot.attempt, None
        return attempt

    def _slot_for(self, prompt: Any) -> Slot | None:
        with self._lock:
            for slot in self._slots.get(id(prompt), ()):
                if slot.prompt is prompt and slot.attempt is None:
                    return slot
        return None

    def note_attempt(self, prompt: Any, request: Any, replay: Callable[[], Any] | None) -> None:
        """``process_inputs`` built ``request`` from ``prompt``: fill its slot, if it has one."""
        if not self._slots:
            return
        features = getattr(request, "mm_features", None)
        if not features:
            return
        if all(getattr(f, "data", None) is not None for f in features):
            return
        slot = self._slot_for(prompt)
        if slot is None:
            return  # not a request recovery can re-send
        hashes = [k for k in (feature_key(f) for f in features) if k is not None]
        size = 0
        if replay is not None:
            size = replay_size(replay)
            if not self.replays.admit(size):
                replay = None
        slot.attempt = Attempt(hashes, replay, size, self.replays)


def feature_key(feature: Any) -> Any:
    return getattr(feature, "mm_hash", None) or getattr(feature, "identifier", None)


def replay_size(replay: Any) -> int:
    """Bytes of the inputs a replay holds (images, frames, arrays, raw bytes), estimated.

    Inputs that cannot be sized count as too large to keep.
    """
    try:
        return estimate_bytes((getattr(replay, "args", ()), getattr(replay, "kwargs", {})))
    except Exception:
        return MAX_REPLAY_BYTES + 1


def estimate_bytes(root: Any) -> int:
    """The sizes of the buffers reachable from ``root`` through containers and attributes.

    Counted: ``nbytes`` (numpy arrays, torch tensors), PIL images (width x height x
    bands), bytes and strings. Caches met on the way (anything named ``cache``, any
    cachetools cache) are not entered, nor sequences of numbers (token ids: a prompt's
    length must not set the cost). Every object looked at counts toward
    ``_SIZE_WALK_LIMIT``, after which the walk stops: the cost is bounded whatever the
    request holds.
    """
    total = 0
    seen: set[int] = set()
    stack = [root]
    budget = _SIZE_WALK_LIMIT
    while stack and budget > 0:
        obj = stack.pop()
        budget -= 1
        if obj is None or isinstance(obj, _SCALARS) or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, (bytes, bytearray, str)):
            total += len(obj)
            continue
        nbytes = getattr(obj, "nbytes", None)
        if isinstance(nbytes, int):
            total += nbytes
            continue
        size = getattr(obj, "size", None)
        if callable(getattr(obj, "getbands", None)) and isinstance(size, tuple) and len(size) == 2:
            total += int(size[0]) * int(size[1]) * len(obj.getbands())
            continue
        if hasattr(obj, "_Cache__data"):
            continue
        if isinstance(obj, Mapping):
            try:
                values = (v for k, v in obj.items() if k not in _NOT_WALKED)
                stack.extend(itertools.islice(values, budget))
            except Exception:
                pass
            continue
        if isinstance(obj, (list, tuple)):
            if obj and isinstance(obj[0], _SCALARS) and isinstance(obj[-1], _SCALARS):
                continue  # numbers (token ids, offsets): no buffers in there
            stack.extend(itertools.islice(obj, budget))
            continue
        if isinstance(obj, (set, frozenset)):
            stack.extend(itertools.islice(obj, budget))
            continue
        fields = getattr(obj, "__dict__", None)
        if isinstance(fields, dict):
            stack.extend(
                itertools.islice((v for k, v in fields.items() if k not in _NOT_WALKED), budget)
            )
        slots = getattr(type(obj), "__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name not in _NOT_WALKED and not name.startswith("__"):
                stack.append(getattr(obj, name, None))
    return total


_SCALARS = (bool, int, float)
_NOT_WALKED = frozenset({"cache", "_cache"})
