"""``check_compatible``, ``is_fixed``, ``upgrade``/``downgrade`` on each layout's own
``LRUCache``: an existing instance turned into the fixed class in place (what ``check``
does to prove the fix) and back; a release that lost a method the fix needs is refused.

Each release runs in a child interpreter with a deadline: a cache that was not upgraded
loops forever on the ghost key.
"""

from __future__ import annotations

import json

import pytest

from harness import realsrc

CODE = """
import json, sys, threading
from harness import realsrc
from vllm_mmcache_fix.lru_eviction.cache import check_compatible, downgrade, is_fixed, upgrade

LRU = realsrc.load_lru_module(sys.argv[1]).LRUCache
cache = LRU(4, getsizeof=lambda v: 1)
compatible = check_compatible(cache)
refused = {}
for name in ("popitem", "pop", "touch", "clear"):  # a release that lost one of them
    refused[name] = check_compatible(type("Changed", (LRU,), {name: None})(4))
for i in range(4):
    cache[f"k{i}"] = i
same = upgrade(cache) is cache
fixed_type = type(cache)
upgrade(cache)  # again: nothing changes
cache._LRUCache__order["ghost"] = None
cache._LRUCache__order.move_to_end("ghost", last=False)
for i in range(4, 12):
    cache[f"k{i}"] = i  # evicts past the ghost
out = {
    "compatible": compatible,
    "refused": refused,
    "class_fixed": is_fixed(fixed_type) and not is_fixed(LRU),
    "same": same,
    "fixed": is_fixed(cache),
    "idempotent": type(cache) is fixed_type,
    "subclass": issubclass(fixed_type, LRU) and fixed_type is not LRU,
    "ghost_gone": "ghost" not in cache._LRUCache__order,
    "keys": sorted(cache._LRUCache__order),
}
downgrade(cache)
out["downgraded"] = type(cache) is LRU and not is_fixed(cache)
print("RESULT " + json.dumps(out), flush=True)
"""


@pytest.mark.parametrize("version", ["0.10.0", "0.11.0", "0.23.0", "0.33.0"])
def test_an_instance_is_upgraded_in_place_and_back(version: str) -> None:
    res = realsrc.run_snippet(CODE, timeout=60, args=[version])
    assert not res.timed_out, f"eviction did not finish: the cache was not upgraded\\n{res.stdout}"
    line = next(x for x in res.stdout.splitlines() if x.startswith("RESULT "))
    out = json.loads(line[len("RESULT ") :])
    assert out == {
        "compatible": None,
        "refused": {n: f"Changed has no {n}()" for n in ("popitem", "pop", "touch", "clear")},
        "class_fixed": True,
        "same": True,
        "fixed": True,
        "idempotent": True,
        "subclass": True,
        "ghost_gone": True,
        "keys": ["k10", "k11", "k8", "k9"],
        "downgraded": True,
    }, out
