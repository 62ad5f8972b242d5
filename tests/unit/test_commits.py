"""The commits records name (harness/commits.py)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from harness import commits
from harness.paths import REPO_ROOT


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()


def test_package_commit_is_the_last_that_changed_the_package() -> None:
    head, package = commits.head(), commits.package()
    assert re.fullmatch(r"[0-9a-f]{40}", head) and re.fullmatch(r"[0-9a-f]{40}", package)
    # An ancestor of HEAD (or HEAD itself), and nothing after it changed the package ...
    _git("merge-base", "--is-ancestor", package, head)
    assert _git("diff", "--name-only", package, head, "--", commits.PACKAGE) == ""
    # ... while the commit itself did.
    changed = _git("show", "--format=", "--name-only", package).splitlines()
    assert any(p.startswith(commits.PACKAGE + "/") for p in changed), changed


def test_stamp_says_dirty_only_with_uncommitted_package_changes() -> None:
    stamp = commits.stamp()
    assert stamp.removesuffix("+dirty") == commits.package()
    assert stamp.endswith("+dirty") == commits.package_dirty()


def test_outside_a_checkout_every_answer_is_empty(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(commits, "REPO_ROOT", tmp_path)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    assert (commits.head(), commits.package(), commits.stamp()) == ("", "", "")
    assert commits.package_dirty() is False
