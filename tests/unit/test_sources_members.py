"""What ``scripts/fetch-sources`` keeps of a vLLM wheel comes from ``vllm_layout``."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from harness import sources
from vllm_mmcache_fix import vllm_layout as lay


def _kept(path: str) -> bool:
    return sources._VLLM_MEMBER_RE.fullmatch(path) is not None


def test_every_file_the_layout_names_is_extracted() -> None:
    files = [*lay.LRU_FILES, *(f.file for f in lay.FACTORY_LAYOUTS), lay.PLUGINS_MODULE_FILE]
    modules = [c.module for t in lay.DRIFT_TARGETS for c in t.candidates]
    modules.append(lay.ENGINE_CORE_CLASS.module)
    for module in modules:
        if module not in sources._NOT_EXTRACTED_MODULES:
            base = module.replace(".", "/")
            assert _kept(f"{base}.py") or _kept(f"{base}/__init__.py"), module
    for path in files:
        assert _kept(path), path


def test_a_module_that_became_a_package_is_extracted_whole() -> None:
    # vllm.multimodal.cache (0.10-0.30) became a package in 0.31 (cache/base.py, cache/lru.py).
    assert _kept("vllm/multimodal/cache.py") and _kept("vllm/multimodal/cache/lru.py")
    assert _kept("vllm/multimodal/cache/some_new_module.py")
    assert not _kept("vllm/v1/engine/some_other_module.py")
    assert not _kept("vllm/v1/engine/async_llm.py")


def test_a_new_candidate_in_the_layout_changes_the_extraction(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    moved = lay.ClassLayout("vllm.multimodal.sender_cache", "SenderCache", "0.99+")
    sender = lay.DRIFT_TARGETS[0]
    changed = (sender.__class__(sender.name, (moved, *sender.candidates), sender.required),)
    monkeypatch.setattr(lay, "DRIFT_TARGETS", changed + lay.DRIFT_TARGETS[1:])
    members = sources.layout_members()
    assert re.escape("vllm/multimodal/sender_cache.py") in members


def test_a_tree_extracted_under_the_same_rules_before_is_current(tmp_path: Path) -> None:
    older = sources.SAME_RULES[sources.VLLM_LAYOUT]
    assert older and sources.VLLM_LAYOUT not in older
    marker = tmp_path / sources.MARKER
    for layout, current in [(older[0], True), (sources.VLLM_LAYOUT, True), ("0" * 12, False)]:
        marker.write_text(json.dumps({"layout": layout}))
        assert sources.is_complete(tmp_path, sources.VLLM_LAYOUT) is current, layout
