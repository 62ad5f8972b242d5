"""The summaries of the design stay true: the package docstring and the architecture table
name every fix of ``plugin.FIXES`` and every package of the tree, and nothing that is gone."""

from __future__ import annotations

import re
from pathlib import Path

import vllm_mmcache_fix
from harness.paths import REPO_ROOT
from vllm_mmcache_fix import plugin

PACKAGE = REPO_ROOT / "vllm_mmcache_fix"


def _feature_packages() -> set[str]:
    """Subpackages holding a fix (everything but the shared core and the tools)."""
    return {
        p.name
        for p in PACKAGE.iterdir()
        if (p / "__init__.py").is_file() and p.name not in ("core", "tools")
    }


def _fix_packages() -> set[str]:
    """The package each installed fix lives in, read from the fix objects themselves."""
    return {type(fix).__module__.split(".")[1] for fix in plugin.FIXES}


def _architecture_section() -> tuple[Path, str]:
    candidates = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
    for path in candidates:
        if not path.is_file():
            continue
        text = path.read_text()
        match = re.search(r"^(#+) Architecture\b.*?$(.*?)(?=^\1 |\Z)", text, re.M | re.S)
        if match:
            return path, match.group(2)
    raise AssertionError("no 'Architecture' section in README.md or docs/*.md")


def test_every_fix_lives_in_a_feature_package() -> None:
    assert _fix_packages() == _feature_packages()


def test_the_package_docstring_names_every_feature_package() -> None:
    doc = vllm_mmcache_fix.__doc__ or ""
    named = set(re.findall(r"``([a-z_]+)``:", doc))
    assert named == _feature_packages(), named


def test_the_architecture_table_names_every_package_and_nothing_gone() -> None:
    path, section = _architecture_section()
    named = set(re.findall(r"`([a-z_]+)/`", section))
    expected = _feature_packages() | {"core", "tools", "harness"}
    missing = expected - named
    assert not missing, f"{path.name}: Architecture does not name {sorted(missing)}"
    gone = {n for n in named - expected if not (REPO_ROOT / n).is_dir()}
    gone = {n for n in gone if not (PACKAGE / n).is_dir()}
    assert not gone, f"{path.name}: Architecture names packages that do not exist: {gone}"


def test_every_fix_says_where_it_runs_and_the_catalogue_agrees() -> None:
    from vllm_mmcache_fix import catalogue

    by_fix = {spec.fix: spec.runs_in for spec in catalogue.CATALOGUE}
    for fix in plugin.FIXES:
        assert fix.runs_in, fix.id
        if fix.id in by_fix:
            assert by_fix[fix.id] == fix.runs_in, fix.id
