"""The one per-request context the wrappers share, explicit instead of loose thread-locals.

vLLM processes a request's multimodal items on one thread, nested:
``process_inputs`` (EngineCore request built) ⊃ ``apply`` (processor run) ⊃
``_merge_mm_kwargs`` (sender cache updated). Each wrapper sets its field of
this thread's :class:`RequestScope` for the duration of its call and puts
the previous value back, so a nested or re-entrant call sees its own.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .journal import Journal


class RequestScope:
    __slots__ = ("journal", "replay", "collector", "bypassed", "lookup")

    def __init__(self) -> None:
        self.journal: Journal | None = None
        """The journal of the sender-cache update in progress (inside ``_merge_mm_kwargs``)."""
        self.replay: Any = None
        """Re-runs the processor on this request's inputs (inside ``apply``)."""
        self.collector: list[Any] | None = None
        """Processed inputs produced inside ``process_inputs``."""
        self.bypassed: set[Any] = set()
        """Keys the guard reported as not cached though vLLM's cache holds them: their
        data goes to EngineCore even though the sender cache has them."""
        self.lookup: tuple[Any, Any] | None = None
        """``(mm_data_items, mm_hashes)`` of the cache lookup in progress (inside
        ``_get_cache_missing_items``): which items came without data."""


_local = threading.local()


def scope() -> RequestScope:
    """This thread's scope."""
    try:
        return _local.scope
    except AttributeError:
        current = _local.scope = RequestScope()
        return current


def sent_without_data(lookup: tuple[Any, Any] | None, key: Any) -> bool:
    """Whether the lookup in progress has ``key`` only as an item without data (a client
    referring to a cached item by its UUID: vLLM fails the request when such an item is not
    cached). False when unsure; never raises."""
    if lookup is None:
        return False
    try:
        items, hashes = lookup
        found = False
        for modality, keys in hashes.items():
            for index, each in enumerate(keys):
                if each == key:
                    if items[modality][index] is not None:
                        return False
                    found = True
        return found
    except Exception:
        return False
