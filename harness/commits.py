"""The commits a record names: the checkout's, and the last one that changed the plugin.

A record proves the plugin as it was at :func:`package` (the last commit that changed
``vllm_mmcache_fix``): commits that touch only the harness, the tests or the documents do
not make it stale, and a resumable program skips what is recorded for that commit.
:func:`stamp` adds ``+dirty`` when the package has uncommitted changes, for the records
that say so. Outside a git checkout every function answers empty (or False): a record
then names no commit, and the programs still run.
"""

from __future__ import annotations

import subprocess

from harness.paths import REPO_ROOT

PACKAGE = "vllm_mmcache_fix"


def _git(*args: str) -> str:
    try:
        res = subprocess.run(
            ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        return ""
    return res.stdout.strip()


def head() -> str:
    """This checkout's commit."""
    return _git("rev-parse", "HEAD")


def package() -> str:
    """The last commit that changed the plugin package: what a record is valid for."""
    return _git("log", "-1", "--format=%H", "--", PACKAGE)


def package_dirty() -> bool:
    """The package has uncommitted changes (a record then names the last commit)."""
    return bool(_git("status", "--porcelain", "--", PACKAGE))


def stamp() -> str:
    """:func:`package`, with ``+dirty`` when the package has uncommitted changes."""
    return package() + ("+dirty" if package_dirty() else "")
