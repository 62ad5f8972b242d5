"""A wheel built twice in the same checkout: the second build finds the first one's
``build/lib`` copy of ``_version.py`` with its version already written (setuptools copies a
file again only when the checkout's is newer) and must still name its own version."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from harness.paths import REPO_ROOT


def _checkout(dest: Path) -> Path:
    """The repository's tracked files with its ``.git`` (the version names the commit)."""
    subprocess.run(["git", "clone", "-q", str(REPO_ROOT), str(dest)], check=True, timeout=120)
    return dest


def _build(tree: Path, out: Path) -> str:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(tree)],
        check=True,
        timeout=300,
    )
    (wheel,) = out.glob("vllm_mmcache_fix-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        text = zf.read("vllm_mmcache_fix/_version.py").decode()
    (line,) = [x for x in text.splitlines() if x.startswith("BUILT:")]
    return line


def test_a_second_build_in_the_same_tree(tmp_path: Path) -> None:
    tree = _checkout(tmp_path / "tree")
    first = _build(tree, tmp_path / "one")
    assert (tree / "build" / "lib").is_dir()  # what the second build meets
    second = _build(tree, tmp_path / "two")
    head = subprocess.run(
        ["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert first == second and f"+g{head[:9]}'" in second, (first, second)
    shutil.rmtree(tree)
