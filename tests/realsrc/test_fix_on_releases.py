"""The fix on the real ``LRUCache`` of every vLLM release.

For each release, one fresh interpreter loads the release's own class and
runs the incident sequence the way vLLM's P1 receiver cache drives it (touch
every hash of a request, then get-or-insert each; a request whose item P0
wrongly believed cached arrives with no data and fails). The fixed class must
finish every sequence; the release's own class must hang on it where the
release's ``touch`` creates ghost keys (<= 0.23.x), and on a planted ghost in
every release. Hangs run in daemon threads joined with a deadline, so nothing
here can hang the test run.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from harness import realsrc
from vllm_mmcache_fix.catalogue import NEWEST_SOURCES_CHECKED as NEWEST

HANG_DEADLINE_S = 2.0

SEQUENCES = """
import json, os, sys, threading, time
from harness import realsrc
from vllm_mmcache_fix.lru_eviction.cache import STATS, fixed_lru_class

module = realsrc.load_lru_module(VERSION)
LRU = module.LRUCache


def receive(cache, items):
    # vLLM's receiver: touch all first, then get or insert each.
    for mm_hash, _ in items:
        cache.touch(mm_hash)
    for mm_hash, data in items:
        if cache.get(mm_hash) is not None:
            continue
        assert data is not None, f"Expected a cached item for {mm_hash=}"
        cache[mm_hash] = data


def incident(cache):
    for i in range(8):
        receive(cache, [(f"img{i}", b"x" * 100)])
    try:
        receive(cache, [("rejected-then-reused", None)])  # the 500
    except AssertionError:
        pass
    for i in range(8, 40):
        receive(cache, [(f"img{i}", b"x" * 100)])  # eviction


def planted(cache):
    for i in range(8):
        cache[f"img{i}"] = b"x" * 100
    cache._LRUCache__order["ghost"] = None
    cache._LRUCache__order.move_to_end("ghost", last=False)
    for i in range(8, 40):
        cache[f"img{i}"] = b"x" * 100


def planted_clear(cache):
    for i in range(4):
        cache[f"img{i}"] = b"x" * 100
    cache._LRUCache__order["ghost"] = None
    cache._LRUCache__order.move_to_end("ghost", last=False)
    cache.clear()


def consistent(cache):
    return list(cache._LRUCache__order) == [k for k in cache._LRUCache__order
                                            if k in cache._Cache__data] \
        and set(cache._LRUCache__order) == set(cache._Cache__data)


out = {"source": module.__vllm_source__}
Fixed = fixed_lru_class(LRU)
for name, seq in (("incident", incident), ("planted", planted), ("planted_clear", planted_clear)):
    cache = Fixed(1000, getsizeof=len)
    start = time.perf_counter()
    seq(cache)
    out[f"fixed_{name}_s"] = time.perf_counter() - start
    out[f"fixed_{name}_consistent"] = consistent(cache)
    out[f"fixed_{name}_len"] = len(cache)
    out[f"fixed_{name}_currsize"] = cache.currsize
out["repairs"] = STATS.as_dict()

threads = {}
for name, seq in (("incident", incident), ("planted", planted), ("planted_clear", planted_clear)):
    t = threading.Thread(target=seq, args=(LRU(1000, getsizeof=len),), daemon=True)
    t.start()
    threads[name] = t
deadline = time.monotonic() + DEADLINE
for name, t in threads.items():
    t.join(max(0.0, deadline - time.monotonic()))
    out[f"unpatched_{name}_hangs"] = t.is_alive()
