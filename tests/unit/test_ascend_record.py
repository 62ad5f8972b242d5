"""The newest vllm-ascend read (``scripts/ascend-release``, ``compat/ascend.json``) and what the
README tells an Ascend user agree."""

from __future__ import annotations

import json
import re

from harness.paths import REPO_ROOT
from harness.readme import guide_blocks

RECORD = json.loads((REPO_ROOT / "compat" / "ascend.json").read_text())
NEWEST = RECORD["releases"][0]


def test_the_plugins_rule_lists_every_entry_point_of_the_newest_release() -> None:
    rule = guide_blocks()["plugins-filter"][1]
    match = re.search(r"VLLM_PLUGINS=(\S+)", rule)
    assert match is not None
    names = match.group(1).split(",")
    eps = NEWEST["entry_points"]
    vllm_groups = {g: v for g, v in eps.items() if g.startswith("vllm.")}
    assert vllm_groups["vllm.platform_plugins"] == ["ascend"]
    expected = [*vllm_groups["vllm.platform_plugins"], *vllm_groups["vllm.general_plugins"]]
    assert sorted(names) == sorted([*expected, "mmcache_fix"])


def test_the_newest_release_leaves_what_the_plugin_hooks_alone() -> None:
    touches = NEWEST["names_what_the_plugin_touches"]
    assert touches["multimodal_caches"] == [] and touches["health"] == []
    # It subclasses EngineCoreProc, but overrides none of the busy-loop methods.
    assert NEWEST["engine_core_proc_subclasses"]
    assert all(methods == [] for methods in NEWEST["engine_core_proc_subclasses"].values())


def test_the_readme_names_the_newest_pair_read() -> None:
    readme = (REPO_ROOT / "README.md").read_text()
    flat = " ".join(readme.split())
    assert f"newest pre-release checked, {NEWEST['vllm_ascend']}" in flat
    assert f"builds on vLLM {NEWEST['vllm']}" in flat
