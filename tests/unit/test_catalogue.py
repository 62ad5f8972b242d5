"""The catalogue, the code and patches/ say the same thing."""

from __future__ import annotations

import ast
import json

from harness.paths import REPO_ROOT as REPO
from vllm_mmcache_fix import catalogue, plugin, vllm_layout
from vllm_mmcache_fix.core.declaration import patch_ids
from vllm_mmcache_fix.drift_guard import fix as drift_fix
from vllm_mmcache_fix.lru_eviction import factory


def test_each_row_is_declared_by_the_fix_it_names() -> None:
    for declaration in plugin.declarations():
        for spec in declaration.patches:
            assert spec.fix == declaration.fix_id, spec.id
    ids = [spec.id for spec in catalogue.CATALOGUE]
    assert len(ids) == len(set(ids))


REGISTRY_CALLS = {"apply", "wrap", "set_instance_attr", "switch_class", "revert_patch"}


def test_the_code_names_its_patch_ids_by_their_declared_constants() -> None:
    """No ``registry`` call spells a patch id: each takes a name (the constant its fix's
    ``owns.py`` declares), so an id lives in one place."""
    spelled = []
    for path in sorted((REPO / "vllm_mmcache_fix").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in REGISTRY_CALLS
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "registry"
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                spelled.append(f"{path.name}:{node.lineno}")
    assert spelled == []


def test_the_declared_patch_ids_are_the_codes() -> None:
    assert factory.PATCH_FIX in patch_ids(plugin.declarations()[0])
    drift = {drift_fix.patch_id(t.name) for t in vllm_layout.DRIFT_TARGETS}
    assert drift == set(patch_ids(plugin.declarations()[1]))


def test_each_declaration_is_its_fixs() -> None:
    fixes = {fix.id: fix for fix in plugin.FIXES}
    assert [d.fix_id for d in plugin.declarations()] == list(fixes)


def test_each_row_names_its_fix_and_where_it_runs() -> None:
    fixes = {fix.id: fix for fix in plugin.FIXES}
    for spec in catalogue.CATALOGUE:
        assert spec.fix in fixes, spec.id
        assert spec.runs_in == fixes[spec.fix].runs_in, spec.id


def test_factory_targets_match_the_layout_table() -> None:
    spec = catalogue.by_id(factory.PATCH_FIX)
    expected = tuple(
        f"{c.module}.{c.owner}.{vllm_layout.MM_CACHE_FACTORY}" for c in vllm_layout.FACTORY_LAYOUTS
    )
    assert spec.targets == expected


def test_drift_targets_match_the_layout_table() -> None:
    for target in vllm_layout.DRIFT_TARGETS:
        spec = catalogue.by_id(drift_fix.patch_id(target.name))
        classes = [f"{c.module}.{c.cls}" for c in target.candidates]
        assert len(spec.targets) == len(classes), spec.id
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


def test_newest_sources_checked_is_the_newest_fetched_release() -> None:
    from harness import sources

    assert catalogue.NEWEST_SOURCES_CHECKED == sources.VLLM_VERSIONS[-1]


def test_newest_server_checked_is_the_newest_passing_matrix_row() -> None:
    from harness.programs import matrix

    passing = [v for v, rec in matrix.load()["releases"].items() if rec["status"] == "pass"]
    assert catalogue.NEWEST_SERVER_CHECKED == max(passing, key=matrix.version_key)


def test_release_coverage_says_what_was_proven() -> None:
    newest = catalogue.NEWEST_SOURCES_CHECKED
    assert "real server checked" in catalogue.release_coverage(catalogue.NEWEST_SERVER_CHECKED)
    assert "real server checked" in catalogue.release_coverage("0.23.0+empty")
    if newest != catalogue.NEWEST_SERVER_CHECKED:
        line = catalogue.release_coverage(newest)
        assert "released sources checked" in line and "real server" not in line.split("(")[0]
    next_patch = ".".join([*newest.split(".")[:2], str(int(newest.split(".")[2]) + 1)])
    for newer in ("0.99.0", "0.99.0rc1", "1.0.0.dev3+gabc", next_patch):
        line = catalogue.release_coverage(newer)
        assert f"newer than the newest release checked ({newest})" in line, newer
        assert "feature detection" in line
    assert "newer" not in catalogue.release_coverage(f"{newest}rc1")
