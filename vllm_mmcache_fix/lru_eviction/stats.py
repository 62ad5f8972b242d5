"""What each multimodal cache of this process does: hits and misses per modality, evictions,
items too large to cache; and, read only when asked, its bytes, capacity and entries.

The fixed class counts on its own paths (:mod:`.cache`): a hit in ``get``, a miss when an item is
inserted (every miss of vLLM's multimodal caches is followed by an insert of the item, which
tells its modality; in the sender only after a lookup missed), an
eviction in ``popitem`` (``clear`` not included), an item too large in ``__setitem__``. Sizes
are what cachetools already tracks (``currsize``, ``maxsize``, ``len``), read by
:func:`flat_counts` for ``/metrics``; no item is ever walked.

The increments are plain ``+=`` under the GIL, as vLLM's own ``_hits``/``_total``, with no call
between the read and the write (``d[k] += 1``, not ``d[k] = d.get(k, 0) + 1``): CPython switches
threads at calls and loop jumps, so a switch there would let a thread write back a count that is
stale by everything the other thread counted meanwhile (a tenth of the misses on a loaded
machine). A lost increment stays possible, and rare; a counter never goes backwards for it.

This module does not import vLLM. The role of a cache is told by the value type vLLM builds it
for (``MultiModalCache.get_lru_cache(capacity_gb, value_type)``, the same three classes in
0.10.2 – 0.34.0).
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

ROLE_SENDER = "sender"
"""The API server's cache of item metadata, mirroring EngineCore's (``lru`` cache type)."""
ROLE_RECEIVER = "receiver"
"""EngineCore's cache of the processed items."""
ROLE_PROCESSOR_ONLY = "processor_only"
"""The API server's own cache when EngineCore has none (several API servers, DP)."""
ROLE_OTHER = "other"
ROLES = (ROLE_SENDER, ROLE_RECEIVER, ROLE_PROCESSOR_ONLY, ROLE_OTHER)

_ROLE_BY_VALUE_TYPE = {
    "MultiModalProcessorCacheItemMetadata": ROLE_SENDER,
    "MultiModalProcessorCacheItem": ROLE_PROCESSOR_ONLY,
    "MultiModalKwargsItem": ROLE_RECEIVER,
    "MultiModalKwargsItems": ROLE_RECEIVER,
}

MODALITY_UNKNOWN = "unknown"

# Flattened keys of :func:`flat_counts` (the counts dict carries plain numbers only).
KEY_PREFIX = "mmcache|"
KEY_PROCESS = "mmcache|process|"
"""``mmcache|process|<multiprocessing name>`` = 1: which process the figures are from."""
GAUGE_FIELDS = ("bytes", "capacity_bytes", "entries")
COUNTER_FIELDS = ("evictions", "too_large")
MODALITY_FIELDS = ("hits", "misses")


def role_of(value_type: Any) -> str:
    name = getattr(value_type, "__name__", None)
    return _ROLE_BY_VALUE_TYPE.get(name, ROLE_OTHER) if isinstance(name, str) else ROLE_OTHER


class CacheStats:
    """The counters of one cache (or of the caches nobody tracks: :data:`UNTRACKED`)."""

    __slots__ = ("hits", "misses", "evictions", "too_large", "unfilled", "gated", "__weakref__")

    def __init__(self, gated: bool = False) -> None:
        self.hits: dict[str, int] = {}
        self.misses: dict[str, int] = {}
        self.evictions = 0
        self.too_large = 0
        self.unfilled = 0
        """Lookups that missed and whose insert has not come yet."""
        self.gated = gated
        """Count an insert as a miss only after a lookup missed (the sender: the drift guard
        puts back there what a rejected request evicted). EngineCore's receiver inserts
        without a lookup when the API server sends the data (0.28+): every insert counts."""


UNTRACKED = CacheStats()
"""Where a fixed cache counts until :func:`track` gives it its own (a cache built outside
``get_lru_cache``, the benchmark's caches): the same work on the hot path, never exported."""


# -- modality of a cached value ---------------------------------------------------------------

_by_field: dict[str, str] = {}


def _modality_of_field(name: str) -> str | None:
    """What a processed field's name says (Qwen-VL: ``pixel_values_videos``, ``image_grid_thw``;
    audio models: ``input_audio_features``, ``input_features``)."""
    lowered = name.lower()
    for word, modality in (("video", "video"), ("audio", "audio"), ("image", "image")):
        if word in lowered:
            return modality
    if lowered.startswith("pixel_values"):
        return "image"
    if lowered in ("input_features", "feature_attention_mask"):
        return "audio"
    return None


def _from_fields(fields: Any) -> str:
    for name in fields:
        modality = _by_field.get(name)
        if modality is None:
            modality = _modality_of_field(str(name)) or ""
            if len(_by_field) < 1024:
                _by_field[name] = modality
        if modality:
            return modality
    return MODALITY_UNKNOWN


def _of_prompt_updates(value: Any) -> str:
    # The sender's metadata and the processor-only item keep the prompt updates, which name
    # the modality; the processor-only item also has the processed fields.
    updates = value.prompt_updates
    if updates:
        modality = getattr(updates[0], "modality", None)
        if isinstance(modality, str) and modality:
            return modality
    item = getattr(value, "item", None)
    return _of_item(item) if item is not None else MODALITY_UNKNOWN


