"""Wrappers of the API server's sender cache: vLLM's call, then the shadow's bookkeeping.

Each wrapper reads what it needs before vLLM's call and updates the shadow
after it, each in a guarded block (:mod:`vllm_mmcache_fix.core.guard`); vLLM's
call itself is never inside one. The shadow's lock spans the three so that
"before", vLLM's change and "after" are seen together by other threads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..core import registry
from ..core.guard import Site
from ..core.signatures import require_prefix
from ..vllm_layout import SENDER_LRU_ATTR
from .context import scope, sent_without_data
from .journal import Shadow
from .owns import patch_id
from .state import GuardState

PATCH_ID = patch_id("sender")
SHADOW_ATTR = "_mmcache_fix_drift"
_UNSUPPORTED = False  # stored in the instance when its cache cannot be tracked


def check_lru(lru: Any) -> str | None:
    if lru is None:
        return f"no {SENDER_LRU_ATTR} attribute"
    for name in ("_Cache__data", "_LRUCache__order"):
        if not hasattr(lru, name):
            return f"{type(lru).__name__} has no {name}"
    if not hasattr(lru._LRUCache__order, "move_to_end"):
        return f"{type(lru).__name__}._LRUCache__order is not an OrderedDict"
    for name in ("pop", "popitem", "getsizeof", "currsize", "maxsize"):
        if not hasattr(lru, name):
            return f"{type(lru).__name__} has no {name}"
    return None


def _attach(st: GuardState, sender: Any) -> Shadow | None:
    s_evict = st.sites.evict
    s_evict_before = st.sites.evict_before
    lru = getattr(sender, SENDER_LRU_ATTR, None)
    reason = check_lru(lru)
    if lru is None or reason is not None:
        registry.set_instance_attr(PATCH_ID, sender, SHADOW_ATTR, _UNSUPPORTED)
        st.fix.note(f"sender cache not tracked: {reason}")
        return None
    shadow = Shadow(lru)
    cls_popitem = type(lru).popitem

    def popitem(*args: Any, **kwargs: Any) -> Any:
        with s_evict_before:
            if shadow.alive:
                # A key a rollback left behind newer ones is evicted in its turn.
                shadow.settle_front()
        key, value = cls_popitem(lru, *args, **kwargs)
        with s_evict:
            if shadow.alive:
                shadow.on_evict(key, value, scope().journal)
        return key, value

    registry.set_instance_attr(PATCH_ID, lru, "popitem", popitem)
    registry.set_instance_attr(PATCH_ID, sender, SHADOW_ATTR, shadow)
    st.add_shadow(shadow)
    st.tracking = True
    return shadow


def detach(st: GuardState, shadow: Shadow) -> None:
    """Stop tracking one cache: vLLM's (fixed) eviction and no bookkeeping from now on."""
    shadow.alive = False
    registry.revert_instance_attr(shadow.lru, "popitem")
    st.discard_shadow(shadow)


def shadow_of(st: GuardState, sender: Any) -> Shadow | None:
    """The live shadow of ``sender``, attaching one to a patched sender class on first use."""
    if not st.installed or st.switched_off is not None:
        return None
    try:
        shadow = sender.__dict__.get(SHADOW_ATTR)
    except AttributeError:
        return None
    if shadow is None:
        # Only instances of the patched sender classes: a processor-only or
        # shared-memory cache passed to the same processor is left alone.
        if not isinstance(sender, st.sender_types):
            return None
        with st.lock:
            shadow = sender.__dict__.get(SHADOW_ATTR)
            if shadow is None:
                return _attach(st, sender)
    if not shadow or not shadow.alive:
        return None
    return shadow


def _live_shadow(site: Site, sender: Any) -> Shadow | None:
    """The shadow of an already tracked sender (no attaching), looked up in ``site``'s
    guarded block: None when that block fails too."""
    with site:
        try:
            shadow = sender.__dict__.get(SHADOW_ATTR)
        except AttributeError:
            return None
        return shadow if shadow and shadow.alive else None
    return None


def _sent_without_data(result: Any) -> bool:
    return isinstance(result, tuple) and len(result) == 2 and result[0] is None


# --------------------------------------------------------------------------- wrappers
# Each wrap_* takes vLLM's function and returns the replacement; it raises
# SignatureMismatch when vLLM's function does not take what the wrapper passes.


def _state(guard: Any, orig: Callable[..., Any], params: tuple[str, ...], what: str) -> GuardState:
    """The guard's state for a wrapper of ``what``, once vLLM's ``orig`` is known to take
    ``params`` first (SignatureMismatch otherwise)."""
    require_prefix(orig, params, what=what)
    state: GuardState = guard.state
    return state


def wrap_init(guard: Any, orig: Callable[..., None]) -> Callable[..., None]:
    st: GuardState = guard.state
    s_init = st.sites.sender_init

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        orig(self, *args, **kwargs)
        with s_init:
            shadow_of(st, self)
            st.fix.announce()

    return __init__


