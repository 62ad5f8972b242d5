"""The drift guard's state belongs to the guard: two guards share none of it, and the
guard's reset puts every piece of it back as built (the objects stay, so wrappers that
hold them keep reading the guard's own state)."""

from __future__ import annotations

import gc
import weakref

from cachetools import LRUCache

from vllm_mmcache_fix.drift_guard.fix import DriftGuard
from vllm_mmcache_fix.drift_guard.journal import Journal, Shadow
from vllm_mmcache_fix.drift_guard.state import SITE_NAMES, Sites


class Held:
    """A weakly referenceable stand-in for a request's processed inputs."""


def test_two_guards_share_no_state() -> None:
    first, second = DriftGuard(), DriftGuard()
    a, b = first.state, second.state
    assert a is not b
    for name in ("stats", "pending", "attempts", "shadows", "drift_limiter", "lock"):
        assert getattr(a, name) is not getattr(b, name), name
    assert a.errors is first.errors and b.errors is second.errors
    assert a.sites.apply.errors is first.errors

    held = Held()
    a.pending.register(held, None, lambda: None)
    a.attempts.open_slot(held)
    a.stats.bump("journals")
    assert a.pending.pending() == 1 and a.attempts.attempts()["open"] == 1
    assert b.pending.pending() == 0 and b.attempts.attempts()["open"] == 0
    assert b.stats.as_dict()["journals"] == 0 and b.pending.take(held) is None


def test_the_guard_reset_empties_its_state_in_place() -> None:
    guard = DriftGuard()
    st = guard.state
    pending, attempts, stats = st.pending, st.attempts, st.stats
    held = Held()
    pending.register(held, None, lambda: None)
    attempts.open_slot(held)
    stats.bump("commits")
    shadow = Shadow(LRUCache(maxsize=8))
    st.add_shadow(shadow)
    st.tracking = True
    st.patched = {"sender": "x.Y"}

    guard.uninstall()

    assert (st.pending, st.attempts, st.stats) == (pending, attempts, stats)
    assert pending.pending() == 0 and attempts.attempts()["open"] == 0
    assert stats.as_dict()["commits"] == 0
    assert st.live_shadows() == [] and not st.tracking and st.patched == {}


def test_a_dropped_input_is_deferred_in_its_own_guard() -> None:
    first, second = DriftGuard(), DriftGuard()
    shadow = Shadow(LRUCache(maxsize=8))
    held = Held()
    first.state.pending.register(held, Journal(shadow), None)
    ref = weakref.ref(held)
    del held
    gc.collect()
    assert ref() is None
    assert first.state.pending.has_deferred()
    assert not second.state.pending.has_deferred()
    first.state.pending.drain_deferred()
    assert not first.state.pending.has_deferred() and first.state.pending.pending() == 0


def test_every_site_name_has_one_place() -> None:
    assert list(SITE_NAMES) == list(Sites._fields)
    sites = DriftGuard().state.sites
    assert [s.name for s in sites] == list(SITE_NAMES.values())


def test_an_optional_method_of_an_older_shape_is_left_alone_and_the_rest_is_patched() -> None:
    # vLLM 0.10.0's lookup takes (cache, mm_data_items, hf_processor_mm_kwargs,
    # tokenization_kwargs): no mm_hashes. It is left as it is; the processor's other
    # methods are still wrapped (a mismatch of a required one undoes the target).
    from vllm_mmcache_fix.core import registry
    from vllm_mmcache_fix.drift_guard.fix import patch_id
    from vllm_mmcache_fix.vllm_layout import DRIFT_TARGETS

    class BaseMultiModalProcessor:
        def apply(self, *args: object, **kwargs: object) -> None: ...

        def _merge_mm_kwargs(
            self, cache: object, mm_hashes: object, mm_is_cached: object, **kwargs: object
        ) -> None: ...

        def _get_cache_missing_items(
            self,
            cache: object,
            mm_data_items: object,
            hf_processor_mm_kwargs: object,
            tokenization_kwargs: object,
        ) -> None: ...

    lookup = BaseMultiModalProcessor.__dict__["_get_cache_missing_items"]
    target = next(t for t in DRIFT_TARGETS if t.name == "processor")
    guard = DriftGuard()
    try:
        assert guard._patch(target, BaseMultiModalProcessor) is None
        assert registry.is_patched(BaseMultiModalProcessor, "apply")
        assert registry.is_patched(BaseMultiModalProcessor, "_merge_mm_kwargs")
        assert BaseMultiModalProcessor.__dict__["_get_cache_missing_items"] is lookup
    finally:
        registry.revert_patch(patch_id("processor"))
    assert not registry.is_patched(BaseMultiModalProcessor, "apply")
