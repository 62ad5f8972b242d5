"""Wrap vLLM's multimodal cache factory.

The wrapper calls vLLM's own ``get_lru_cache`` (so capacity, ``getsizeof``
and debug handling stay vLLM's) and hands the cache it built to a callback:
in ``on`` mode the callback turns it into the fixed class, in ``warn`` mode it
only reads the capacity for the start-up check.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..core import registry
from ..core.signatures import SignatureMismatch, reader
from .locate import FACTORY, CacheFactory
from .owns import PATCH_FIX as PATCH_FIX

PATCH_OBSERVE = "mm-lru-observe"

# on_build(cache, capacity_gb) -> the cache to return to vLLM
OnBuild = Callable[[Any, "float | None"], Any]


CAPACITY_PARAM = "capacity_gb"
VALUE_TYPE_PARAM = "value_type"


def capacity_reader(func: Any, *, bound: bool, name: str = CAPACITY_PARAM) -> Any:
    """How to read ``capacity_gb`` from the factory's arguments, checked on its signature.

    The capacity only feeds the start-up warning: a factory without it gets the
    fix all the same, with the capacity unknown (None). ``value_type`` (the cache's role on
    ``/metrics``) is read the same way.
    """
    try:
        return reader(func, name, what=FACTORY, skip=1 if bound else 0)
    except SignatureMismatch:
        return None


def _capacity(arg: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> float | None:
    if arg is None:
        return None
    value = arg.get(args, kwargs)
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _guarded(
    on_build: OnBuild, on_error: Callable[[BaseException], None]
) -> Callable[[Any, float | None, Any], Any]:
    def call(cache: Any, capacity_gb: float | None, value_type: Any) -> Any:
        try:
            from . import stats  # with the first cache built: a worker builds none
            from .cache import is_fixed

            built = on_build(cache, capacity_gb)
            if is_fixed(built):
                stats.track(built, value_type)
            return built
        except Exception as exc:  # never fail vLLM's cache construction
            on_error(exc)
            return cache

    return call


def _value_type(arg: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return None if arg is None else arg.get(args, kwargs)


def wrapper_maker(
    factory: CacheFactory, on_build: OnBuild, on_error: Callable[[BaseException], None]
) -> Callable[[Any], Any]:
    """``make(func)`` for :func:`registry.wrap`: vLLM's factory function -> the wrapper."""
    handle = _guarded(on_build, on_error)
    bound = factory.kind == "classmethod"

    def make(func: Any) -> Any:
        position = capacity_reader(func, bound=bound)
        kind = capacity_reader(func, bound=bound, name=VALUE_TYPE_PARAM)
        if bound:

            def get_lru_cache(cls: type, *args: Any, **kwargs: Any) -> Any:
                cache = func(cls, *args, **kwargs)
                return handle(
                    cache, _capacity(position, args, kwargs), _value_type(kind, args, kwargs)
                )

            return get_lru_cache

        def get_lru_cache_static(*args: Any, **kwargs: Any) -> Any:
            cache = func(*args, **kwargs)
            return handle(cache, _capacity(position, args, kwargs), _value_type(kind, args, kwargs))

        return get_lru_cache_static

    return make


def wrap_factory(
    patch_id: str,
    factory: CacheFactory,
    on_build: OnBuild,
    on_error: Callable[[BaseException], None],
) -> bool:
    """Install the wrapper; False if a wrapper of this package is already there."""
    return registry.wrap(
        patch_id, factory.owner, FACTORY, wrapper_maker(factory, on_build, on_error)
    )
