"""vLLM 0.34.0's read-before-insert, on the release's own code, with and without the plugin.

0.34.0 adds ``LRUCache.peek`` and ``get_cached_item(mm_hash)`` on the sender caches, and its
``BaseMultiModalProcessor._merge_mm_kwargs`` reads every hit through ``get_cached_item``
before it inserts the same request's misses. The code under test is the release's own:
its ``LRUCache``, its cache classes and its ``_merge_mm_kwargs``, executed from the released
files by :mod:`harness.release_code`, and the plugin's fixes installed on them the way they
install in a server (found by ``vllm_layout``, patched by feature detection).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from typing import Any

import pytest

from harness import realsrc, release_code
from vllm_mmcache_fix import drift_guard as drift
from vllm_mmcache_fix import vllm_layout
from vllm_mmcache_fix.drift_guard import GUARD
from vllm_mmcache_fix.lru_eviction import cache as fixed_cache
from vllm_mmcache_fix.lru_eviction.fix import LruEvictionFix

ITEM = 100_000
"""Bytes per image; every cache below holds three and a half."""

NEWEST = realsrc.VERSIONS[-1]
BEFORE = "0.33.0"
"""The last release whose ``_merge_mm_kwargs`` inserts before it reads."""


def _has_peek(version: str) -> bool:
    cls = realsrc.top_level_class(
        realsrc.parse_release_file(version, realsrc.lru_source_relpath(version)), "LRUCache"
    )
    return cls is not None and realsrc.class_method(cls, "peek") is not None


def _reads_before_insert(version: str) -> bool:
    """``_merge_mm_kwargs`` calls ``get_cached_item`` before its first insert."""
    _, _, func = release_code.merge_function(version)
    calls = {
        c.func.attr: c.lineno
        for c in sorted(
            (n for n in ast.walk(func) if isinstance(n, ast.Call)),
            key=lambda c: -c.lineno,  # keep the first line of each name
        )
        if isinstance(c.func, ast.Attribute)
    }
    reads = calls.get("get_cached_item")
    return (
        reads is not None
        and reads < calls["touch_sender_cache_item"] < calls["get_and_update_item"]
    )


# --------------------------------------------------------------------------- release facts


def test_peek_and_read_before_insert_arrive_in_0_34_0() -> None:
    """Which releases have them (read off every fetched release with a sender cache)."""
    newer = [v for v in realsrc.VERSIONS if realsrc.version_key(v) >= (0, 34)]
    assert [v for v in realsrc.VERSIONS if _has_peek(v)] == newer
    with_sender = [v for v in realsrc.VERSIONS if realsrc.version_key(v) >= (0, 10, 2)]
    assert [v for v in with_sender if _reads_before_insert(v)] == newer


def test_get_cached_item_on_the_0_34_0_caches() -> None:
    """Only the processor-only cache keeps a payload: the LRU sender answers None, always."""
    code = release_code.load(NEWEST)
    assert "get_cached_item" not in code.sender_cls.__dict__
    sender = code.sender_cls(code.config(3.5 * ITEM))
    only = code.only_cls(code.config(3.5 * ITEM))
    for cache in (sender, only):
        assert cache.get_cached_item("absent") is None
        cache.get_and_update_item((release_code.image("a", ITEM), ["upd-a"]), "a")
    assert sender.get_cached_item("a") is None
    item, updates = only.get_cached_item("a")
    assert item["mm_hash"] == "a" and updates == ["upd-a"]


# --------------------------------------------------------------------------- peek


def _front(cache: Any, key: str, value: Any = None, *, data_only: bool = False) -> None:
    """Plant an order-only key (a ghost) or a data-only key at the oldest end."""
    if data_only:
        cache.put(key, value)
        del cache._LRUCache__order[key]
    else:
        cache._LRUCache__order[key] = None
        cache._LRUCache__order.move_to_end(key, last=False)


@pytest.mark.parametrize("fixed", [False, True], ids=["vllm", "fixed"])
def test_peek_on_a_ghost_key(fixed: bool) -> None:
    base = realsrc.load_lru_module(NEWEST).LRUCache
    cls = fixed_cache.fixed_lru_class(base) if fixed else base
    cache = cls(3, getsizeof=lambda v: 1)
    cache.put("a", 1)
    cache.put("b", 2)
    _front(cache, "ghost")
    before = (list(cache._LRUCache__order), cache.stat())
    repairs = fixed_cache.STATS.total()
    assert cache.peek("ghost") is None
    assert cache.peek("ghost", "default") == "default"
    # No order, stats or repair: peek reads the data dict only, on either class.
    assert (list(cache._LRUCache__order), cache.stat()) == before
    assert fixed_cache.STATS.total() == repairs
    if fixed:
        assert cls.peek is base.peek
        cache.put("c", 3)
        cache.put("d", 4)  # over capacity: the fixed eviction drops the ghost, then "a"
        assert list(cache._LRUCache__order) == ["b", "c", "d"]
        assert cache._Cache__data == {"b": 2, "c": 3, "d": 4}


@pytest.mark.parametrize("fixed", [False, True], ids=["vllm", "fixed"])
def test_peek_on_a_data_only_key(fixed: bool) -> None:
    base = realsrc.load_lru_module(NEWEST).LRUCache
    cls = fixed_cache.fixed_lru_class(base) if fixed else base
    cache = cls(3, getsizeof=lambda v: 1)
    cache.put("a", 1)
    _front(cache, "orphan", 7, data_only=True)
    before = list(cache._LRUCache__order)
    assert cache.peek("orphan") == 7  # the data, though eviction cannot see the key
    assert list(cache._LRUCache__order) == before == ["a"]
    if fixed:
        cache.put("b", 2)
        cache.put("c", 3)  # over capacity: the orphan is restored to the order and evicted
        assert cache._Cache__data == {"a": 1, "b": 2, "c": 3}
        assert list(cache._LRUCache__order) == ["a", "b", "c"]


# --------------------------------------------------------------------------- the plugin on it


@pytest.fixture
def plugin(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Install the release's modules, then the eviction fix and the drift guard on them."""
    monkeypatch.delenv("MMCACHE_FIX_MODE", raising=False)
    monkeypatch.delenv(drift.ENV_DRIFT, raising=False)
    fixes: list[Any] = []

    def start(version: str, *, with_plugin: bool) -> release_code.ReleaseCode:
        code = release_code.install(version)
        if with_plugin:
            lru_fix = LruEvictionFix()
            lru_fix.install()
            fixes.append(lru_fix)
            status = drift.install()
            fixes.append(drift)
            assert lru_fix.status()["installed"], lru_fix.status()
            assert set(status["patched"]) == {"sender", "processor", "process_inputs"}, status
        return code

    try:
        yield start
    finally:
        for fix in reversed(fixes):
            fix.uninstall()
        release_code.remove()


