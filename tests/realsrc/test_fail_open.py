"""Fail-open: an exception inside the plugin's own bookkeeping never fails a request.

The eviction fix's sites on vLLM's own factory and released ``LRUCache`` (end of file);
the drift guard's below.

Each guarded site of the drift guard is made to fail in turn (the same switch,
``MMCACHE_FIX_FAIL_AT``, that the real-server test uses), and so is each
piece of its algorithm, half-way through its work. The simulated server runs
on the real ``LRUCache`` of a released vLLM; with the fault, every request
that succeeds without the plugin must succeed with it, the internal error must
be counted and logged, and the guard must be switched off for good.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator

import pytest

from harness import drift_sim
from harness.layouts import run_snippet, write_layout
from vllm_mmcache_fix import drift_guard as drift
from vllm_mmcache_fix import plugin
from vllm_mmcache_fix.core.messages import INTERNAL_ERROR
from vllm_mmcache_fix.drift_guard import attempts, journal, pending, recovery

pytestmark = pytest.mark.realsrc

LRU_VERSION = "0.24.0"  # touch() adds no ghost keys: the baseline must not freeze

# Sites only a drift (recovery) reaches; the rest are reached by prevention.
RECOVERY_SITES = {"sender.invalidate", "generate:retry", "generate:retry_output"}


@pytest.fixture
def modules(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict]:
    monkeypatch.delenv(drift.ENV_DRIFT, raising=False)
    mods = drift_sim.install_modules(LRU_VERSION)
    try:
        yield mods
    finally:
        drift.uninstall()
        drift.GUARD.errors.reload_faults(frozenset())
        drift_sim.remove_modules()


def _plan(seed: int = 3) -> list[tuple[list[str], bool]]:
    rng = random.Random(seed)
    pool = [f"img{i}" for i in range(7)]
    plan = [(["x"], True), (["x"], False), (["x"], False)]
    for _ in range(60):
        plan.append((rng.sample(pool, rng.choice([1, 1, 2])), rng.random() < 0.25))
    return plan


def _run(modules: dict, new_style: bool) -> list[int]:
    world = drift_sim.World(modules, capacity=4, new_style=new_style)

    async def go() -> list[int]:
        out = []
        for i, (images, long) in enumerate(_plan()):
            out.append(await world.request(images, long))
            if i == 20:
                _processing_that_raises(modules, world)
                world.sender.clear_cache()
                world.receiver._cache.clear()
        return out

    return asyncio.run(go())


def _processing_that_raises(modules: dict, world: drift_sim.World) -> None:
    """vLLM's own processing raising inside the journaled call (vLLM's error, not ours)."""
    with pytest.raises(AssertionError):
        world.processor._merge_mm_kwargs(
            world.sender,
            mm_hashes={"image": ["never-cached"]},
            mm_is_cached={"image": [True]},
            mm_missing_kwargs={"image": []},
            mm_missing_prompt_updates={"image": []},
        )


def _no_worse(baseline: list[int], got: list[int]) -> None:
    worse = [i for i, (b, g) in enumerate(zip(baseline, got)) if b == 200 and g != 200]
    assert not worse, f"requests {worse} succeed without the plugin but not with it: {got}"
    assert sum(s >= 500 for s in got) <= sum(s >= 500 for s in baseline)


def _all_sites() -> list[str]:
    # Importing the plugin defines every site; list them from the error book itself.
    assert plugin.DRIFT_GUARD.errors is drift.GUARD.state.errors
    return sorted(drift.GUARD.errors.sites)


def test_every_wrapper_has_guarded_sites() -> None:
    names = set(_all_sites())
    for wrapper in (
        "sender.__init__",
        "sender.evict",
        "sender.is_cached_item",
        "sender.touch_sender_cache_item:before",
        "sender.touch_sender_cache_item:after",
        "sender.get_and_update_item:before",
        "sender.get_and_update_item:after",
        "sender.clear_cache",
        "sender.invalidate",
        "processor.apply",
        "processor._get_cache_missing_items",
        "processor._merge_mm_kwargs:before",
        "processor._merge_mm_kwargs:after",
        "processor._merge_mm_kwargs:failed",
        "process_inputs:before",
        "process_inputs:after",
        "process_inputs:failed",
        "generate:start",
        "generate:first_output",
        "generate:retry",
        "generate:retry_output",
    ):
        assert wrapper in names


@pytest.mark.parametrize("site", _all_sites())
def test_a_failing_site_never_fails_a_request(modules, monkeypatch, caplog, site: str) -> None:
    new_style = site in RECOVERY_SITES
    if new_style:
        monkeypatch.setenv(drift.ENV_DRIFT, "recover")
    baseline = _run(modules, new_style)
    drift.install()
    drift.GUARD.errors.reload_faults(frozenset({site}))
    with caplog.at_level("WARNING", logger="vllm.mmcache_fix"):
        got = _run(modules, new_style)
    _no_worse(baseline, got)
    st = drift.status()
    assert st["internal_errors"].get(site, 0) >= 1, f"{site} was never reached"
    assert st["switched_off"] is not None and site in st["switched_off"]
    assert st["tracking"] is False
    lines = [r.getMessage() for r in caplog.records if INTERNAL_ERROR in r.getMessage()]
    assert len(lines) == 1 and site in lines[0], lines
    # Switched off for good: nothing is tracked any more, vLLM's cache is left alone.
    assert not list(drift.GUARD.state.shadows) and drift.GUARD.state.pending.pending() == 0


def _raise_after(target: object, name: str):
    original = getattr(target, name)

    def broken(*args, **kwargs):
        original(*args, **kwargs)  # the work is done half-way (or fully) ...
        raise RuntimeError(f"bug in {name}")  # ... and then the plugin's code raises

    return broken


INTERNALS = [
    (journal.Shadow, "note_access"),
    (journal.Shadow, "note_update"),
    (journal.Shadow, "looks_uncached"),
    (journal.Shadow, "on_evict"),
    (journal.Shadow, "rollback"),
    (journal.Shadow, "commit"),
    (journal.Shadow, "reset"),
    (pending.PendingTable, "register"),
    (pending.PendingTable, "records_of"),
    (attempts.AttemptTable, "note_attempt"),
    (recovery, "is_error_without_tokens"),
]


@pytest.mark.parametrize(
    ("owner", "name"), INTERNALS, ids=[f"{getattr(o, '__name__', o)}.{n}" for o, n in INTERNALS]
)
@pytest.mark.parametrize("new_style", [False, True])
def test_a_bug_half_way_through_the_bookkeeping(
    modules, monkeypatch, owner, name, new_style: bool
) -> None:
    if name == "is_error_without_tokens":
        monkeypatch.setenv(drift.ENV_DRIFT, "recover")
    baseline = _run(modules, new_style)
    drift.install()
    monkeypatch.setattr(owner, name, _raise_after(owner, name))
    got = _run(modules, new_style)
    _no_worse(baseline, got)
    st = drift.status()
    assert sum(st["internal_errors"].values()) >= 1
    assert st["switched_off"] is not None
    assert drift.GUARD.state.live is False


def test_without_a_fault_the_guard_is_better_than_vllm(modules) -> None:
    """The same plan: the baseline has 500s, the working guard none (the comparison above
    is therefore not vacuous)."""
    baseline = _run(modules, False)
    drift.install()
    got = _run(modules, False)
    assert any(s >= 500 for s in baseline)
    assert not any(s >= 500 for s in got)
    assert drift.status()["internal_errors"] == {}


# --------------------------------------------------------------------------- eviction fix
# Its two guarded sites, each made to fail (MMCACHE_FIX_FAIL_AT) in a fresh interpreter,
# on vLLM's own factory and the real released LRUCache of each factory layout: the cache
# the factory builds must serve every request as it does without the fault, the ghost must
# not hang it, and the site's internal-error counter must rise (0 without the fault).

LRU_LAYOUTS = {
    "package": ("0.33.0", "vllm.multimodal.cache.base"),
    "module": ("0.23.0", "vllm.multimodal.cache"),
}
LRU_SITES = ("lru.cache_built", "lru.repair_log")

REQUESTS = """
import {module} as m
import vllm_mmcache_fix
from vllm_mmcache_fix import plugin
vllm_mmcache_fix.register()
cache = m.MultiModalCache.get_lru_cache(1024 / (1 << 30), bytes)
served = 0
for i in range(30):  # requests: store an item, read it back, evict the oldest as it fills
    cache[f"item-{{i}}"] = b"x" * 100
    served += cache.get(f"item-{{i}}") == b"x" * 100
