"""Repairs are counted only for states that would stall vLLM, on every cachetools release.

``mmcache_fix_cache_repairs_total`` is an alert: it must count a ghost or orphan that
is really there, not another thread half-way through an insert or a delete (cachetools
writes the data and the order in two steps). Each case pauses a real thread at that
point (a trace function at the return of ``cachetools.Cache.__setitem__`` or
``__delitem__``), lets it go on only once the other thread has started its call, and
keeps the interpreter from switching threads on its own (a long switch interval), so
the other thread sees the half-done state for certain.

Also here: the drift guard's own removals (``Shadow._drop``, reached by rollbacks and
recovery) of a key that has data but no order entry. cachetools 7+ no longer gives
such a key an order entry when it is read, so vLLM's ``pop`` removes the data and then
raises ``KeyError``; the guard must remove it cleanly and stay on.

Each cachetools release of :data:`harness.sources.CACHETOOLS_VERSIONS` runs in a child
interpreter (``realsrc.run_snippet``) with the real ``LRUCache`` of vLLM 0.23.0 (whose
``touch`` adds missing keys) and the newest release.
"""

from __future__ import annotations

import json

import pytest

from harness import realsrc
from vllm_mmcache_fix.catalogue import NEWEST_SOURCES_CHECKED as NEWEST

CT_VERSIONS = list(realsrc.CACHETOOLS_VERSIONS)
VLLM_VERSIONS = ("0.23.0", NEWEST)

_HALF_DONE = r"""
import json, sys, threading
import cachetools
from harness import realsrc
from vllm_mmcache_fix.lru_eviction import cache as fixed_cache

sys.setswitchinterval(30.0)  # threads switch only where one waits
cls = fixed_cache.fixed_lru_class(realsrc.load_lru_module(sys.argv[1]).LRUCache)


def new_cache():
    cache = cls(4, getsizeof=len)
    for key in "abc":
        cache[key] = "x"
    return cache


def half_done(op, stop_at):
    # Run op() in a thread that stops right after stop_at (a cachetools function)
    # returns; returns (thread, go, errors).
    reached, go, errors = threading.Event(), threading.Event(), []

    def tracer(frame, event, arg):
        if event == "call" and frame.f_code is stop_at.__code__:
            def local(frame, event, arg):
                if event == "return":
                    reached.set()
                    go.wait(10)
                return local
            return local
        return None

    def target():
        sys.settrace(tracer)
        try:
            op()
        except Exception as exc:
            errors.append(repr(exc))
        finally:
            sys.settrace(None)

    thread = threading.Thread(target=target)
    thread.start()
    assert reached.wait(10)
    return thread, go, errors


def case(name, op, stop_at, other):
    before = fixed_cache.STATS.total()
    cache = new_cache()
    thread, go, errors = half_done(lambda: op(cache), stop_at)
    go.set()  # it may go on once this thread lets it
    other(cache)
    thread.join(10)
    order, data = list(cache._LRUCache__order), list(cache._Cache__data)
    return name, {
        "repairs": fixed_cache.STATS.total() - before,
        "errors": errors,
        "in_step": order == data,
        "keys": sorted(data),
    }


def put(key, value):
    return lambda cache: cache.__setitem__(key, value)


out = dict([
    # An insert between its data and its order entry; another insert evicts meanwhile.
    case("insert_while_evicting", put("d", "x"), cachetools.Cache.__setitem__, put("e", "x")),
    # The same insert; another thread touches the key meanwhile.
    case("insert_while_touched", put("d", "x"), cachetools.Cache.__setitem__,
         lambda cache: cache.touch("d")),
    # A delete between removing the data and the order entry; an insert evicts meanwhile.
    case("delete_while_evicting", lambda cache: cache.pop("a"), cachetools.Cache.__delitem__,
         put("e", "xxx")),
])

# Real disagreements are still repaired and counted.
before = fixed_cache.STATS.total()
cache = new_cache()
order = cache._LRUCache__order
order["ghost"] = None
order.move_to_end("ghost", last=False)
del order["c"]
cache["e"] = "xx"
out["planted"] = {
    "repairs": fixed_cache.STATS.total() - before,
    "in_step": list(order) == list(cache._Cache__data),
    "keys": sorted(cache._Cache__data),
}
print(json.dumps(out))
"""