def _run(code: release_code.ReleaseCode, cache: Any, images: str) -> list[str] | str:
    """One request through the release's ``_merge_mm_kwargs`` and the commit point:
    what each image sent (``data`` or ``none``), or vLLM's error."""
    processor = code.processor_cls(cache)
    try:
        mm_kwargs, _ = processor.apply([(h, ITEM) for h in images])
    except AssertionError as exc:
        return f"AssertionError: {exc}"
    code.input_processor_cls().process_inputs(images, {"mm_kwargs": mm_kwargs}, None)
    return ["none" if item is None else "data" for item in mm_kwargs["image"]]


def _consistent(cache: Any) -> bool:
    lru = cache._cache
    return set(lru._LRUCache__order) == set(lru._Cache__data) and lru.currsize == sum(
        lru.getsizeof(v) for v in lru._Cache__data.values()
    )


@pytest.mark.parametrize("with_plugin", [False, True], ids=["vllm", "plugin"])
@pytest.mark.parametrize("version", [BEFORE, NEWEST])
def test_processor_only_cache_hit_evicted_by_its_own_misses(
    plugin: Any, version: str, with_plugin: bool
) -> None:
    """Three misses then a hit, in a cache of three and a half: the misses evict the hit.

    0.33.0 fails the request (``Expected a cached item``); 0.34.0 serves the hit from what
    it read first. The plugin changes neither answer and leaves the fixed cache consistent.
    """
    code = plugin(version, with_plugin=with_plugin)
    assert code.only_cls is not None
    cache = code.only_cls(code.config(3.5 * ITEM))
    assert fixed_cache.is_fixed(cache._cache) is with_plugin
    assert _run(code, cache, "ab") == ["data", "data"]
    got = _run(code, cache, "cdea")
    if version == BEFORE:
        assert got == "AssertionError: Expected a cached item for mm_hash='a'"
        assert list(cache._cache._LRUCache__order) == ["c", "d", "e"]
    else:
        assert got == ["data", "data", "data", "data"]
        assert list(cache._cache._LRUCache__order) == ["d", "e", "a"]
    assert _consistent(cache)
    assert _run(code, cache, "ea") == ["data", "data"]
    assert _consistent(cache)


