"""The cache figures for ``/metrics`` on the real ``LRUCache`` of releases and cachetools.

Each case runs in a fresh interpreter that loads the release's own class, builds the fixed
class from it, and drives it the way vLLM's multimodal caches do (get, insert on a miss).
The values are stand-ins shaped like vLLM's (a dict of processed fields; an object with
``prompt_updates``): their modality is what the figures are labelled with.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from harness import realsrc

SNIPPET = """
import collections, json, os, sys, threading, time
from harness import realsrc
from vllm_mmcache_fix.lru_eviction import stats
from vllm_mmcache_fix.lru_eviction.cache import fixed_lru_class

LRU = realsrc.load_lru_module(VERSION).LRUCache
Fixed = fixed_lru_class(LRU)


class MultiModalKwargsItem(collections.UserDict):
    pass


class MultiModalProcessorCacheItemMetadata:
    def __init__(self, modality, size):
        self.item_size = size
        self.prompt_updates = [type("Update", (), {"modality": modality})()]


def item(modality, size):
    field = {"image": "pixel_values", "video": "pixel_values_videos",
             "audio": "input_audio_features"}[modality]
    return MultiModalKwargsItem({field: b"x" * size, "grid_thw": b""})


def drive(cache, requests):
    for key, value in requests:
        if cache.get(key) is None:
            try:
                cache[key] = value
            except ValueError as exc:
                assert str(exc) == "value too large", exc


def size_of(value):
    if isinstance(value, MultiModalKwargsItem):
        return sum(len(v) for v in value.data.values())
    return value.item_size


out = {}
requests = [(f"img{i % 6}", item("image", 100)) for i in range(24)]
requests += [(f"vid{i % 3}", item("video", 250)) for i in range(9)]
requests += [("huge", item("video", 5000)), ("aud0", item("audio", 50)), ("aud0", None)]

# The same sequence on vLLM's own class and on the fixed one: same hits, order and sizes.
own = LRU(1000, getsizeof=size_of)
drive(own, requests)
receiver = Fixed(1000, getsizeof=size_of)
stats.track(receiver, MultiModalKwargsItem)
drive(receiver, requests)
out["same_as_vllm"] = (
    (own._hits, own._total, list(own._LRUCache__order), own.currsize)
    == (receiver._hits, receiver._total, list(receiver._LRUCache__order), receiver.currsize)
)
out["own_hits"] = own._hits

sender = Fixed(1000, getsizeof=size_of)
stats.track(sender, MultiModalProcessorCacheItemMetadata)
drive(sender, [(f"s{i % 4}", MultiModalProcessorCacheItemMetadata("image", 300)) for i in range(8)])
misses_before = sum(sender._mmfix_stats.misses.values())
sender["put-back"] = MultiModalProcessorCacheItemMetadata("image", 300)  # a drift-guard restore
out["put_back_counted"] = sum(sender._mmfix_stats.misses.values()) - misses_before
# EngineCore's receiver inserts without a lookup when the API server sends the data (0.28+).
misses_before = sum(receiver._mmfix_stats.misses.values())
receiver["sent-with-data"] = item("image", 10)
out["receiver_insert_counted"] = sum(receiver._mmfix_stats.misses.values()) - misses_before
out["first"] = stats.flat_counts()
sender.clear()  # a reset is not an eviction
out["after_clear"] = stats.flat_counts()
del sender
import gc; gc.collect()
out["after_gc"] = stats.flat_counts()

# Two threads on one cache under forced switching: bounded, consistent, counted.
sys.setswitchinterval(1e-6)
shared = Fixed(2000, getsizeof=size_of)
stats.track(shared, MultiModalKwargsItem)
errors = []
def worker(seed):
    for i in range(3000):
        key = f"k{(i * seed) % 40}"
        try:
            drive(shared, [(key, item("image" if i % 2 else "video", 100))])
        except KeyError as exc:
            # cachetools' own insert is not thread-safe: a KeyError now and then, as in
            # vLLM. The thread goes on, so every run makes 6000 calls, however loaded
            # the machine (a thread that stopped at its first error made a run of a few
            # calls, where one lost count is a tenth of them).
            errors.append(repr(exc))
threads = [threading.Thread(target=worker, args=(s,), daemon=True) for s in (3, 7)]
for t in threads: t.start()
for t in threads: t.join(60)
out["threads_alive"] = [t.is_alive() for t in threads]
s = shared._mmfix_stats
out["threaded"] = {"hits": sum(s.hits.values()), "misses": sum(s.misses.values()),
                   "evictions": s.evictions, "lookups": shared._total, "errors": errors}
