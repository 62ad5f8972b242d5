"""cachetools internals the fix relies on, checked on several real cachetools releases.

Each release is an extracted wheel put on ``PYTHONPATH`` of a child interpreter
(``realsrc.run_snippet``), so the installed cachetools does not matter.
"""

from __future__ import annotations

import ast
import json
from typing import Any

import pytest
from test_release_facts import EXPECTED

from harness import realsrc

CT_VERSIONS = list(realsrc.CACHETOOLS_VERSIONS)


def _ct_dir(version: str) -> Any:
    try:
        return realsrc.cachetools_path(version)
    except realsrc.SourcesUnavailable as exc:
        pytest.skip(str(exc))


def _run_json(code: str, version: str, **kwargs: Any) -> Any:
    _ct_dir(version)
    result = realsrc.run_snippet(code, version, **kwargs).check()
    return json.loads(result.stdout.strip().splitlines()[-1])


_PRIVATE_NAMES = r"""
import collections, json
import cachetools

out = {}
for label, kwargs in (("plain", {}), ("getsizeof", {"getsizeof": len})):
    cache = cachetools.LRUCache(maxsize=10, **kwargs)
    cache["k"] = "vv"
    out[label] = {
        "data": type(getattr(cache, "_Cache__data", None)).__name__,
        "data_is_dict": getattr(cache, "_Cache__data", None) == {"k": "vv"},
        "currsize": getattr(cache, "_Cache__currsize", None),
        "order": type(getattr(cache, "_LRUCache__order", None)).__name__,
        "order_keys": list(getattr(cache, "_LRUCache__order", {})),
        "maxsize": getattr(cache, "_Cache__maxsize", None),
        "size": type(getattr(cache, "_Cache__size", None)).__name__,
    }
print(json.dumps(out))
"""


@pytest.mark.parametrize("version", CT_VERSIONS)
def test_private_names_exist(version: str) -> None:
    out = _run_json(_PRIVATE_NAMES, version)
    assert out["plain"]["currsize"] == 1
    assert out["getsizeof"]["currsize"] == 2
    for label in ("plain", "getsizeof"):
        facts = out[label]
        assert facts["data"] == "dict" and facts["data_is_dict"] is True
        assert facts["order"] == "OrderedDict" and facts["order_keys"] == ["k"]
        assert facts["maxsize"] == 10
    # With a getsizeof the per-key sizes are a plain dict in every release.
    assert out["getsizeof"]["size"] == "dict"


def _setitem_loops(tree: ast.Module) -> list[str]:
    """``while`` loops in ``Cache.__setitem__`` whose body calls ``self.popitem()``."""
    cache_cls = realsrc.top_level_class(tree, "Cache")
    assert cache_cls is not None
    setitem = realsrc.class_method(cache_cls, "__setitem__")
    assert setitem is not None
    loops = []
    for node in ast.walk(setitem):
        if not isinstance(node, ast.While):
            continue
        calls = [
            c
            for stmt in node.body
            for c in ast.walk(stmt)
            if isinstance(c, ast.Call) and ast.unparse(c.func) == "self.popitem"
        ]
        if calls:
            loops.append(ast.unparse(node.test))
    return loops


@pytest.mark.parametrize("version", CT_VERSIONS)
def test_setitem_evicts_with_popitem_in_a_loop_ast(version: str) -> None:
    tree = realsrc.parse(_ct_dir(version) / "cachetools" / "__init__.py")
    loops = _setitem_loops(tree)
    assert loops, "Cache.__setitem__ has no while-loop calling self.popitem()"
    assert all("maxsize" in test and "currsize" in test for test in loops), loops
    lru = realsrc.top_level_class(tree, "LRUCache")
    assert lru is not None
    lru_setitem = realsrc.class_method(lru, "__setitem__")
    assert lru_setitem is not None
    # LRUCache.__setitem__ delegates to Cache.__setitem__ (default argument).
    defaults = [ast.unparse(d) for d in lru_setitem.args.defaults]
    assert "Cache.__setitem__" in defaults
    popitem = realsrc.class_method(lru, "popitem")
    assert popitem is not None
    assert "next(iter(self.__order))" in ast.unparse(popitem)


_POPITEM_LOOP = r"""
import json
import cachetools

class Stop(Exception):
    pass

class Counting(cachetools.LRUCache):
    calls = 0
    noop = False

    def popitem(self):
        type(self).calls += 1
        if type(self).calls > 50:
            raise Stop()
        if self.noop:
            return ("nothing", None)
        return super().popitem()

out = {}
for sized in (False, True):
    kwargs = {"getsizeof": lambda v: 1} if sized else {}
    Counting.calls = 0
    Counting.noop = False
    cache = Counting(2, **kwargs)
    cache["a"] = 1
    cache["b"] = 2
    cache["c"] = 3
    normal = Counting.calls
    Counting.calls = 0
    Counting.noop = True
    try:
        cache["d"] = 4
        spun = False
    except Stop:
        spun = True
    out["sized" if sized else "plain"] = {
        "normal_calls": normal, "keys": list(cache), "spun": spun, "calls": Counting.calls,
    }
print(json.dumps(out))
"""


@pytest.mark.parametrize("version", CT_VERSIONS)
def test_setitem_calls_popitem_until_it_fits(version: str) -> None:
    out = _run_json(_POPITEM_LOOP, version)
    for label in ("plain", "sized"):
        facts = out[label]
        assert facts["normal_calls"] == 1
        assert facts["keys"] == ["b", "c"]
        # A popitem that removes nothing is called again and again.
        assert facts["spun"] is True and facts["calls"] == 51


_VLLM_UNDER_CT = r"""
import json, sys
from harness import realsrc

class Spin(Exception):
    pass

out = {}
for version in sys.argv[1:]:
    module = realsrc.load_lru_module(version)

    class Bounded(module.LRUCache):
        calls = 0

        def popitem(self, remove_pinned=False):
            type(self).calls += 1
            if type(self).calls > 100:
                raise Spin()
            return super().popitem(remove_pinned=remove_pinned)

    cache = module.LRUCache(4, getsizeof=lambda v: 1)
    cache.put("a", 1)
    cache.touch("ghost")
    ghost = "ghost" in cache._LRUCache__order

    front = Bounded(2, getsizeof=lambda v: 1)
    front.put("a", 1)
    front.put("b", 2)
    front._LRUCache__order["g"] = None
    front._LRUCache__order.move_to_end("g", last=False)
    popped = front.popitem()
    unchanged = list(front._LRUCache__order) == ["g", "a", "b"] and len(front) == 2
    try:
        front.put("c", 3)
        spun = False
    except Spin:
        spun = True
    out[version] = {"ghost": ghost, "popped": list(popped), "unchanged": unchanged,
                    "spun": spun}
print(json.dumps(out))
"""


@pytest.mark.parametrize("version", CT_VERSIONS)
def test_real_vllm_lru_under_cachetools(version: str) -> None:
    """The ghost facts of every release hold under each cachetools release."""
    available = set(realsrc.available_versions())
    rows = [row for row in EXPECTED if row.version in available]
    if not rows:
        pytest.skip("no release sources available")
    out = _run_json(_VLLM_UNDER_CT, version, args=[row.version for row in rows], timeout=120)
    for row in rows:
        facts = out[row.version]
        assert facts == {
            "ghost": row.touch_ghost,
            "popped": ["g", None],
            "unchanged": True,
            "spun": True,
        }, row.version