def wrap_is_cached_item(guard: Any, orig: Callable[[Any, Any], bool]) -> Callable[[Any, Any], bool]:
    st = _state(guard, orig, ("self", "mm_hash"), "is_cached_item")
    s_is_cached = st.sites.is_cached

    def is_cached_item(self: Any, mm_hash: Any) -> bool:
        shadow = _live_shadow(s_is_cached, self) if st.live else None
        if shadow is None:
            return orig(self, mm_hash)
        # vLLM's answer and the guard's correction are read together: a rollback on the
        # event loop may remove the key in between (vLLM would then send a key it no
        # longer holds as cached: "Expected a cached item").
        with shadow.lock:
            hit = orig(self, mm_hash)
            if hit:
                with s_is_cached:
                    if shadow.alive:
                        ctx = scope()
                        if shadow.looks_uncached(mm_hash, ctx.journal):
                            if sent_without_data(ctx.lookup, mm_hash):
                                # No data to send (the client gave only its UUID): a
                                # miss would fail the request. vLLM's answer stands.
                                return hit
                            # Inserted or moved by a request that has not reached
                            # EngineCore yet, or doubtful: have the caller send the data.
                            st.stats.add("tentative_bypasses")
                            ctx.bypassed.add(mm_hash)
                            return False
        return hit

    return is_cached_item


def wrap_touch(guard: Any, orig: Callable[[Any, Any], None]) -> Callable[[Any, Any], None]:
    st = _state(guard, orig, ("self", "mm_hash"), "touch_sender_cache_item")
    s_touch_after = st.sites.touch_after
    s_touch_before = st.sites.touch_before

    def touch_sender_cache_item(self: Any, mm_hash: Any) -> None:
        shadow = None
        with s_touch_before:
            shadow = shadow_of(st, self)
        if shadow is None:
            return orig(self, mm_hash)
        with shadow.lock:
            before = None
            with s_touch_before:
                before = (mm_hash in shadow.lru._Cache__data, shadow.seq.get(mm_hash))
            orig(self, mm_hash)
            if before is not None and before[0]:
                with s_touch_after:
                    if shadow.alive and mm_hash in shadow.lru._Cache__data:
                        shadow.note_access(mm_hash, scope().journal, before[1])
        return None

    return touch_sender_cache_item


def wrap_get_and_update_item(
    guard: Any, orig: Callable[[Any, Any, Any], Any]
) -> Callable[..., Any]:
    st = _state(guard, orig, ("self", "mm_item", "mm_hash"), "get_and_update_item")
    s_update_after = st.sites.update_after
    s_update_before = st.sites.update_before

    def get_and_update_item(self: Any, mm_item: Any, mm_hash: Any) -> Any:
        shadow = None
        with s_update_before:
            shadow = shadow_of(st, self)
        if shadow is None:
            return orig(self, mm_item, mm_hash)
        with shadow.lock:
            before = None
            with s_update_before:
                ctx = scope()
                journal = ctx.journal
                # Data the guard asked for (it made the key look uncached) is sent
                # even where vLLM's cache would send None; nothing else changes.
                send_data = mm_item is not None and (
                    mm_hash in ctx.bypassed or shadow.looks_uncached(mm_hash, journal)
                )
                before = (
                    journal,
                    mm_hash in shadow.lru._Cache__data,
                    shadow.seq.get(mm_hash),
                    send_data,
                )
            result = orig(self, mm_item, mm_hash)
            if before is None:
                return result
            with s_update_after:
                if not shadow.alive:
                    return result
                journal, present, prev, send_data = before
                if mm_hash in shadow.lru._Cache__data:
                    shadow.note_update(mm_hash, journal, present, prev, mm_item is not None)
                if _sent_without_data(result):
                    if send_data:
                        return mm_item
                    if journal is not None:
                        journal.sent_without_data += 1
        return result

    return get_and_update_item


def wrap_clear_cache(guard: Any, orig: Callable[[Any], None]) -> Callable[[Any], None]:
    st = _state(guard, orig, ("self",), "clear_cache")
    s_clear = st.sites.clear

    def clear_cache(self: Any) -> None:
        shadow = _live_shadow(s_clear, self)
        if shadow is None:
            return orig(self)
        with shadow.lock:
            orig(self)
            with s_clear:
                if shadow.alive:
                    shadow.reset()
        return None

    return clear_cache


def wrap_invalidate(guard: Any, orig: Callable[[Any, Any], None]) -> Callable[[Any, Any], None]:
    st = _state(guard, orig, ("self", "mm_hash"), "invalidate")
    s_invalidate = st.sites.invalidate

    def invalidate(self: Any, mm_hash: Any) -> None:
        shadow = _live_shadow(s_invalidate, self)
        if shadow is None:
            return orig(self, mm_hash)
        with shadow.lock:
            orig(self, mm_hash)
            with s_invalidate:
                if shadow.alive:
                    shadow.forget(mm_hash)
                    st.stats.add("engine_reported_misses")
        return None

    return invalidate


WRAPPERS: tuple[tuple[str, Callable[[Any, Any], Any]], ...] = (
    ("__init__", wrap_init),
    ("is_cached_item", wrap_is_cached_item),
    ("touch_sender_cache_item", wrap_touch),
    ("get_and_update_item", wrap_get_and_update_item),
    ("clear_cache", wrap_clear_cache),
    ("invalidate", wrap_invalidate),
)
