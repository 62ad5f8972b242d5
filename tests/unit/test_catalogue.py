"""The catalogue, the code and patches/ say the same thing."""

from __future__ import annotations

import json

from harness.paths import REPO_ROOT as REPO
from vllm_mmcache_fix import catalogue, drift, locate, patching


def test_every_patch_the_code_can_apply_is_catalogued() -> None:
    ids = {spec.id for spec in catalogue.CATALOGUE}
    code_ids = {patching.PATCH_FIX} | {f"{drift.PATCH_PREFIX}-{t.name}" for t in drift.TARGETS}
    assert ids == code_ids


def test_factory_targets_match_locate() -> None:
    spec = catalogue.by_id(patching.PATCH_FIX)
    expected = tuple(f"{module}.{owner}.{locate.FACTORY}" for module, owner, _ in locate.CANDIDATES)
    assert spec.targets == expected


def test_drift_targets_match_drift_module() -> None:
    for target in drift.TARGETS:
        spec = catalogue.by_id(f"{drift.PATCH_PREFIX}-{target.name}")
        classes = [f"{module}.{cls}" for module, cls in target.candidates]
        assert len(spec.targets) == len(classes), (spec.targets, classes)
        for text, cls in zip(spec.targets, classes):
            assert text == cls or text.startswith(cls + "."), (text, cls)


def test_rows_with_source_patches_have_diffs_and_the_rest_none() -> None:
    index = json.loads((REPO / "patches" / "index.json").read_text())
    for spec in catalogue.CATALOGUE:
        assert spec.source_patches is (spec.id == index["fix"]), spec.id
    for entry in index["patches"]:
        assert index["fix"] in entry["file"]
        assert (REPO / "patches" / entry["file"]).is_file()


def test_every_row_is_complete() -> None:
    for spec in catalogue.CATALOGUE:
        assert spec.targets and spec.why and spec.upstream and spec.removal, spec.id
