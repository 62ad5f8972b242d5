"""Facts about released vLLM versions, checked on their real sources.

Every release in ``EXPECTED`` is downloaded once (``scripts/fetch-sources``) and its files are
inspected with ``ast`` or executed without importing vLLM (see ``realsrc``). The table is the
specification: a failing row means the release differs from what the fix assumes.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

import pytest

from harness import realsrc

INIT = realsrc.LRU_IN_UTILS_INIT  # vllm/utils/__init__.py
CACHE = realsrc.LRU_IN_UTILS_CACHE  # vllm/utils/cache.py
MM_PROC = "vllm/multimodal/processing.py"
MM_MOD = "vllm/multimodal/cache.py"
MM_PKG = "vllm/multimodal/cache/base.py"


@dataclass(frozen=True)
class Release:
    version: str
    lru_file: str  # module defining LRUCache
    touch_ghost: bool  # LRUCache.touch(missing) inserts the key into the order
    mm_cache_file: str  # module defining the class with get_lru_cache
    mm_cache_class: str  # ProcessingCache (0.10.0) or MultiModalCache
    get_lru_kind: str  # staticmethod / classmethod
    touch_before_insert: bool  # mm caches touch every item before inserting
    miss_error: bool  # MultiModalCacheMissError exists
    put_if_fits: bool  # LRUCache.put_if_fits exists and mm caches use it


S, C = "staticmethod", "classmethod"
PC, MC = "ProcessingCache", "MultiModalCache"

# fmt: off
EXPECTED: tuple[Release, ...] = (
    #       version     lru    ghost  mm file  class get  touch  miss   fits
    Release("0.10.0",   INIT,  True,  MM_PROC, PC,   S,   False, False, False),
    Release("0.10.1.1", INIT,  True,  MM_MOD,  MC,   C,   False, False, False),
    Release("0.10.2",   INIT,  True,  MM_MOD,  MC,   C,   False, False, False),
    Release("0.11.0",   INIT,  True,  MM_MOD,  MC,   C,   False, False, False),
    Release("0.11.1",   CACHE, True,  MM_MOD,  MC,   C,   False, False, False),
    Release("0.11.2",   CACHE, True,  MM_MOD,  MC,   C,   False, False, False),
    Release("0.12.0",   CACHE, True,  MM_MOD,  MC,   C,   True,  False, False),
    Release("0.13.0",   CACHE, True,  MM_MOD,  MC,   C,   True,  False, False),
    Release("0.14.0",   CACHE, True,  MM_MOD,  MC,   C,   True,  False, False),
    Release("0.14.1",   CACHE, True,  MM_MOD,  MC,   C,   True,  False, False),
    Release("0.15.0",   CACHE, True,  MM_MOD,  MC,   C,   True,  False, False),
    Release("0.15.1",   CACHE, True,  MM_MOD,  MC,   C,   True,  False, False),
    Release("0.16.0",   CACHE, True,  MM_MOD,  MC,   C,   True,  False, False),
    Release("0.17.0",   CACHE, True,  MM_MOD,  MC,   C,   True,  False, False),
    Release("0.17.1",   CACHE, True,  MM_MOD,  MC,   C,   True,  False, False),
    Release("0.18.0",   CACHE, True,  MM_MOD,  MC,   C,   True,  False, False),
    Release("0.18.1",   CACHE, True,  MM_MOD,  MC,   C,   True,  False, False),
    Release("0.19.0",   CACHE, True,  MM_MOD,  MC,   C,   True,  False, False),
    Release("0.19.1",   CACHE, True,  MM_MOD,  MC,   C,   True,  False, False),
    Release("0.20.0",   CACHE, True,  MM_MOD,  MC,   C,   True,  False, False),
    Release("0.20.2",   CACHE, True,  MM_MOD,  MC,   C,   True,  False, False),
    Release("0.21.0",   CACHE, True,  MM_MOD,  MC,   C,   True,  False, False),
    Release("0.22.0",   CACHE, True,  MM_MOD,  MC,   C,   True,  False, False),
    Release("0.22.1",   CACHE, True,  MM_MOD,  MC,   C,   True,  False, False),
    Release("0.23.0",   CACHE, True,  MM_MOD,  MC,   C,   True,  False, False),
    Release("0.24.0",   CACHE, False, MM_MOD,  MC,   C,   True,  False, False),
    Release("0.25.0",   CACHE, False, MM_MOD,  MC,   C,   True,  False, False),
    Release("0.25.1",   CACHE, False, MM_MOD,  MC,   C,   True,  False, False),
    Release("0.26.0",   CACHE, False, MM_MOD,  MC,   C,   True,  False, False),
    Release("0.27.0",   CACHE, False, MM_MOD,  MC,   C,   True,  False, False),
    Release("0.27.1",   CACHE, False, MM_MOD,  MC,   C,   True,  False, False),
    Release("0.28.0",   CACHE, False, MM_MOD,  MC,   C,   True,  True,  False),
    Release("0.29.0",   CACHE, False, MM_MOD,  MC,   C,   True,  True,  True),
    Release("0.30.0",   CACHE, False, MM_MOD,  MC,   C,   True,  True,  True),
    Release("0.31.0",   CACHE, False, MM_PKG,  MC,   C,   True,  True,  True),
    Release("0.32.0",   CACHE, False, MM_PKG,  MC,   C,   True,  True,  True),
    Release("0.33.0",   CACHE, False, MM_PKG,  MC,   C,   True,  True,  True),
    Release("0.34.0",   CACHE, False, MM_PKG,  MC,   C,   True,  True,  True),
)
# fmt: on

BY_VERSION = {row.version: row for row in EXPECTED}


def _params() -> list[Any]:
    return [pytest.param(row, id=row.version) for row in EXPECTED]


@pytest.fixture(scope="session", autouse=True)
def _sources_present() -> None:
    """Fetch missing releases up front (at most two downloads at a time)."""
    missing = [v for v in BY_VERSION if v not in realsrc.available_versions()]
    if missing and not realsrc.offline():
        realsrc.sources.fetch_many(missing, realsrc.CACHETOOLS_VERSIONS)


def _root(version: str) -> Any:
    try:
        return realsrc.source_root(version)
    except realsrc.SourcesUnavailable as exc:
        pytest.skip(str(exc))


def _lru(version: str) -> Any:
    _root(version)
    return realsrc.load_lru_module(version)


def _mm_dir(row: Release) -> str:
    return "vllm/multimodal/cache" if row.mm_cache_file == MM_PKG else row.mm_cache_file


def _calls_to(node: ast.AST, attr: str) -> list[ast.Call]:
    """Calls ``<anything>.attr(...)`` below ``node``."""
    return [
        sub
        for sub in ast.walk(node)
        if isinstance(sub, ast.Call)
        and isinstance(sub.func, ast.Attribute)
        and sub.func.attr == attr
    ]


def _functions(tree: ast.AST) -> list[ast.FunctionDef]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]


def _mm_files(version: str) -> list[tuple[str, ast.Module]]:
    """Parsed multimodal cache and processing modules of a release."""
    found = []
    for under in (
        "vllm/multimodal/cache.py",
        "vllm/multimodal/cache",
        "vllm/multimodal/processing.py",
        "vllm/multimodal/processing",
    ):
        for rel, path in realsrc.python_files(version, under):
            found.append((rel, realsrc.parse(path)))
    return found


# --------------------------------------------------------------------------- where things are


def test_table_covers_every_fetched_release() -> None:
    assert [row.version for row in EXPECTED] == list(realsrc.VERSIONS)


@pytest.mark.parametrize("row", _params())
def test_lru_cache_location(row: Release) -> None:
    _root(row.version)
    assert realsrc.find_class_definitions(row.version, "LRUCache", "vllm/utils") == [row.lru_file]
    assert realsrc.lru_source_relpath(row.version) == row.lru_file
    assert realsrc.has_file(row.version, CACHE) == (row.lru_file == CACHE)


@pytest.mark.parametrize("row", [r for r in _params() if r.values[0].lru_file == CACHE])
def test_utils_cache_is_standalone(row: Release) -> None:
    """vllm/utils/cache.py imports only the standard library and cachetools."""
    _root(row.version)
    tree = realsrc.parse_release_file(row.version, CACHE)
    modules = realsrc.imported_top_level_modules(tree)
    assert modules - set(sys.stdlib_module_names) == {"cachetools"}


@pytest.mark.parametrize("row", _params())
def test_loaded_lru_is_the_real_class(row: Release) -> None:
    module = _lru(row.version)
    cachetools = pytest.importorskip("cachetools")
    cls = module.LRUCache
    assert issubclass(cls, cachetools.LRUCache)
    assert module.__vllm_source__ == row.lru_file
    assert cls.__module__ == module.__name__
    code = cls.touch.__code__
    assert code.co_filename == str(realsrc.source_file(row.version, row.lru_file))
    for name in ("touch", "popitem", "pop", "clear", "remove_oldest", "put", "get"):
        assert callable(getattr(cls, name, None)), name


@pytest.mark.parametrize("row", _params())
def test_loaded_lru_keeps_real_line_numbers(row: Release) -> None:
    module = _lru(row.version)
    tree = realsrc.parse_release_file(row.version, row.lru_file)
    cls = realsrc.top_level_class(tree, "LRUCache")
    assert cls is not None
    for name in ("touch", "popitem", "clear"):
        node = realsrc.class_method(cls, name)
        assert node is not None
        code = getattr(module.LRUCache, name).__code__
        first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
        assert code.co_firstlineno == first, name


@pytest.mark.parametrize("row", _params())
def test_complete_marker(row: Release) -> None:
    root = _root(row.version)
    marker = realsrc.sources.read_marker(root)
    assert marker["version"] == row.version
    assert str(marker["wheel"]).startswith(f"vllm-{row.version}-")
    assert len(str(marker["sha256"])) == 64
    assert row.lru_file in marker["files"]  # type: ignore[operator]
    assert "vllm/plugins/__init__.py" in marker["files"]  # type: ignore[operator]


@pytest.mark.parametrize("row", _params())
def test_mm_cache_location(row: Release) -> None:
    _root(row.version)
    defs = realsrc.find_class_definitions(row.version, row.mm_cache_class, "vllm/multimodal")
    assert defs == [row.mm_cache_file]
    has_pkg = realsrc.has_file(row.version, "vllm/multimodal/cache/__init__.py")
    has_mod = realsrc.has_file(row.version, MM_MOD)
    assert has_pkg == (row.mm_cache_file == MM_PKG)
    assert has_mod == (row.mm_cache_file == MM_MOD)


@pytest.mark.parametrize("row", _params())
def test_get_lru_cache_signature(row: Release) -> None:
    _root(row.version)
    tree = realsrc.parse_release_file(row.version, row.mm_cache_file)
    cls = realsrc.top_level_class(tree, row.mm_cache_class)
    assert cls is not None
    func = realsrc.class_method(cls, "get_lru_cache")
    assert func is not None
    assert realsrc.decorator_names(func) == [row.get_lru_kind]
    positional = [a.arg for a in func.args.posonlyargs + func.args.args]
    first = ["cls"] if row.get_lru_kind == C else []
    assert positional == [*first, "capacity_gb", "value_type"]
    assert [a.arg for a in func.args.kwonlyargs] == ["debug"]
    default = func.args.kw_defaults[0]
    assert isinstance(default, ast.Constant) and default.value is False
    assert func.args.vararg is None and func.args.kwarg is None
    returns = ast.unparse(func.returns) if func.returns else ""
    assert returns.startswith("LRUCache[")


# --------------------------------------------------------------------------- LRU behaviour


def _unit_cache(module: Any, capacity: int) -> Any:
    return module.LRUCache(capacity, getsizeof=lambda value: 1)


def _order(cache: Any) -> list[Any]:
    return list(cache._LRUCache__order)


def _data(cache: Any) -> dict[Any, Any]:
    return dict(cache._Cache__data)


@pytest.mark.parametrize("row", _params())
def test_touch_missing_key(row: Release) -> None:
    cache = _unit_cache(_lru(row.version), 4)
    cache.put("a", 1)
    cache.touch("ghost")
    assert _data(cache) == {"a": 1}
    assert len(cache) == 1 and "ghost" not in cache
    assert ("ghost" in cache._LRUCache__order) is row.touch_ghost
    assert _order(cache) == (["a", "ghost"] if row.touch_ghost else ["a"])


@pytest.mark.parametrize("row", _params())
def test_touch_present_key_moves_it_to_the_end(row: Release) -> None:
    cache = _unit_cache(_lru(row.version), 4)
    for key in "abc":
        cache.put(key, key)
    cache.touch("a")
    assert _order(cache) == ["b", "c", "a"]
    assert _data(cache) == {"a": "a", "b": "b", "c": "c"}


def _cache_with_front_ghost(module: Any) -> Any:
    cache = _unit_cache(module, 2)
    cache.put("a", 1)
    cache.put("b", 2)
    order = cache._LRUCache__order
    order["ghost"] = None
    order.move_to_end("ghost", last=False)
    return cache


@pytest.mark.parametrize("remove_pinned", [False, True], ids=["unpinned", "remove_pinned"])
@pytest.mark.parametrize("row", _params())
def test_popitem_on_front_ghost_removes_nothing(row: Release, remove_pinned: bool) -> None:
    cache = _cache_with_front_ghost(_lru(row.version))
    before = (_order(cache), _data(cache), cache.currsize, len(cache))
    result = cache.popitem(remove_pinned=remove_pinned)  # exactly one call
    assert result == ("ghost", None)
    assert (_order(cache), _data(cache), cache.currsize, len(cache)) == before
    assert _order(cache)[0] == "ghost"


class _Spin(Exception):
    """Raised by the bounded popitem once the eviction loop has clearly stalled."""


def _bounded_subclass(module: Any, limit: int = 200) -> type:
    class Bounded(module.LRUCache):  # type: ignore[name-defined, misc]
        popitem_calls = 0

        def popitem(self, remove_pinned: bool = False) -> Any:
            type(self).popitem_calls += 1
            if type(self).popitem_calls > limit:
                raise _Spin(self.popitem_calls)
            return super().popitem(remove_pinned=remove_pinned)

    return Bounded


@pytest.mark.parametrize("row", _params())
def test_insert_over_capacity_with_front_ghost_spins(row: Release) -> None:
    """cachetools' ``while currsize + size > maxsize: popitem()`` never ends (bounded here)."""
    cls = _bounded_subclass(_lru(row.version))
    cache = cls(2, getsizeof=lambda value: 1)
    cache.put("a", 1)
    cache.put("b", 2)
    order = cache._LRUCache__order
    order["ghost"] = None
    order.move_to_end("ghost", last=False)
    with pytest.raises(_Spin):
        cache.put("c", 3)
    assert _data(cache) == {"a": 1, "b": 2}
    assert _order(cache)[0] == "ghost"