progress = ghost_sequence(cache)  # a ghost key at the eviction end, then more inserts
report(served=served, progress=progress, size=cache.currsize,
       errors=plugin.LRU_EVICTION.status()["internal_errors"],
       total=vllm_mmcache_fix.status()["internal_errors"])
"""


@pytest.mark.parametrize("site", LRU_SITES)
@pytest.mark.parametrize("layout", sorted(LRU_LAYOUTS))
def test_the_eviction_fix_fails_open_at_each_site(
    tmp_path, lru_source, layout: str, site: str
) -> None:  # type: ignore[no-untyped-def]
    version, module = LRU_LAYOUTS[layout]
    root = write_layout(tmp_path, layout, lru_source(version), version=version)
    code = REQUESTS.format(module=module)
    clean = run_snippet(root, code, timeout=120)
    faulty = run_snippet(root, code, env={"MMCACHE_FIX_FAIL_AT": site}, timeout=120)
    assert clean["errors"] == {} and clean["total"] == 0, clean
    assert faulty["served"] == clean["served"] == 30, faulty
    assert faulty["progress"] is True, faulty  # no hang on the ghost
    assert faulty["size"] <= 1024, faulty
    assert faulty["errors"].get(site, 0) >= 1 and faulty["total"] >= 1, faulty
    assert set(faulty["errors"]) == {site}, faulty
    assert any(INTERNAL_ERROR in line for _, _, line in faulty["logs"]), faulty["logs"]