@pytest.mark.parametrize("version", [BEFORE, NEWEST])
def test_sender_hit_evicted_by_its_own_misses(plugin: Any, version: str) -> None:
    """The LRU sender keeps no payload, so 0.34.0 still fails such a request, as 0.33.0 did.

    Without the plugin the failed request leaves ``c d e`` in the API server's shadow,
    though EngineCore never received them: the next request sends them without data (a
    cache miss in EngineCore). With the plugin, the drift guard rolls the failed request
    back and the next request sends their data.
    """
    outcomes = {}
    for with_plugin in (False, True):
        code = plugin(version, with_plugin=with_plugin)
        sender = code.sender_cls(code.config(3.5 * ITEM))
        first = _run(code, sender, "ab")
        failed = _run(code, sender, "cdea")
        after = _run(code, sender, "cde")
        outcomes[with_plugin] = (first, failed, after, _consistent(sender))
        if with_plugin and version == NEWEST:
            for name in vllm_layout.SENDER_READ_METHODS:  # read-only: left as vLLM's
                code_obj = getattr(code.sender_cls, name).__code__
                assert code_obj.co_filename == str(realsrc.source_file(version, code.factory.file))
        if with_plugin:
            assert drift.status()["switched_off"] is None
            assert drift.status()["counts"]["rollbacks"] >= 1, drift.status()["counts"]
            assert GUARD.state.pending.pending() == 0
        drift.uninstall()
        release_code.remove()
    error = "AssertionError: Expected a cached item for mm_hash='a'"
    assert outcomes[False] == (["data", "data"], error, ["none", "none", "none"], True)
    assert outcomes[True] == (["data", "data"], error, ["data", "data", "data"], True)


def _sequence(
    code: release_code.ReleaseCode, requests: list[str], rejected: int | None
) -> list[str]:
    sender = code.sender_cls(code.config(3.5 * ITEM))
    sent = []
    for i, images in enumerate(requests):
        processor = code.processor_cls(sender)
        mm_kwargs, _ = processor.apply([(h, ITEM) for h in images])
        try:
            code.input_processor_cls().process_inputs(
                str(i), {"mm_kwargs": mm_kwargs}, None, reject=(i == rejected)
            )
        except ValueError:
            sent.append("rejected")
            continue
        sent.append("".join("-" if x is None else "D" for x in mm_kwargs["image"]))
        assert _consistent(sender)
    return sent


REQUESTS = ["ab", "abc", "cd", "ad", "bcd", "a", "dcb", "bd", "c"]


@pytest.mark.parametrize("version", [BEFORE, NEWEST])
def test_a_rejected_request_leaves_no_trace(plugin: Any, version: str) -> None:
    """With the plugin, a request rejected after processing ("cd") changes nothing that
    later requests send: they send what vLLM sends when that request never came."""
    code = plugin(version, with_plugin=False)
    reference = _sequence(code, [r for i, r in enumerate(REQUESTS) if i != 2], None)
    release_code.remove()
    code = plugin(version, with_plugin=True)
    got = _sequence(code, REQUESTS, 2)
    assert got == [*reference[:2], "rejected", *reference[2:]]
    assert drift.status()["counts"]["rollbacks"] == 1


def test_both_releases_send_the_same(plugin: Any) -> None:
    """The LRU sender keeps no payload: 0.34.0's read-before-insert changes nothing it sends."""
    runs = []
    for version in (BEFORE, NEWEST):
        code = plugin(version, with_plugin=True)
        runs.append(_sequence(code, REQUESTS, 2))
        drift.uninstall()
        release_code.remove()
    assert runs[0] == runs[1]