def _of_item(value: Any) -> str:
    # MultiModalKwargsItem is a UserDict of fields (no modality of its own since 0.11); older
    # field elements carry one. The first field's name, already seen, is the common case.
    data = getattr(value, "data", value)
    if type(data) is dict:
        for name in data:
            modality = _by_field.get(name)
            if modality:
                return modality
            break
    return _of_item_slow(data)


def _of_item_slow(data: Any) -> str:
    if not isinstance(data, dict) or not data:
        return MODALITY_UNKNOWN
    modality = _from_fields(data)
    if modality == MODALITY_UNKNOWN:
        first = next(iter(data.values()))
        own = getattr(first, "modality", None)
        if isinstance(own, str) and own:
            return own
    return modality


def _unknown(value: Any) -> str:
    return MODALITY_UNKNOWN


_by_type: dict[type, Callable[[Any], str]] = {}


def _reader_for(value: Any) -> Callable[[Any], str]:
    """How to read the modality of values of this one's type (decided once per type)."""
    if hasattr(value, "prompt_updates"):
        return _of_prompt_updates
    if isinstance(getattr(value, "data", value), dict):
        return _of_item
    return _unknown


def modality_of(value: Any) -> str:
    """The modality a cached value says it is (``image``, ``video``, ``audio``...), or
    ``unknown``; never raises."""
    try:
        reader = _by_type.get(type(value))
        if reader is None:
            reader = _reader_for(value)
            if len(_by_type) < 256:
                _by_type[type(value)] = reader
        return reader(value)
    except Exception:
        return MODALITY_UNKNOWN


# -- the caches of this process ----------------------------------------------------------------

_lock = threading.Lock()
_tracked: list[tuple[weakref.ref[Any], str, CacheStats]] = []
_departed: dict[str, CacheStats] = {}
"""Counters of caches that were garbage-collected, per role: the totals never go backwards."""


def _forget_the_parents_caches() -> None:
    """In a forked child (EngineCore forked by the API server or an ``LLM(...)`` script):
    the caches tracked so far are the parent's, which reports them (the child would report
    the parent's sender cache as its own); and a lock a parent's thread held at the fork
    stays held here (the child's first ping answer, which reads these counts, would block)."""
    global _lock, _tracked, _departed
    _lock = threading.Lock()
    _tracked = []
    _departed = {}


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_the_parents_caches)


def track(cache: Any, value_type: Any) -> None:
    """Give ``cache`` (a fixed cache vLLM just built) its own counters, under the role its
    ``value_type`` tells."""
    role = role_of(value_type)
    stats = CacheStats(gated=role == ROLE_SENDER)
    with _lock:
        _tracked.append((weakref.ref(cache), role, stats))
    cache._mmfix_stats = stats


def _merge(into: dict[str, int], stats: CacheStats, role: str) -> None:
    for key in COUNTER_FIELDS:
        name = f"{KEY_PREFIX}{role}|{key}"
        into[name] = into.get(name, 0) + int(getattr(stats, key))
    for field in MODALITY_FIELDS:
        for modality, count in list(getattr(stats, field).items()):
            name = f"{KEY_PREFIX}{role}|{field}|{modality}"
            into[name] = into.get(name, 0) + count


switched_off: str | None = None
"""Why :func:`flat_counts` stopped reporting (an error in its own code), or None."""


def flat_counts() -> dict[str, int]:
    """Every tracked cache's figures, summed per role, as ``mmcache|<role>|<field>[|<modality>]``
    keys; empty when this process built no multimodal cache. Never raises: an error switches
    the cache figures off for good (the other counts go on)."""
    global switched_off
    if switched_off is not None:
        return {}
    try:
        return _flat_counts()
    except Exception as exc:
        switched_off = repr(exc)
        return {}


def _flat_counts() -> dict[str, int]:
    from ..core.process import process_name

    out: dict[str, int] = {}
    with _lock:
        alive = []
        for ref, role, stats in _tracked:
            cache = ref()
            if cache is None:
                kept = _departed.setdefault(role, CacheStats())
                kept.evictions += stats.evictions
                kept.too_large += stats.too_large
                for field in MODALITY_FIELDS:
                    mine = getattr(kept, field)
                    for modality, count in getattr(stats, field).items():
                        mine[modality] = mine.get(modality, 0) + count
                continue
            alive.append((ref, role, stats))
            _merge(out, stats, role)
            for key, value in (
                ("bytes", cache.currsize),
                ("capacity_bytes", cache.maxsize),
                ("entries", len(cache._Cache__data)),
            ):
                name = f"{KEY_PREFIX}{role}|{key}"
                out[name] = out.get(name, 0) + int(value)
        _tracked[:] = alive
        for role, stats in _departed.items():
            _merge(out, stats, role)
    if out:
        out[KEY_PROCESS + process_name()] = 1
    return out


def reset() -> None:
    """Forget every tracked cache (tests, uninstall)."""
    global switched_off
    switched_off = None
    with _lock:
        _tracked.clear()
        _departed.clear()
    UNTRACKED.__init__()  # type: ignore[misc]
