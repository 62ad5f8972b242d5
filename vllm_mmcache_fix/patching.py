"""Wrap vLLM's multimodal cache factory.

The wrapper calls vLLM's own ``get_lru_cache`` (so capacity, ``getsizeof``
and debug handling stay vLLM's) and hands the cache it built to a callback:
in ``on`` mode the callback turns it into the fixed class, in ``warn`` mode it
only reads the capacity for the start-up check.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from . import registry
from .locate import FACTORY, CacheFactory

PATCH_FIX = "mm-lru-eviction"
PATCH_OBSERVE = "mm-lru-observe"

# on_build(cache, capacity_gb) -> the cache to return to vLLM
OnBuild = Callable[[Any, "float | None"], Any]


def _capacity(args: tuple[Any, ...], kwargs: dict[str, Any]) -> float | None:
    value = args[0] if args else kwargs.get("capacity_gb")
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _guarded(on_build: OnBuild, on_error: Callable[[BaseException], None]) -> OnBuild:
    def call(cache: Any, capacity_gb: float | None) -> Any:
        try:
            return on_build(cache, capacity_gb)
        except Exception as exc:  # never fail vLLM's cache construction
            on_error(exc)
            return cache

    return call


def build_wrapper(
    factory: CacheFactory, on_build: OnBuild, on_error: Callable[[BaseException], None]
) -> Any:
    raw = factory.owner.__dict__[FACTORY]
    func = raw.__func__
    handle = _guarded(on_build, on_error)

    if factory.kind == "classmethod":

        @functools.wraps(func)
        def get_lru_cache(cls: type, *args: Any, **kwargs: Any) -> Any:
            return handle(func(cls, *args, **kwargs), _capacity(args, kwargs))

        return classmethod(get_lru_cache)

    @functools.wraps(func)
    def get_lru_cache_static(*args: Any, **kwargs: Any) -> Any:
        return handle(func(*args, **kwargs), _capacity(args, kwargs))

    return staticmethod(get_lru_cache_static)


def wrap_factory(
    patch_id: str,
    factory: CacheFactory,
    on_build: OnBuild,
    on_error: Callable[[BaseException], None],
) -> bool:
    """Install the wrapper; False if a wrapper of this package is already there."""
    if registry.is_patched(factory.owner, FACTORY):
        return False
    return registry.apply(
        patch_id, factory.owner, FACTORY, build_wrapper(factory, on_build, on_error)
    )
