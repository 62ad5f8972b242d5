"""``scripts/new-release``: what it compares comes from ``vllm_layout``, and it finds real changes.

The comparison runs on the released files the realsrc tier already has (0.33.0 and 0.34.0);
the full command (download, the tier, feature detection) is recorded in
``compat/release-checks/``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from harness import realsrc
from harness.programs import new_release
from vllm_mmcache_fix import vllm_layout
from vllm_mmcache_fix.drift_guard.fix import WRAPPERS


def test_what_it_compares_is_derived_from_the_layout_table() -> None:
    items = new_release.touched()
    labels = {t.label for t in items}
    for f in vllm_layout.FACTORY_LAYOUTS:
        assert f"{f.module}.{f.owner}" in labels
    for target in vllm_layout.DRIFT_TARGETS:
        for c in target.candidates:
            item = next(t for t in items if t.label == f"{c.module}.{c.cls}")
            assert set(target.required) <= set(item.names)
            assert {name for name, _ in WRAPPERS[target.name]} <= set(item.names)
    sender = next(t for t in items if t.cls == "LruKeyReplicatedSenderCache")
    assert set(vllm_layout.SENDER_READ_METHODS) <= set(sender.names)
    for cls in (vllm_layout.ENGINE_PROC_CLASS, vllm_layout.HEALTH_TARGET):
        assert f"{cls.module}.{cls.cls}" in labels
    proc = next(t for t in items if t.cls == vllm_layout.ENGINE_PROC_CLASS.cls)
    assert vllm_layout.BUSY_LOOP_DISPATCH in proc.names


def _touched_changes(old: str, new: str) -> dict[str, str]:
    changes = new_release.compare(realsrc.source_root(old), realsrc.source_root(new))
    return {c.where: c.what for c in changes if c.touched}


def test_finds_what_0_34_0_changed() -> None:
    got = _touched_changes("0.33.0", "0.34.0")
    assert got["vllm.utils.cache.LRUCache.peek"] == "added"
    merge = "vllm.multimodal.processing.processor.BaseMultiModalProcessor._merge_mm_kwargs"
    assert got[merge] == "changed"
    assert got["vllm.v1.engine.core.EngineCoreProc._process_input_queue"] == "changed"
    # The sender classes did not change: get_cached_item is inherited from the base class.
    assert not [w for w in got if "LruKeyReplicatedSenderCache" in w]


def test_a_release_against_itself_changes_nothing() -> None:
    assert _touched_changes("0.34.0", "0.34.0") == {}


def test_docstrings_do_not_count_and_code_does(tmp_path: Path) -> None:
    src = realsrc.source_root("0.34.0")
    rel = "vllm/utils/cache.py"
    for name in ("old", "doc", "code"):
        (tmp_path / name / rel).parent.mkdir(parents=True)
        shutil.copy(src / rel, tmp_path / name / rel)
    doc = tmp_path / "doc" / rel
    text = doc.read_text()
    marker = '"""Look up a value without copying the cache or updating order or stats."""'
    assert marker in text
    doc.write_text(text.replace(marker, '"""Reworded."""'))
    code = tmp_path / "code" / rel
    code.write_text(text.replace("return self._Cache__data.get(key, default)", "return default"))
    assert new_release.compare(tmp_path / "old", tmp_path / "doc") == []
    changed = new_release.compare(tmp_path / "old", tmp_path / "code")
    assert [(c.where, c.what, c.touched) for c in changed] == [
        ("vllm.utils.cache.LRUCache.peek", "changed", True)
    ]
    assert "-    return self._Cache__data.get(key, default)" in changed[0].diff


def test_an_unlisted_release_joins_the_tier_for_one_run() -> None:
    code = "from harness import sources; print(','.join(sources.VLLM_VERSIONS[-2:]))"
    env = {new_release.EXTRA_RELEASES_ENV: "9.9.9, 0.34.0,not-a-release"}
    res = realsrc.run_snippet(code, env=env).check()
    assert res.stdout.strip() == "0.34.0,9.9.9"
    assert "ignoring 'not-a-release' (not a release number)" in res.stderr
