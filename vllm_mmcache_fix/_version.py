"""The plugin's version: :data:`BASE`, and before a release the commit it was built from.

Between releases :data:`BASE` is a development version (``0.3.0.dev0``) and every build
carries its commit: ``0.3.0.dev0+g1a2b3c4d5``. The build (``setup.py``) writes the version
into the wheel's copy of this file (:data:`BUILT`); run from a git checkout the version is
read from the checkout's ``.git`` (files only, no ``git`` process); anywhere else it is
:data:`BASE`. A release sets :data:`BASE` to the release number: no commit is added then.
"""

from __future__ import annotations

import os

BASE = "0.3.0.dev0"
BUILT: str | None = None
"""The version the wheel was built as (set in the wheel's copy only)."""


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    except OSError:
        return None


def _git_dir(root: str) -> str | None:
    dotgit = os.path.join(root, ".git")
    if os.path.isdir(dotgit):
        return dotgit
    text = _read(dotgit) if os.path.isfile(dotgit) else None  # a worktree: "gitdir: <path>"
    if text and text.startswith("gitdir:"):
        return os.path.join(root, text[len("gitdir:") :].strip())
    return None


def commit(root: str) -> str | None:
    """The commit checked out in the git checkout at ``root`` (None when there is none)."""
    git = _git_dir(root)
    head = _read(os.path.join(git, "HEAD")) if git else None
    if not git or not head:
        return None
    if head.startswith("ref:"):
        ref = head[len("ref:") :].strip()
        common = _read(os.path.join(git, "commondir"))
        bases = [git] + ([os.path.join(git, common)] if common else [])
        head = None
        for base in bases:
            head = _read(os.path.join(base, ref))
            if head:
                break
            for line in (_read(os.path.join(base, "packed-refs")) or "").splitlines():
                if line.endswith(" " + ref):
                    head = line.split(" ", 1)[0]
                    break
            if head:
                break
    if not head or len(head) < 40 or any(c not in "0123456789abcdef" for c in head):
        return None
    return head


def of_checkout(root: str) -> str:
    """The version a build of the source tree at ``root`` gets."""
    if ".dev" not in BASE:
        return BASE
    sha = commit(root) if os.path.isfile(os.path.join(root, "pyproject.toml")) else None
    return f"{BASE}+g{sha[:9]}" if sha else BASE


def version() -> str:
    if BUILT:
        return BUILT
    return of_checkout(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