print("RESULT " + json.dumps(out), flush=True)
os._exit(0)
"""

CASES = [(v, None) for v in ("0.10.2", "0.23.0", "0.24.0", "0.32.0", "0.34.0")] + [
    ("0.23.0", "5.5.2"),
    ("0.32.0", "6.2.0"),
    ("0.32.0", "7.3.3"),
]
IDS = [f"{v}-cachetools{ct or 'default'}" for v, ct in CASES]


def _run(case: tuple[str, str | None]) -> dict:
    version, cachetools = case
    code = f"VERSION = {version!r}\n" + SNIPPET
    result = realsrc.run_snippet(code, cachetools, timeout=120).check()
    for line in result.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise AssertionError(result.stdout + result.stderr)


@pytest.fixture(scope="module")
def outcomes() -> dict[tuple[str, str | None], dict]:
    for version, _ in CASES:
        realsrc.source_root(version)
    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(CASES, pool.map(_run, CASES)))


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_figures_per_role_and_modality(outcomes: dict, case: tuple[str, str | None]) -> None:
    out = outcomes[case]
    assert out["same_as_vllm"], out
    first = out["first"]
    # receiver: 6 images cycle through a 1000-byte cache holding ~5 of them (every lookup
    # after the first round misses), 3 videos of 250 bytes, one too large, one audio hit.
    assert first["mmcache|receiver|misses|image"] == 25 - first["mmcache|receiver|hits|image"]
    assert first["mmcache|receiver|misses|video"] >= 3
    assert first["mmcache|receiver|too_large"] == 1
    assert first["mmcache|receiver|hits|audio"] == 1
    assert first["mmcache|receiver|misses|audio"] == 1
    hits = sum(v for k, v in first.items() if k.startswith("mmcache|receiver|hits|"))
    assert hits == out["own_hits"]
    assert first["mmcache|receiver|evictions"] > 0
    assert out["put_back_counted"] == 0
    assert out["receiver_insert_counted"] == 1
    assert first["mmcache|receiver|capacity_bytes"] == 1000
    assert 0 < first["mmcache|receiver|bytes"] <= 1000
    assert first["mmcache|receiver|entries"] > 0
    # sender: 4 metadata items of 300 bytes in 1000: 3 fit, every lookup misses.
    assert first["mmcache|sender|misses|image"] == 8
    assert first["mmcache|sender|evictions"] == 6
    assert first["mmcache|sender|entries"] == 3
    assert first["mmcache|sender|bytes"] == 900
    assert any(k.startswith("mmcache|process|") for k in first)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_counters_survive_a_reset_and_the_cache_going(outcomes: dict, case) -> None:
    out = outcomes[case]
    cleared, gone = out["after_clear"], out["after_gc"]
    assert cleared["mmcache|sender|evictions"] == 6  # clear is not an eviction
    assert cleared["mmcache|sender|entries"] == 0
    assert cleared["mmcache|sender|bytes"] == 0
    # The cache was collected: its counters stay, its gauges go.
    assert gone["mmcache|sender|misses|image"] == 8
    assert gone["mmcache|sender|evictions"] == 6
    assert "mmcache|sender|entries" not in gone


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_two_threads_are_counted_and_never_hang(outcomes: dict, case) -> None:
    out = outcomes[case]
    assert out["threads_alive"] == [False, False]
    threaded = out["threaded"]
    # Increments are plain += as vLLM's own: under forced switching a few may be lost,
    # never invented.
    assert 0 < threaded["hits"] + threaded["misses"] <= 6000
    # A lookup whose insert raised is not counted; otherwise none is lost (no thread switch
    # falls between an increment's read and write), however loaded the machine.
    counted = threaded["hits"] + threaded["misses"] + len(threaded["errors"])
    assert counted >= 0.99 * threaded["lookups"], threaded
    assert threaded["evictions"] > 0
    assert len(threaded["errors"]) < 600, threaded["errors"][:5]


@pytest.mark.parametrize("version", ["0.23.0", "0.34.0"])
def test_only_an_item_too_large_counts_as_too_large(version: str) -> None:
    """cachetools refuses an item larger than the cache with ``ValueError('value too
    large')``; any other error of the insert (here, of ``getsizeof``) is not that."""
    from vllm_mmcache_fix.lru_eviction import stats
    from vllm_mmcache_fix.lru_eviction.cache import fixed_lru_class

    def getsizeof(value: str) -> int:
        if value == "unsized":
            raise ValueError("wrong value, cannot size it")  # sorts after "value too large"
        return len(value)

    cache = fixed_lru_class(realsrc.load_lru_module(version).LRUCache)(4, getsizeof=getsizeof)
    cache._mmfix_stats = counts = stats.CacheStats()
    with pytest.raises(ValueError, match="cannot size it"):
        cache["a"] = "unsized"
    assert counts.too_large == 0
    with pytest.raises(ValueError, match="value too large"):
        cache["b"] = "xxxxx"
    assert counts.too_large == 1


def test_repair_counts_add_up_and_compare_by_value() -> None:
    from vllm_mmcache_fix.lru_eviction.cache import RepairStats

    assert RepairStats().as_dict() == {"ghost_keys_dropped": 0, "orphans_restored": 0}
    assert RepairStats().total() == 0
    assert RepairStats(2, 3).total() == 5
    assert RepairStats(1, 2) == RepairStats(1, 2)
    assert RepairStats(1, 2) != RepairStats(2, 1)
    assert RepairStats() != (0, 0)
