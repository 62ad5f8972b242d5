"""The other Pythons' realsrc subset: one release per layout of ``vllm_layout``."""

from __future__ import annotations

import re

from harness import pythons, sources
from vllm_mmcache_fix import vllm_layout


def _key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split("."))


def _in(version: str, releases: str) -> bool:
    """Whether ``version`` lies in a layout row's range: ``A``, ``A+``, ``A-B`` (``B`` a
    series such as ``0.30``: every patch release of it)."""
    v = _key(version)
    if releases.endswith("+"):
        return v >= _key(releases[:-1])
    low, _, high = releases.partition("-")
    high = high or low
    return _key(low) <= v and v[: len(_key(high))] <= _key(high)


def _rows() -> list[str]:
    rows = [layout.releases for layout in vllm_layout.FACTORY_LAYOUTS]
    for target in vllm_layout.DRIFT_TARGETS:
        rows += [c.releases for c in target.candidates]
    # LRUCache's file (0.11.1 moved it) and touch() adding ghost keys (up to 0.23).
    return rows + ["0.10.0-0.11.0", "0.11.1+", "0.10.0-0.23", "0.24+"]


def test_every_layout_row_has_a_release_in_the_subset() -> None:
    rows = _rows()
    assert all(re.fullmatch(r"[\d.]+(\+|-[\d.]+)?", r) for r in rows), rows
    for row in rows:
        assert any(_in(v, row) for v in pythons.LAYOUT_RELEASES), row
    assert set(pythons.LAYOUT_RELEASES) <= set(sources.VLLM_VERSIONS)


def test_the_subset_leaves_out_the_other_releases_only() -> None:
    expr = pythons.realsrc_deselect(pythons.LAYOUT_RELEASES)
    left_out = set(expr.removeprefix("not (").removesuffix(")").split(" or "))
    assert left_out == set(sources.VLLM_VERSIONS) - set(pythons.LAYOUT_RELEASES)
    # No kept release's id contains a left-out one (-k matches substrings).
    for kept in pythons.LAYOUT_RELEASES:
        assert not any(other in f"[{kept}-" for other in left_out), kept


def test_python_3_9_runs_the_releases_that_run_there() -> None:
    files, releases = pythons.realsrc_subset("3.9")
    assert releases == pythons.OLD_PYTHON_RELEASES
    assert all(_key(v) <= (0, 11, 0) for v in releases)
    # Each layout those releases have: the static factory, the sender cache, 0.11.0.
    for row in ("0.10.0", "0.10.1.1-0.30", "0.10.2-0.30", "0.10.0-0.11.0"):
        assert any(_in(v, row) for v in releases), row
    assert set(files) <= set(pythons.REALSRC_FILES)
    assert pythons.realsrc_subset("3.13") == (pythons.REALSRC_FILES, pythons.LAYOUT_RELEASES)
