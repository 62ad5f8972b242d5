"""vLLM's real ``BaseMultiModalProcessor._merge_mm_kwargs`` on one request's images, as the
processor's ``apply`` calls it: for the checks that run in a vLLM venv on its real sender
cache.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

STUB = types.SimpleNamespace(_recompute_cached_prompt_update=lambda update, idx: update)
"""The processor the merge is called on: each cached item's prompt update comes back as is."""


def merge_images(
    merge: Callable[..., Any], sender: Any, hashes: list[str], new_item: Callable[[str], Any]
) -> Any:
    """``sender.is_cached(hashes)``, then ``merge`` (the unbound ``_merge_mm_kwargs``) of
    the images ``hashes``, ``new_item(hash)`` the data of each one not cached; returns the
    request's ``mm_kwargs``."""
    return lookup_and_merge(merge, sender, hashes, new_item)[1]


def lookup_and_merge(
    merge: Callable[..., Any],
    sender: Any,
    hashes: list[str],
    new_item: Callable[[str], Any],
    pause: Callable[[], Any] | None = None,
) -> tuple[list[bool], Any]:
    """:func:`merge_images`, with ``pause()`` between the lookup and the merge (where vLLM
    runs the HF processor on the images not cached); returns the lookup's answers and the
    request's ``mm_kwargs``."""
    cached = sender.is_cached(hashes)
    if pause is not None:
        pause()
    missing = [h for h, c in zip(hashes, cached) if not c]
    mm_kwargs, _ = merge(
        STUB,
        sender,
        mm_hashes={"image": hashes},
        mm_is_cached={"image": cached},
        mm_missing_kwargs={"image": [new_item(h) for h in missing]},
        mm_missing_prompt_updates={"image": [[] for _ in missing]},
    )
    return cached, mm_kwargs


def _cache_module() -> Any:
    """Where vLLM's LRU sender and receiver caches are defined: ``vllm/multimodal/cache/lru.py``
    (0.31+), ``vllm/multimodal/cache.py`` before."""
    try:  # 0.31+
        import vllm.multimodal.cache.lru as mm_lru

        return mm_lru
    except ImportError:
        import vllm.multimodal.cache as mm_cache

        return mm_cache


def sender_class() -> type:
    """vLLM's LRU sender cache: ``LruKeyReplicatedSenderCache`` (0.31+),
    ``MultiModalProcessorSenderCache`` before."""
    mod = _cache_module()
    cls: type | None = getattr(mod, "LruKeyReplicatedSenderCache", None)
    return cls or mod.MultiModalProcessorSenderCache


def receiver_class() -> type:
    """vLLM's LRU receiver cache (EngineCore's): ``LruKeyReplicatedReceiverCache`` (0.31+),
    ``MultiModalReceiverCache`` before."""
    mod = _cache_module()
    cls: type | None = getattr(mod, "LruKeyReplicatedReceiverCache", None)
    return cls or mod.MultiModalReceiverCache


def cache_config(capacity_gb: float) -> Any:
    """What vLLM's multimodal cache constructors read of the config:
    ``get_multimodal_config().mm_processor_cache_gb``."""
    multimodal = types.SimpleNamespace(mm_processor_cache_gb=capacity_gb)
    return types.SimpleNamespace(get_multimodal_config=lambda: multimodal)


def real_sender(capacity_gb: float) -> Any:
    """A new sender cache of vLLM's own class, ``capacity_gb`` large."""
    return sender_class()(cache_config(capacity_gb))
