"""``check``'s view of ``VLLM_PLUGINS``: which installed plugin entry points it filters out.

The distributions are real ``.dist-info`` directories read by ``importlib.metadata``;
vllm-ascend's carries the ``entry_points.txt`` of the released vllm-ascend 0.23.0 wheel.
The real wheel itself: ``tests/installed/test_check_ascend_wheel.py``.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

import pytest

from vllm_mmcache_fix import vllm_layout
from vllm_mmcache_fix.tools.check import (
    parse_vllm_plugins,
    plugin_entry_points,
    vllm_plugin_groups,
)

ASCEND_0_23_0_ENTRY_POINTS = """\
[vllm.general_plugins]
ascend_kv_connector = vllm_ascend:register_connector
ascend_model = vllm_ascend:register_model
ascend_model_loader = vllm_ascend:register_model_loader
ascend_service_profiling = vllm_ascend:register_service_profiling

[vllm.platform_plugins]
ascend = vllm_ascend:register
"""
ASCEND_NAMES = [
    "ascend",
    "ascend_kv_connector",
    "ascend_model",
    "ascend_model_loader",
    "ascend_service_profiling",
]


def _dist(root: Path, name: str, version: str, entry_points: str) -> metadata.Distribution:
    info = root / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(entry_points)
    return metadata.PathDistribution(info)


@pytest.fixture
def dists(tmp_path: Path) -> list[metadata.Distribution]:
    return [
        _dist(tmp_path, "vllm_ascend", "0.23.0", ASCEND_0_23_0_ENTRY_POINTS),
        _dist(
            tmp_path,
            "vllm-mmcache-fix",
            "0.2.0",
            "[vllm.general_plugins]\nmmcache_fix = vllm_mmcache_fix:register\n",
        ),
        _dist(
            tmp_path,
            "some-endpoints",
            "1.0",
            "[vllm.endpoint_plugins]\nextra_routes = some:factory\n"
            "[console_scripts]\nsome = some:main\n",
        ),
        _dist(tmp_path, "future-thing", "1.0", "[vllm.new_kind_plugins]\nnewkind = x:y\n"),
    ]


GROUPS = [group for group, _ in vllm_layout.PLUGIN_GROUPS]


def _filtered(rows: list[dict]) -> list[tuple[str, str]]:
    return sorted((r["group"], r["name"]) for r in rows if not r["loads"])


def test_unset_loads_everything_but_endpoint_plugins(dists) -> None:
    rows = plugin_entry_points(GROUPS, parse_vllm_plugins(None), dists)
    assert len(rows) == 8  # console_scripts is not a vLLM group
    assert _filtered(rows) == [("vllm.endpoint_plugins", "extra_routes")]


def test_ascend_and_mmcache_fix_drops_the_four_general_ascend_plugins(dists) -> None:
    rows = plugin_entry_points(GROUPS, parse_vllm_plugins("ascend,mmcache_fix"), dists)
    dropped = [r for r in rows if not r["loads"] and r["vllm_ascend"]]
    assert sorted(r["name"] for r in dropped) == ASCEND_NAMES[1:]
    assert {r["group"] for r in dropped} == {"vllm.general_plugins"}
    assert {r["distribution"] for r in dropped} == {"vllm_ascend"}
    loads = {r["name"] for r in rows if r["loads"]}
    assert loads == {"ascend", "mmcache_fix"}
    assert ("vllm.new_kind_plugins", "newkind") in _filtered(rows)  # any vllm.* group


def test_the_full_rule_keeps_every_ascend_entry(dists) -> None:
    allowed = parse_vllm_plugins(",".join([*ASCEND_NAMES, "mmcache_fix"]))
    rows = plugin_entry_points(GROUPS, allowed, dists)
    assert not [r for r in rows if r["vllm_ascend"] and not r["loads"]]


def test_spaces_are_not_stripped_as_vllm_does_not(dists) -> None:
    rows = plugin_entry_points(GROUPS, parse_vllm_plugins("ascend, mmcache_fix"), dists)
    assert ("vllm.general_plugins", "mmcache_fix") in _filtered(rows)


def test_empty_string_filters_everything(dists) -> None:
    rows = plugin_entry_points(GROUPS, parse_vllm_plugins(""), dists)
    assert all(not r["loads"] for r in rows)


def test_groups_come_from_the_installed_plugins_module(tmp_path: Path) -> None:
    vllm_dir = tmp_path / "vllm"
    (vllm_dir / "plugins").mkdir(parents=True)
    (vllm_dir / "plugins" / "__init__.py").write_text(
        'DEFAULT_PLUGINS_GROUP = "vllm.general_plugins"\nX_GROUP = "vllm.shiny_plugins"\n'
    )
    groups = vllm_plugin_groups(str(vllm_dir))
    assert groups[: len(GROUPS)] == GROUPS and groups[-1] == "vllm.shiny_plugins"
    assert vllm_plugin_groups(None) == GROUPS


def test_first_distribution_on_the_path_wins(tmp_path: Path) -> None:
    first = _dist(tmp_path / "a", "vllm_ascend", "0.23.0", ASCEND_0_23_0_ENTRY_POINTS)
    second = _dist(tmp_path / "b", "vllm-ascend", "0.9.0", "[vllm.platform_plugins]\nold = x:y\n")
    rows = plugin_entry_points(GROUPS, None, [first, second])
    assert sorted(r["name"] for r in rows) == ASCEND_NAMES