@pytest.mark.parametrize("row", _params())
def test_touch_missing_then_inserts(row: Release) -> None:
    """The freeze from public calls only: touch(missing) then two inserts over capacity."""
    cls = _bounded_subclass(_lru(row.version))
    cache = cls(1, getsizeof=lambda value: 1)
    cache.put("a", 1)
    cache.touch("x")  # missing key
    cache.put("y", 2)  # evicts "a"
    if row.touch_ghost:
        assert _order(cache) == ["x", "y"]
        with pytest.raises(_Spin):
            cache.put("z", 3)
    else:
        cache.put("z", 3)
        assert _data(cache) == {"z": 3}
        assert _order(cache) == ["z"]


_CLEAR_SNIPPET = r"""
import json, signal, sys
from harness import realsrc

class Stalled(BaseException):
    pass

def on_alarm(signum, frame):
    raise Stalled()

signal.signal(signal.SIGALRM, on_alarm)
results = {}
for version in sys.argv[1:]:
    module = realsrc.load_lru_module(version)

    control = module.LRUCache(2, getsizeof=lambda v: 1)
    control.put("a", 1)
    control.put("b", 2)
    signal.setitimer(signal.ITIMER_REAL, 2.0)
    control.clear()
    signal.setitimer(signal.ITIMER_REAL, 0)

    cache = module.LRUCache(2, getsizeof=lambda v: 1)
    cache.put("a", 1)
    cache.put("b", 2)
    order = cache._LRUCache__order
    order["ghost"] = None
    order.move_to_end("ghost", last=False)
    returned = False
    signal.setitimer(signal.ITIMER_REAL, ALARM)
    try:
        cache.clear()
        returned = True
    except Stalled:
        pass
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    results[version] = {
        "control_len": len(control),
        "returned": returned,
        "len": len(cache),
        "order": list(cache._LRUCache__order),
    }
print(json.dumps(results))
"""


