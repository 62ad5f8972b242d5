"""A cache reset racing the input thread, on the real vLLM ``LRUCache``.

The trials run in subprocesses pinned to one cachetools release each (see
harness/programs/bench/race_probe.py, ``scripts/race-probe``, which also measures the unpatched
class and the cost of a lock). Here only the properties that must hold every time are asserted: the
fixed class never freezes, and whatever state the race leaves is consistent again
after one more full eviction; the locked prototype also lets no exception escape.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from harness import realsrc
from harness.programs.bench import race_probe
from vllm_mmcache_fix.catalogue import NEWEST_SOURCES_CHECKED as NEWEST
from vllm_mmcache_fix.lru_eviction.cache import fixed_lru_class

TRIALS = int(os.environ.get("MMCACHE_HARNESS_RACE_TRIALS", "10"))
CACHETOOLS = ("5.5.2", "8.0.2")
# One release whose touch adds missing keys to the order, one whose touch does not.
VERSIONS = ("0.23.0", NEWEST)


def _run(version: str, variant: str, ct: str) -> dict[str, Any]:
    result = race_probe.probe(version, variant, ct, TRIALS, iters=200, clears=100)
    print(f"{version} cachetools {ct} {variant}: {result}")
    assert result["trials"] == TRIALS
    return result


@pytest.mark.parametrize("ct", CACHETOOLS)
@pytest.mark.parametrize("version", VERSIONS)
def test_fixed_class_never_freezes_under_reset_race(version: str, ct: str) -> None:
    r = _run(version, "fixed", ct)
    assert r["froze_during"] == 0
    assert r["froze_next_eviction"] == 0
    # Whatever the race left behind, one more full eviction leaves order == data.
    assert r["repaired_by_next_eviction"] == TRIALS
    assert r["desync_after_next_eviction"] == 0
    assert r["drift_trials"] == 0


@pytest.mark.parametrize("ct", CACHETOOLS)
def test_locked_prototype_is_race_free(ct: str) -> None:
    r = _run(NEWEST, "locked", ct)
    assert r["froze_during"] == 0 and r["froze_next_eviction"] == 0
    assert r["exceptions"] == {}
    assert r["desync_trials"] == 0 and r["drift_trials"] == 0
    assert r["next_eviction_errors"] == {}


def test_locked_prototype_keeps_the_api() -> None:
    """The lock wrapper changes no result of a single-threaded request stream."""
    base = realsrc.load_lru_module(NEWEST).LRUCache
    fixed = race_probe.new_cache(fixed_lru_class(base), 16)
    locked = race_probe.new_cache(race_probe.locked_class(fixed_lru_class(base)), 16)
    for i in range(500):
        keys = [f"h{(i * 7 + j) % 23}" for j in range(3)]
        values = [b"x" * (1 + (i + j) % 4) for j in range(3)]
        race_probe.p1_request(fixed, keys, values)
        race_probe.p1_request(locked, keys, values)
        if i % 97 == 0:
            fixed.clear()
            locked.clear()
        assert list(fixed.order) == list(locked.order)
        assert fixed.currsize == locked.currsize
        assert fixed.stat() == locked.stat()
