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
