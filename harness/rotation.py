"""The rotating part of CI: which few of many long cases this commit runs.

CI runs one (or ``n``) of a long list of real-server cases per commit, chosen from the
commit's hash, so successive commits walk the list; the whole list runs in its own
resumable program. ``$MMCACHE_HARNESS_ROTATE_KEY`` overrides the key (to rerun one choice).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from typing import TypeVar

from harness import commits

T = TypeVar("T")
KEY_ENV = "MMCACHE_HARNESS_ROTATE_KEY"
SOAKS = ("sequential", "concurrent")
"""The soaks of tests/soak (one per commit in CI)."""


def rotate(pool: Sequence[T], n: int = 1, key: str | None = None) -> list[T]:
    """``n`` distinct entries of ``pool`` chosen by ``key`` (default: this commit)."""
    if key is None:
        key = os.environ.get(KEY_ENV) or commits.head()
    seed = int(hashlib.sha256(key.encode()).hexdigest(), 16)
    left = list(pool)
    chosen: list[T] = []
    while left and len(chosen) < n:
        chosen.append(left.pop(seed % len(left)))
        seed //= len(left) + 1
    return chosen


class UnknownCase(ValueError):
    """An environment variable names a case its pool does not have."""


def this_turn(pool: Sequence[str], env: str) -> list[str]:
    """The cases of ``pool`` this run takes: ``$env`` names them (``all``: every one),
    else one chosen by :func:`rotate`.

    A name not in ``pool`` raises :class:`UnknownCase` (a misspelt name must not quietly
    select nothing: the tests it was meant to run would all skip)."""
    wanted = os.environ.get(env, "").replace(",", " ").split()
    if wanted == ["all"]:
        return list(pool)
    unknown = [w for w in wanted if w not in pool]
    if unknown:
        raise UnknownCase(
            f"{env}={os.environ.get(env)!r}: unknown {', '.join(map(repr, unknown))}; "
            f"name one or more of {', '.join(pool)}, or 'all'"
        )
    return wanted or rotate(pool)


ROTATE_ENV = "MMCACHE_HARNESS_ROTATE"


def per_commit(pool: Sequence[T]) -> list[T]:
    """One case of ``pool`` per commit (:func:`rotate`); every case with
    ``MMCACHE_HARNESS_ROTATE=off``."""
    if os.environ.get(ROTATE_ENV, "").strip().lower() in ("off", "0", "no"):
        return list(pool)
    return rotate(pool)
