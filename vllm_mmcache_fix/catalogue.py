"""What this package patches, why, and when each patch can go.

One row per patch, as data: what it patches, in which process it acts, why,
the upstream threads, and when it can be removed. Each fix declares its rows next to its
code (``<fix>/owns.py``); :data:`CATALOGUE` gathers them. ``tests/unit/test_catalogue.py``
keeps the rows, the code (``plugin.FIXES``, ``vllm_layout``) and the files under
``patches/`` in step.
"""

from __future__ import annotations

from .core.declaration import PatchSpec, lazy_attribute

TYPE_CHECKING = False

__all__ = ["CATALOGUE", "PatchSpec", "by_id", "release_coverage", "rows"]

NEWEST_SOURCES_CHECKED = "0.34.0"
"""The newest vLLM release whose released files the realsrc tier checks: every fix on its
real ``LRUCache``, every layout lookup, the source patch, the drift guard on its own cache
classes and ``_merge_mm_kwargs`` (``tests/unit/test_catalogue.py``: the newest release in
``harness/sources.py``)."""

NEWEST_SERVER_CHECKED = "0.33.0"
"""The newest vLLM release with a passing real-server row in ``compat/matrix.json``
(the incident without and with the plugin, drift, concurrent clients)."""


def _release_key(version: str) -> tuple[int, ...]:
    """``0.34.0`` -> (0, 34, 0); ``0.23.0+empty``, ``0.35.0rc1``, ``0.24.0.dev5+g1`` keep
    their leading numbers."""
    parts: list[int] = []
    for part in version.split("+")[0].split("."):
        digits = ""
        for char in part:
            if not char.isdigit():
                break
            digits += char
        if not digits:
            break
        parts.append(int(digits))
        if len(digits) != len(part):
            break
    return tuple(parts)


def release_coverage(version: str | None) -> str:
    """What this version of the package has proven about vLLM ``version``, in one line."""
    if not version:
        return (
            f"sources checked up to vLLM {NEWEST_SOURCES_CHECKED}, real servers up to "
            f"{NEWEST_SERVER_CHECKED}"
        )
    key = _release_key(version)
    if key and key <= _release_key(NEWEST_SERVER_CHECKED):
        return f"vLLM {version}: released sources and a real server checked"
    if key and key <= _release_key(NEWEST_SOURCES_CHECKED):
        return (
            f"vLLM {version}: released sources checked (real servers up to {NEWEST_SERVER_CHECKED})"
        )
    return (
        f"vLLM {version} is newer than the newest release checked "
        f"({NEWEST_SOURCES_CHECKED}): the plugin finds what it patches by feature "
        "detection and switches off any piece it cannot find; this check's own trials "
        "(layout, the eviction probe and the patched cache) ran on it, nothing else did"
    )


def rows() -> tuple[PatchSpec, ...]:
    """Every patch of every fix, in ``plugin.FIXES`` order."""
    from . import plugin

    return tuple(patch for d in plugin.declarations() for patch in d.patches)


__getattr__ = lazy_attribute(__name__, "CATALOGUE", rows)


if TYPE_CHECKING:
    CATALOGUE: tuple[PatchSpec, ...]
    """Every patch of every fix, in ``plugin.FIXES`` order (each fix declares its own in
    ``<fix>/owns.py``)."""


def by_id(patch_id: str) -> PatchSpec:
    for spec in rows():
        if spec.id == patch_id:
            return spec
    raise KeyError(patch_id)