@pytest.fixture(scope="session")
def clear_results() -> dict[str, dict[str, Any]]:
    """Run the real, unmodified ``clear()`` of every release in a child process.

    The child interrupts each ``clear()`` with a timer after ``ALARM`` seconds (a terminating
    ``clear()`` of two items takes microseconds); the parent also has a hard timeout.
    """
    versions = [v for v in BY_VERSION if v in realsrc.available_versions()]
    if not versions:
        pytest.skip("no release sources available")
    code = _CLEAR_SNIPPET.replace("ALARM", "0.1")
    result = realsrc.run_snippet(code, timeout=30 + len(versions), args=versions).check()
    return json.loads(result.stdout)


@pytest.mark.parametrize("row", _params())
def test_clear_with_front_ghost_never_returns(
    row: Release, clear_results: dict[str, dict[str, Any]]
) -> None:
    if row.version not in clear_results:
        pytest.skip(f"sources of {row.version} unavailable")
    outcome = clear_results[row.version]
    assert outcome["control_len"] == 0  # a clear() without a ghost finishes
    assert outcome["returned"] is False
    assert outcome["len"] == 2 and outcome["order"] == ["ghost", "a", "b"]


def test_clear_loop_is_real_in_a_killed_subprocess() -> None:
    """One release without any in-process timer: the parent has to kill the child.

    The child reports when it enters ``clear()``; from then on it must still be running (and
    busy) after a grace period that is orders of magnitude longer than a real ``clear()``.
    """
    version = "0.23.0"
    _root(version)
    code = f"""
from harness import realsrc
cache = realsrc.load_lru_module({version!r}).LRUCache(4, getsizeof=lambda v: 1)
cache.put("a", 1)
cache.touch("ghost")
cache.touch("a")
print("clearing", list(cache.order), flush=True)
cache.clear()
print("returned", flush=True)
"""
    cmd, env = realsrc.snippet_command(code)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()  # blocks until the child is inside clear()
        assert first.strip() == "clearing ['ghost', 'a']"
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=1.5)
        assert proc.poll() is None
    finally:
        proc.kill()
        rest, _ = proc.communicate(timeout=30)
    assert "returned" not in rest


