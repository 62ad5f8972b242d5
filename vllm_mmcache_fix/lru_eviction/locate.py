"""Find the factory that builds vLLM's multimodal LRU caches, across layouts.

Every multimodal LRU cache in vLLM is built by one small factory,
``get_lru_cache(capacity_gb, value_type, *, debug=False)``. Wrapping that
factory reaches the multimodal caches and nothing else: the LoRA and rope
caches build ``LRUCache`` directly.

Where it lives in each release is :data:`vllm_mmcache_fix.vllm_layout.FACTORY_LAYOUTS`.
The module is found by feature detection (the owner exists, has the factory,
and the factory's module names an ``LRUCache`` subclass of
``cachetools.LRUCache``), never by version string, so editable and ``.dev``
builds work.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

from ..core.records import frozen
from ..vllm_layout import FACTORY_LAYOUTS, FACTORY_WATCHED_MODULES, LRU_MODULES
from ..vllm_layout import MM_CACHE_FACTORY as FACTORY

WATCHED_MODULES = FACTORY_WATCHED_MODULES


@frozen
class CacheFactory:
    """Where ``get_lru_cache`` lives in the installed vLLM."""

    module: ModuleType
    owner: type
    kind: str  # "classmethod" or "staticmethod"
    layout: str
    lru_class: type | None

    @property
    def qualname(self) -> str:
        return f"{self.module.__name__}.{self.owner.__name__}.{FACTORY}"


class LayoutNotFound(LookupError):
    """No known layout matched; the message says what was looked for."""


def _describe(value: Any) -> str:
    return type(value).__name__


def locate_mm_cache_factory(*, import_modules: bool = False) -> CacheFactory:
    """Return the installed vLLM's multimodal cache factory.

    With ``import_modules=False`` only modules that are already imported are
    looked at, so this never imports vLLM by itself.
    """
    reasons: list[str] = []
    for candidate in FACTORY_LAYOUTS:
        module_name, owner_name, layout = candidate.module, candidate.owner, candidate.description
        module = _get_module(module_name, import_modules, reasons)
        if module is None:
            continue
        owner = getattr(module, owner_name, None)
        if not isinstance(owner, type):
            reasons.append(f"{module_name}: no class {owner_name}")
            continue
        # The owner must define the factory itself, not inherit it, so the
        # patch lands where vLLM looks it up.
        raw = owner.__dict__.get(FACTORY)
        if isinstance(raw, classmethod):
            kind = "classmethod"
        elif isinstance(raw, staticmethod):
            kind = "staticmethod"
        else:
            reasons.append(
                f"{module_name}.{owner_name}.{FACTORY}: "
                f"{'missing' if raw is None else _describe(raw)}"
            )
            continue
        if getattr(owner, "__module__", module_name) != module_name:
            # 0.31+ re-exports nothing here, but guard against a re-export
            # being mistaken for the definition.
            reasons.append(f"{module_name}.{owner_name}: defined in {owner.__module__}")
            continue
        return CacheFactory(
            module=module,
            owner=owner,
            kind=kind,
            layout=layout,
            lru_class=lru_class_of(module),
        )
    raise LayoutNotFound("; ".join(reasons))


def lru_class_of(module: ModuleType) -> type | None:
    """The ``LRUCache`` the factory's module builds, if it is a cachetools LRU."""
    cls = getattr(module, "LRUCache", None)
    if not isinstance(cls, type):
        return None
    try:
        import cachetools
    except ImportError:
        return None
    return cls if issubclass(cls, cachetools.LRUCache) else None


def locate_lru_class(*, import_modules: bool = False) -> type:
    """vLLM's ``LRUCache`` class: ``vllm.utils.cache`` (0.11.1+) or ``vllm.utils`` (earlier)."""
    reasons: list[str] = []
    for module_name in LRU_MODULES:
        module = _get_module(module_name, import_modules, reasons)
        if module is None:
            continue
        cls = lru_class_of(module)
        if cls is not None:
            return cls
        reasons.append(f"{module_name}: no cachetools-based LRUCache")
    raise LayoutNotFound("; ".join(reasons))


def _get_module(name: str, import_modules: bool, reasons: list[str]) -> ModuleType | None:
    module = sys.modules.get(name)
    if module is not None:
        return module
    if import_modules:
        return _try_import(name, reasons)
    reasons.append(f"{name}: not imported")
    return None


def _try_import(module_name: str, reasons: list[str]) -> ModuleType | None:
    import importlib

    try:
        return importlib.import_module(module_name)
    except ImportError as exc:
        reasons.append(f"{module_name}: {exc}")
    except Exception as exc:  # a broken vLLM install must not break the caller
        reasons.append(f"{module_name}: import failed with {exc!r}")
    return None
