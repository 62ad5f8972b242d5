"""The layout table (``vllm_layout``) holds on the real sources of every release."""

from __future__ import annotations

import ast

import pytest

from harness import realsrc
from vllm_mmcache_fix import vllm_layout

VERSIONS = realsrc.VERSIONS


def _file_of(module: str, version: str) -> str | None:
    for rel in (module.replace(".", "/") + ".py", module.replace(".", "/") + "/__init__.py"):
        if realsrc.has_file(version, rel):
            return rel
    return None


def _class_with(version: str, module: str, cls: str, methods: tuple[str, ...]) -> bool:
    rel = _file_of(module, version)
    if rel is None:
        return False
    node = realsrc.top_level_class(realsrc.parse_release_file(version, rel), cls)
    return node is not None and all(realsrc.class_method(node, m) for m in methods)


@pytest.mark.parametrize("version", VERSIONS)
def test_one_factory_layout_matches(version: str) -> None:
    matches = [
        c
        for c in vllm_layout.FACTORY_LAYOUTS
        if realsrc.has_file(version, c.file)
        and _class_with(version, c.module, c.owner, (vllm_layout.MM_CACHE_FACTORY,))
    ]
    assert len(matches) == 1, (version, matches)


@pytest.mark.parametrize("version", VERSIONS)
def test_lru_class_is_in_one_of_the_listed_files(version: str) -> None:
    files = [
        f
        for f in vllm_layout.LRU_FILES
        if realsrc.has_file(version, f)
        and realsrc.top_level_class(realsrc.parse_release_file(version, f), "LRUCache")
    ]
    assert files, version


# async_llm.py is not among the extracted files; the generate target is checked on
# installed builds.
CHECKED_TARGETS = [t for t in vllm_layout.DRIFT_TARGETS if t.name != "generate"]


# The API server keeps a sender cache (the shadow the drift guard tracks) from 0.10.2;
# 0.10.0 and 0.10.1.1 process multimodal items with one ProcessingCache in P0 only.
FIRST_SENDER = (0, 10, 2)


@pytest.mark.parametrize("target", CHECKED_TARGETS, ids=lambda t: t.name)
@pytest.mark.parametrize("version", VERSIONS)
def test_drift_targets_exist_on_releases_with_a_sender_cache(version: str, target) -> None:
    if target.name == "sender" and realsrc.version_key(version) < FIRST_SENDER:
        assert not any(_class_with(version, c.module, c.cls, ()) for c in target.candidates), (
            version
        )
        return
    found = [c for c in target.candidates if _class_with(version, c.module, c.cls, target.required)]
    assert found, (version, target.name)


FIRST_UUID_ONLY = (0, 11, 0)
"""The first release whose cache lookup accepts an item without data (a UUID only)."""


@pytest.mark.parametrize("version", VERSIONS)
def test_the_lookup_that_fails_an_item_without_data_is_the_one_the_guard_wraps(
    version: str,
) -> None:
    """The drift guard makes pending and doubtful keys look uncached so their data is sent;
    it keeps vLLM's answer for an item that came without data, which it learns from the
    processor's ``_get_cache_missing_items(cache, mm_data_items, mm_hashes)``: the method
    that asks the sender cache and raises for a missing item whose data is None."""
    target = next(t for t in vllm_layout.DRIFT_TARGETS if t.name == "processor")
    method = "_get_cache_missing_items"
    assert method in target.optional
    found = []
    for candidate in target.candidates:
        rel = _file_of(candidate.module, version)
        node = (
            None
            if rel is None
            else realsrc.top_level_class(realsrc.parse_release_file(version, rel), candidate.cls)
        )
        func = None if node is None else realsrc.class_method(node, method)
        if func is not None:
            found.append(func)
    if realsrc.version_key(version) < FIRST_UUID_ONLY:
        assert all("data is not provided" not in ast.unparse(f) for f in found), version
        return
    assert len(found) == 1, version
    func = found[0]
    params = [a.arg for a in func.args.args]
    assert params[:1] == ["self"] and {"cache", "mm_data_items", "mm_hashes"} <= set(params)
    text = ast.unparse(func)
    assert "cache.is_cached(" in text and "data is None" in text, version
    assert "raise ValueError" in text, version
