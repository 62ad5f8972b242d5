"""Registry of what this process patched, keeping the originals.

The first original wins: patching twice never loses the real vLLM attribute,
and ``revert`` always puts back what vLLM defined.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

# Set on every replacement this package installs.
PATCH_MARKER = "__mmcache_fix_patch__"


@dataclass(frozen=True)
class Applied:
    patch_id: str
    owner: type
    attr: str
    original: Any
    """The raw class attribute vLLM defined (a classmethod/staticmethod object)."""
    replacement: Any

    @property
    def target(self) -> str:
        return f"{self.owner.__module__}.{self.owner.__qualname__}.{self.attr}"


_lock = threading.RLock()
_applied: dict[tuple[type, str], Applied] = {}


def _raw(owner: type, attr: str) -> Any:
    return owner.__dict__.get(attr)


def _func_of(raw: Any) -> Any:
    return getattr(raw, "__func__", raw)


def is_patched(owner: type, attr: str) -> bool:
    return bool(getattr(_func_of(_raw(owner, attr)), PATCH_MARKER, False))


def get_original(owner: type, attr: str) -> Any:
    """vLLM's own attribute, whether or not it is patched now."""
    with _lock:
        entry = _applied.get((owner, attr))
        return entry.original if entry is not None else _raw(owner, attr)


def apply(patch_id: str, owner: type, attr: str, replacement: Any) -> bool:
    """Install ``replacement``; False when this patch is already in place."""
    with _lock:
        if (owner, attr) in _applied or is_patched(owner, attr):
            return False
        original = _raw(owner, attr)
        setattr(_func_of(replacement), PATCH_MARKER, patch_id)
        setattr(owner, attr, replacement)
        _applied[(owner, attr)] = Applied(patch_id, owner, attr, original, replacement)
        return True


def revert(owner: type, attr: str) -> bool:
    with _lock:
        entry = _applied.pop((owner, attr), None)
        if entry is None:
            return False
        setattr(owner, attr, entry.original)
        return True


def revert_all() -> list[Applied]:
    with _lock:
        entries = list(_applied.values())
        for entry in entries:
            revert(entry.owner, entry.attr)
        return entries


def applied() -> list[Applied]:
    with _lock:
        return list(_applied.values())