# --------------------------------------------------------------------------- multimodal caches


def _touch_call_sites(version: str) -> dict[str, list[str]]:
    """``touch_*_cache_item`` call sites that precede a ``get_and_update_item`` call."""
    sites: dict[str, list[str]] = {}
    for rel, tree in _mm_files(version):
        for func in _functions(tree):
            for attr in ("touch_sender_cache_item", "touch_receiver_cache_item"):
                touches = _calls_to(func, attr)
                if not touches:
                    continue
                inserts = _calls_to(func, "get_and_update_item")
                first_insert = min((c.lineno for c in inserts), default=None)
                ok = first_insert is not None and max(c.lineno for c in touches) < first_insert
                if ok:
                    sites.setdefault(attr, []).append(f"{rel}:{func.name}")
    return sites


def _touch_implementations(version: str) -> dict[str, list[str]]:
    """Implementations of ``touch_*_cache_item`` that call ``<cache>.touch(...)``."""
    impls: dict[str, list[str]] = {}
    for rel, tree in _mm_files(version):
        for func in _functions(tree):
            if func.name in ("touch_sender_cache_item", "touch_receiver_cache_item"):
                if _calls_to(func, "touch"):
                    impls.setdefault(func.name, []).append(rel)
    return impls


@pytest.mark.parametrize("row", _params())
def test_mm_caches_touch_before_insert(row: Release) -> None:
    _root(row.version)
    sites = _touch_call_sites(row.version)
    impls = _touch_implementations(row.version)
    if row.touch_before_insert:
        assert set(sites) == {"touch_sender_cache_item", "touch_receiver_cache_item"}, sites
        assert set(impls) == {"touch_sender_cache_item", "touch_receiver_cache_item"}, impls
    else:
        assert sites == {} and impls == {}


