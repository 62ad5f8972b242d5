"""What this package patches, why, and when each patch can go.

One row per patch, as data; ``tests/test_catalogue.py`` keeps the rows, the
code and the files under ``patches/`` in step.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PatchSpec:
    id: str
    targets: tuple[str, ...]
    """Where the patch lands, newest layout first (see locate.py)."""
    why: str
    upstream: tuple[str, ...]
    affected: str
    detection: str
    """How the package decides at run time that the target needs it."""
    removal: str
    """When the patch can be deleted."""
    source_patches: bool
    """Whether ``patches/`` carries the same fix as a source diff."""


CATALOGUE: tuple[PatchSpec, ...] = (
    PatchSpec(
        id="mm-lru-eviction",
        targets=(
            "vllm.multimodal.cache.base.MultiModalCache.get_lru_cache",
            "vllm.multimodal.cache.MultiModalCache.get_lru_cache",
            "vllm.multimodal.processing.ProcessingCache.get_lru_cache",
        ),
        why=(
            "vLLM's LRUCache.popitem picks the oldest key of its order dict and pop() returns "
            "without removing anything when that key has no data, so cachetools' eviction "
            "loop and LRUCache.clear() spin forever on a ghost key; touch() of a missing key "
            "created such keys up to 0.23.x. The caches built by get_lru_cache get touch, "
            "popitem and clear that always make progress."
        ),
        upstream=(
            "vllm-project/vllm#43941 (the freeze)",
            "vllm-project/vllm#43595 (touch ignores missing keys, 0.24.0)",
            "vllm-project/vllm#47958 (freeze after days of traffic, unexplained)",
        ),
        affected=(
            "touch creates ghost keys: 0.10.0-0.23.x; eviction and clear stall on any "
            "ghost key: every release up to 0.33.0"
        ),
        detection=(
            "probe.probe_touch / probe.probe_popitem on the LRUCache class the factory "
            "module builds"
        ),
        removal=(
            "when every vLLM you run has a popitem that removes an item or raises on an "
            "order-only key (probe_popitem returns False on the plain class)"
        ),
        source_patches=True,
    ),
)


def by_id(patch_id: str) -> PatchSpec:
    for spec in CATALOGUE:
        if spec.id == patch_id:
            return spec
    raise KeyError(patch_id)