def _run(code: str, ct: str, *args: str) -> dict:
    try:
        realsrc.cachetools_path(ct)
    except realsrc.SourcesUnavailable as exc:
        pytest.skip(str(exc))
    res = realsrc.run_snippet(code, ct, args=list(args), timeout=120).check()
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("version", VLLM_VERSIONS)
@pytest.mark.parametrize("ct", CT_VERSIONS)
def test_a_half_done_insert_or_delete_is_not_a_repair(ct: str, version: str) -> None:
    out = _run(_HALF_DONE, ct, version)
    # The insert of "d" completes; the eviction takes the oldest real item ("a").
    assert out["insert_while_evicting"] == {
        "repairs": 0,
        "errors": [],
        "in_step": True,
        "keys": ["b", "c", "d", "e"],
    }
    assert out["insert_while_touched"] == {
        "repairs": 0,
        "errors": [],
        "in_step": True,
        "keys": ["a", "b", "c", "d"],
    }
    # The delete of "a" completes without an error; the eviction takes "b", the oldest.
    assert out["delete_while_evicting"] == {
        "repairs": 0,
        "errors": [],
        "in_step": True,
        "keys": ["c", "e"],
    }
    assert out["planted"]["repairs"] == 2  # the ghost dropped, "c" given its entry back
    assert out["planted"]["in_step"]


_GUARD_DROPS = r"""
import asyncio, json, sys
from harness import drift_sim
from vllm_mmcache_fix import drift_guard as drift
from vllm_mmcache_fix.drift_guard import journal

lru_cls = drift_sim.realsrc.load_lru_module(sys.argv[1]).LRUCache
out = {}

# The shadow on its own: invalidate (recovery) and rollback (rejection) of a data-only key.
lru = lru_cls(8)
for key in "abc":
    lru[key] = 1
shadow = journal.Shadow(lru)
del lru._LRUCache__order["b"]
errors = []
try:
    out["invalidated"] = shadow.invalidate(["b"])
except Exception as exc:
    errors.append(repr(exc))
pending = journal.Journal(shadow)
lru["d"] = 1
shadow.note_update("d", pending, False, None, True)
del lru._LRUCache__order["d"]
try:
    out["rolled_back"] = shadow.rollback(pending).removed
except Exception as exc:
    errors.append(repr(exc))
out["shadow_errors"] = errors
out["shadow_left"] = [sorted(lru._Cache__data), list(lru._LRUCache__order)]

# The guard around the simulated server: a rejected request whose inserted key lost
# its order entry meanwhile.
modules = drift_sim.install_modules(sys.argv[1])
drift.install()
world = drift_sim.World(modules)
prompt = world.render(["x"], text_len=100)
del world.sender._cache._LRUCache__order["x"]


async def submit():
    try:
        async for _ in world.engine.generate(prompt, None, "r"):
            pass
    except ValueError:
        return 400
    return 200


out["status"] = asyncio.run(submit())
status = drift.status()
out["switched_off"] = status["switched_off"]
out["counts"] = {k: status["counts"][k] for k in ("rollbacks", "rollback_keys_removed")}
out["p0"] = [sorted(world.p0_keys()), world.p0_order()]
out["next"] = asyncio.run(world.request(["x"]))
print(json.dumps(out))
"""


@pytest.mark.parametrize("ct", CT_VERSIONS)
def test_the_guard_removes_a_data_only_key_cleanly(ct: str) -> None:
    out = _run(_GUARD_DROPS, ct, NEWEST)
    assert out["shadow_errors"] == []
    # Invalidated: kept (doubtful: sent with data next); rolled back: removed cleanly.
    assert out["invalidated"] == 1 and out["rolled_back"] == 1
    assert out["shadow_left"] == [["a", "b", "c"], ["a", "c"]]
    assert out["status"] == 400
    assert out["switched_off"] is None
    assert out["counts"] == {"rollbacks": 1, "rollback_keys_removed": 1}
    assert out["p0"] == [[], []]
    assert out["next"] == 200