@pytest.mark.parametrize("row", _params())
def test_mm_cache_miss_error(row: Release) -> None:
    _root(row.version)
    defs = realsrc.find_class_definitions(row.version, "MultiModalCacheMissError")
    assert defs == ([row.mm_cache_file] if row.miss_error else [])


@pytest.mark.parametrize("row", _params())
def test_put_if_fits(row: Release) -> None:
    module = _lru(row.version)
    assert hasattr(module.LRUCache, "put_if_fits") is row.put_if_fits
    used_in = sorted(rel for rel, tree in _mm_files(row.version) if _calls_to(tree, "put_if_fits"))
    assert bool(used_in) is row.put_if_fits
    if row.put_if_fits:
        cache = _unit_cache(module, 1)
        assert cache.put_if_fits("a", 1) is True
        big = module.LRUCache(1, getsizeof=lambda value: 5)
        assert big.put_if_fits("b", 1) is False and len(big) == 0


# --------------------------------------------------------------------------- plugins


def _unguarded_plugin_calls(func: ast.FunctionDef) -> tuple[list[str], list[str]]:
    """Calls of loop variables iterating ``<x>.values()``: (unguarded, inside try)."""
    unguarded: list[str] = []
    guarded: list[str] = []

    def visit(node: ast.AST, in_try: bool, loop_vars: frozenset[str]) -> None:
        if isinstance(node, ast.Try) or type(node).__name__ == "TryStar":
            for child in node.body:  # type: ignore[attr-defined]
                visit(child, True, loop_vars)
            for part in ("handlers", "orelse", "finalbody"):
                for child in getattr(node, part):
                    visit(child, in_try, loop_vars)
            return
        if isinstance(node, ast.For):
            it = node.iter
            is_values = (
                isinstance(it, ast.Call)
                and isinstance(it.func, ast.Attribute)
                and it.func.attr == "values"
            )
            if is_values and isinstance(node.target, ast.Name):
                loop_vars = loop_vars | {node.target.id}
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in loop_vars
        ):
            (guarded if in_try else unguarded).append(ast.unparse(node))
        for child in ast.iter_child_nodes(node):
            visit(child, in_try, loop_vars)

    for stmt in func.body:
        visit(stmt, False, frozenset())
    return unguarded, guarded


@pytest.mark.parametrize("row", _params())
def test_general_plugins_are_called_without_try(row: Release) -> None:
    _root(row.version)
    tree = realsrc.parse_release_file(row.version, "vllm/plugins/__init__.py")
    func = realsrc.top_level_function(tree, "load_general_plugins")
    assert func is not None
    uses_group = any(
        isinstance(c.func, ast.Name) and c.func.id == "load_plugins_by_group"
        for c in ast.walk(func)
        if isinstance(c, ast.Call)
    )
    assert uses_group
    unguarded, guarded = _unguarded_plugin_calls(func)
    assert unguarded == ["func()"] and guarded == []
    # Loading (importing) an entry point is guarded; calling the plugin is not.
    loader = realsrc.top_level_function(tree, "load_plugins_by_group")
    assert loader is not None
    loads = _calls_to(loader, "load")
    assert loads
    tries = [n for n in ast.walk(loader) if isinstance(n, ast.Try)]
    assert any(any(call in ast.walk(stmt) for stmt in t.body for call in loads) for t in tries)