print("RESULT " + json.dumps(out), flush=True)
os._exit(0)
"""


# Every release under the cachetools the test environment has (8.x), and one
# release of each LRUCache layout under the older cachetools vLLM allows.
OLDER_CACHETOOLS = ("5.5.2", "6.2.0")
LAYOUT_SAMPLES = ("0.10.0", "0.11.0", "0.23.0", "0.24.0", NEWEST)
CASES = [(v, None) for v in realsrc.VERSIONS] + [
    (v, ct) for ct in OLDER_CACHETOOLS for v in LAYOUT_SAMPLES
]
IDS = [f"{v}-cachetools{ct or 'default'}" for v, ct in CASES]


def _run(case: tuple[str, str | None]) -> dict:
    version, cachetools = case
    code = f"VERSION = {version!r}\nDEADLINE = {HANG_DEADLINE_S}\n" + SEQUENCES
    result = realsrc.run_snippet(code, cachetools, timeout=60).check()
    for line in result.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise AssertionError(result.stdout + result.stderr)


@pytest.fixture(scope="module")
def outcomes(request: pytest.FixtureRequest) -> dict[tuple[str, str | None], dict]:
    """The cases the run selected (``-k`` may leave releases out), run side by side."""
    chosen = [
        case
        for case in CASES
        if any(
            getattr(item, "callspec", None) is not None and item.callspec.params.get("case") == case
            for item in request.session.items
        )
    ]
    for version in sorted({v for v, _ in chosen}):
        realsrc.source_root(version)  # fetch up front, serially
    with ThreadPoolExecutor(max_workers=4) as pool:
        return dict(zip(chosen, pool.map(_run, chosen)))


def _ghost_touch(version: str) -> bool:
    return realsrc.version_key(version) < (0, 24)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_fixed_class_finishes_every_sequence(outcomes: dict, case: tuple[str, str | None]) -> None:
    version = case[0]
    out = outcomes[case]
    for name in ("incident", "planted", "planted_clear"):
        assert out[f"fixed_{name}_consistent"], (version, name, out)
    # Eviction kept the cache full and within capacity after the ghost.
    assert out["fixed_incident_len"] == 10 and out["fixed_incident_currsize"] == 1000
    assert out["fixed_planted_len"] == 10 and out["fixed_planted_currsize"] == 1000
    assert out["fixed_planted_clear_len"] == 0 and out["fixed_planted_clear_currsize"] == 0
    # The planted ghosts were met and dropped (and counted).
    assert out["repairs"]["ghost_keys_dropped"] >= 2


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_release_class_hangs_where_expected(outcomes: dict, case: tuple[str, str | None]) -> None:
    version = case[0]
    out = outcomes[case]
    assert out["unpatched_incident_hangs"] is _ghost_touch(version), out
    # Eviction and clear were never hardened upstream: a planted ghost stalls both.
    assert out["unpatched_planted_hangs"] is True, out
    assert out["unpatched_planted_clear_hangs"] is True, out


TOUCH = """
from harness import realsrc
from vllm_mmcache_fix.lru_eviction.cache import fixed_lru_class

LRU = realsrc.load_lru_module(VERSION).LRUCache
fixed = fixed_lru_class(LRU)
cache = fixed(1000, getsizeof=lambda value: 1)
cache["a"], cache["b"] = 1, 2
cache.touch("a")  # a hit moves the key to the newest end
cache.touch("missing")  # a miss adds nothing
own = LRU(1000, getsizeof=lambda value: 1)
own.touch("missing")
print("RESULT", json.dumps({
    "order": list(cache._LRUCache__order),
    "own_adds": "missing" in own._LRUCache__order,
    "order_first": fixed.touch.__name__ == "_mmfix_touch_order_first",
}))
"""


@pytest.mark.parametrize("version", ["0.23.0", "0.32.0"])
def test_touch_takes_the_releases_cheaper_path_and_never_adds(version: str) -> None:
    """Where the release's own touch moves first and adds a missing key (<= 0.23), the
    fixed touch moves first too (a hit costs what vLLM's costs); elsewhere it checks
    membership first, as the release does. Neither adds a missing key."""
    code = f"import json\nVERSION = {version!r}\n" + TOUCH
    result = realsrc.run_snippet(code, None, timeout=60).check()
    line = next(x for x in result.stdout.splitlines() if x.startswith("RESULT "))
    got = json.loads(line[len("RESULT ") :])
    assert got["order"] == ["b", "a"], got
    assert got["order_first"] is got["own_adds"], got
    assert got["own_adds"] is (version == "0.23.0"), got
