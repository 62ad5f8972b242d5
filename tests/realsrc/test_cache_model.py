"""Model-based tests of the fixed LRU on the real vLLM ``LRUCache`` classes.

One hypothesis state machine drives three objects with the same operations:

* the fixed class built from a released vLLM ``LRUCache``,
* that release's own ``LRUCache`` (the differential reference), and
* :class:`Model`, a plain ordered-dict LRU with a pinned set.

Faults are injected at any step: ``getsizeof`` raising, ``_on_remove`` raising after
some removals, a request aborted between its ``touch`` calls and its inserts, and
order/data desync written straight into cachetools' private state. ``popitem`` is
counted on every instance, and an eviction loop whose ``popitem`` calls stop
removing items raises :class:`Stalled` instead of hanging. Scenarios that hang the unpatched class
for real run in a subprocess with a timeout.
"""

from __future__ import annotations

import faulthandler
import os
import select
import subprocess
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import cachetools
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    precondition,
    rule,
    run_state_machine_as_test,
)

from harness import realsrc
from vllm_mmcache_fix.catalogue import NEWEST_SOURCES_CHECKED as NEWEST
from vllm_mmcache_fix.lru_eviction.cache import QUIET_ATTR, fixed_lru_class

# Both touch behaviours (<= 0.23 adds missing keys to the order, later releases do
# not) and both API generations (``put_if_fits`` appears in 0.29).
VERSIONS: tuple[str, ...] = ("0.11.0", "0.23.0", "0.24.0", "0.29.0", NEWEST)
GHOST_TOUCH_VERSIONS = frozenset({"0.11.0", "0.23.0"})

EXAMPLES_ENV = "MMCACHE_HARNESS_HYPOTHESIS_EXAMPLES"
TOTAL_EXAMPLES = int(os.environ.get(EXAMPLES_ENV, "2000"))
EXAMPLES_PER_VERSION = max(20, TOTAL_EXAMPLES // len(VERSIONS))

# A hang in code under test would never let hypothesis check its deadline; the
# popitem accounting turns a stuck eviction loop into an exception and this watchdog
# turns anything else that hangs into a crash with tracebacks.
WATCHDOG_SECONDS = 300.0

ALL_PINNED = "All items are pinned, cannot remove oldest from the cache."
KEYS = "abcdefgh"


class SizeFault(Exception):
    """Injected: ``getsizeof`` failed."""


class RemoveFault(Exception):
    """Injected: ``_on_remove`` failed (after the item was removed)."""


class Aborted(Exception):
    """Injected: a request failed between touching its keys and inserting them."""


class Stalled(Exception):
    """``popitem`` kept returning without removing anything."""


@dataclass(frozen=True)
class Val:
    key: str
    size: int
    serial: int


Outcome = tuple[Any, ...]


def _outcome(fn: Callable[[], Any]) -> Outcome:
    try:
        result = fn()
    except Stalled:
        return ("stalled",)
    except Exception as exc:  # compared by type and message
        return ("raise", type(exc).__name__, str(exc))
    if isinstance(result, tuple) and hasattr(result, "_fields"):
        result = tuple(result)  # CacheInfo
    return ("ok", result)


# --------------------------------------------------------------------------- cachetools


def _probe_getitem_restores_order() -> bool:
    """Whether ``LRUCache.__getitem__`` gives a data-only key an order entry (5.x, 6.x)."""
    cache: cachetools.LRUCache[str, int] = cachetools.LRUCache(4)
    cache["k"] = 1
    del cache._LRUCache__order["k"]  # type: ignore[attr-defined]
    _ = cache["k"]
    return "k" in cache._LRUCache__order  # type: ignore[attr-defined]


def _probe_setitem_uses_size_difference() -> bool:
    """Whether replacing a key evicts only for the size difference (8.x)."""
    evictions: list[Any] = []

    class Counting(cachetools.LRUCache[str, int]):
        def popitem(self) -> tuple[str, int]:
            evictions.append(1)
            return super().popitem()

    cache = Counting(3, getsizeof=lambda v: v)
    cache["a"] = 1
    cache["b"] = 1
    cache["a"] = 2
    return not evictions


GETITEM_RESTORES = _probe_getitem_restores_order()
SETITEM_DIFFSIZE = _probe_setitem_uses_size_difference()


# --------------------------------------------------------------------------- harness


class Harness:
    """A cache instance with fault hooks and ``popitem`` accounting per operation."""

    def __init__(self, cls: type, capacity: int) -> None:
        self.size_fault = False
        self.remove_countdown: int | None = None
        self.popitem_calls = 0
        self.idle_popitems = 0
        self.cache: Any = cls(capacity, getsizeof=self._getsizeof)
        setattr(self.cache, QUIET_ATTR, True)
        self.cache._on_remove = self._on_remove
        bound = self.cache.popitem

        def popitem(remove_pinned: bool = False) -> tuple[Hashable, Any]:
            self.popitem_calls += 1
            before = len(self.data)
            result = bound(remove_pinned=remove_pinned)
            if len(self.data) >= before:
                # Returned without removing anything: the caller's loop will ask again.
                self.idle_popitems += 1
                if self.idle_popitems > 3:
                    raise Stalled(f"{self.idle_popitems} popitem calls removed nothing")
            return result

        self.cache.popitem = popitem

    def _getsizeof(self, value: Val) -> int:
        if self.size_fault:
            self.size_fault = False
            raise SizeFault("getsizeof failed")
        return value.size

    def _on_remove(self, key: Hashable, value: Any) -> None:
        if self.remove_countdown is None:
            return
        if self.remove_countdown == 0:
            self.remove_countdown = None
            raise RemoveFault(f"on_remove failed for {key!r}")
        self.remove_countdown -= 1

    def call(self, fn: Callable[[Any], Any]) -> Outcome:
        self.popitem_calls = 0
        self.idle_popitems = 0
        return _outcome(lambda: fn(self.cache))

    @property
    def data(self) -> dict[Hashable, Any]:
        return self.cache._Cache__data

    @property
    def order(self) -> OrderedDict[Hashable, None]:
        return self.cache._LRUCache__order

    def desync(self) -> int:
        order, data = self.order, self.data
        return len(order.keys() - data.keys()) + len(data.keys() - order.keys())


# --------------------------------------------------------------------------- model


class Model:
    """A reference LRU with pinning, plus the repair rules of the fixed class.

    ``order`` holds the keys in recency order and may contain order-only keys
    planted by a test; ``data`` holds the values, so data-only keys are the ones
    missing from ``order``. Without planted desync this is a plain LRU.
    """

    def __init__(self, capacity: int, order_first_touch: bool = False) -> None:
        self.capacity = capacity
        self.order_first_touch = order_first_touch
        """The release's own touch moves first (<= 0.23): so does the fixed one, and an
        order-only key it meets is moved too (never added)."""
        self.order: OrderedDict[str, None] = OrderedDict()
        self.data: dict[str, Val] = {}
        self.pinned: set[str] = set()
        self.hits = 0
        self.total = 0
        self.last = (0, 0)
        self.size_fault = False
        self.remove_countdown: int | None = None
        self.popitem_calls = 0

    @property
    def currsize(self) -> int:
        return sum(v.size for v in self.data.values())

    def _size(self, value: Val) -> int:
        if self.size_fault:
            self.size_fault = False
            raise SizeFault("getsizeof failed")
        return value.size

    def _on_remove(self, key: str) -> None:
        if self.remove_countdown is None:
            return
        if self.remove_countdown == 0:
            self.remove_countdown = None
            raise RemoveFault(f"on_remove failed for {key!r}")
        self.remove_countdown -= 1

    def _lru_read(self, key: str) -> None:
        """cachetools ``LRUCache.__getitem__`` on a key that has data."""
        if key in self.order:
            self.order.move_to_end(key)
        elif GETITEM_RESTORES:
            self.order[key] = None

    def _remove(self, key: str) -> None:
        """vLLM ``__delitem__`` on a key that has data."""
        self._lru_read(key)
        if key not in self.order:
            # cachetools deletes the data, then ``del order[key]`` fails.
            del self.data[key]
            raise KeyError(key)
        del self.data[key]
        del self.order[key]
        self.pinned.discard(key)
        self._on_remove(key)

    def popitem(self, remove_pinned: bool = False) -> None:
        self.popitem_calls += 1
        # Resync when the sizes disagree (a cheap check) or when the scan for
        # a victim meets an order-only key before finding one.
        if len(self.order) != len(self.data):
            self.resync()
        for key in self.order:
            if key not in self.data:
                self.resync()
                break
            if remove_pinned or key not in self.pinned:
                break
        victim = next((k for k in self.order if remove_pinned or k not in self.pinned), None)
        if victim is None:
            raise RuntimeError(ALL_PINNED)
        self._remove(victim)

    def resync(self) -> None:
        """Order-only keys dropped, data-only keys moved to the oldest end."""
        for key in [k for k in self.order if k not in self.data]:
            del self.order[key]
        orphans = [k for k in self.data if k not in self.order]
        for key in reversed(orphans):
            self.order[key] = None
            self.order.move_to_end(key, last=False)

    # The public API, mirroring vLLM's LRUCache with the fixed touch/popitem/clear.

    def __setitem__(self, key: str, value: Val) -> None:
        size = self._size(value)
        if size > self.capacity:
            raise ValueError("value too large")
        if SETITEM_DIFFSIZE:
            diff = size if key not in self.data else size - self.data[key].size
            while self.currsize + diff > self.capacity:
                self.popitem()
                if key not in self.data:
                    diff = size
        elif key not in self.data or self.data[key].size < size:
            while self.currsize + size > self.capacity:
                self.popitem()
        self.data[key] = value
        if key in self.order:
            self.order.move_to_end(key)
        else:
            self.order[key] = None

    def put(self, key: str, value: Val) -> None:
        self[key] = value

    def put_if_fits(self, key: str, value: Val) -> bool:
        try:
            self[key] = value
        except ValueError as exc:
            if str(exc) != "value too large":
                raise
            return False
        return True

    def __getitem__(self, key: str) -> Val:
        if key not in self.data:
            raise KeyError(key)
        self._lru_read(key)
        self.hits += 1
        self.total += 1
        return self.data[key]

    def get(self, key: str) -> Val | None:
        self.total += 1
        if key not in self.data:
            return None
        self._lru_read(key)
        self.hits += 1
        return self.data[key]

    def touch(self, key: str) -> None:
        if self.order_first_touch and key in self.order:
            self.order.move_to_end(key)
            return
        # A key without data is left alone (an order-only one included, where the
        # release's own touch checks membership first).
        if key in self.data:
            if key in self.order:
                self.order.move_to_end(key)
            else:
                self.order[key] = None

    def pop(self, key: str) -> Val | None:
        if key not in self.data:
            return None
        value = self.data[key]
        self._lru_read(key)
        self._remove(key)
        return value

    def pin(self, key: str) -> None:
        if key not in self.data:
            raise ValueError(f"Cannot pin key: {key} not in cache.")
        self.pinned.add(key)

    def clear(self) -> None:
        while self.data:
            self.popitem(remove_pinned=True)
        self.order.clear()
        self.pinned.clear()
        self.hits = self.total = 0
        self.last = (0, 0)

    def stat(self, *, delta: bool = False) -> tuple[int, int]:
        info = (self.hits, self.total)
        if delta:
            result = (info[0] - self.last[0], info[1] - self.last[1])
            self.last = info
            return result
        return info


def p1_request(cache: Any, items: list[Val], abort_at: int | None) -> list[Val]:
    """vLLM's receiver pattern: touch every hash of a request, then get or insert each."""
    for item in items:
        cache.touch(item.key)
    out = []
    for index, item in enumerate(items):
        if index == abort_at:
            raise Aborted("request failed after touch")
        cached = cache.get(item.key)
        if cached is None:
            cache[item.key] = item
            cached = item
        out.append(cached)
    return out


# --------------------------------------------------------------------------- machine

sizes = st.one_of(st.integers(0, 3), st.integers(0, 12))
keys = st.sampled_from(KEYS)


class CacheMachine(RuleBasedStateMachine):
    VERSION = ""

    def __init__(self) -> None:
        super().__init__()
        self.serial = 0
        self.plain: Harness | None = None
        self.fixed: Harness
        self.model: Model
        self.base: type
        self.touched_missing = False

    @initialize(capacity=st.integers(1, 10))
    def setup(self, capacity: int) -> None:
        self.base = realsrc.load_lru_module(self.VERSION).LRUCache
        self.fixed = Harness(fixed_lru_class(self.base), capacity)
        self.plain = Harness(self.base, capacity)
        self.model = Model(capacity, order_first_touch=self.VERSION in GHOST_TOUCH_VERSIONS)

    def _val(self, key: str, size: int) -> Val:
        self.serial += 1
        return Val(key, size, self.serial)

    # -- running one operation on all three

    def _run(self, fn: Callable[[Any], Any], kind: str = "op") -> Outcome:
        fixed = self.fixed
        data_before = len(fixed.data)
        # Pinned keys that hold data (a failed delete of a data-only key can leave
        # a pinned key without data behind, on vLLM's own class as well).
        pinned_before = fixed.cache.pinned_items & fixed.data.keys()
        desync_before = fixed.desync()

        self.model.popitem_calls = 0
        expected = _outcome(lambda: fn(self.model))
        got = fixed.call(fn)
        assert got == expected, (got, expected)

        # The fixed class against the model, in full.
        assert list(fixed.data.items()) == list(self.model.data.items())
        assert list(fixed.order) == list(self.model.order)
        assert fixed.cache.pinned_items == self.model.pinned
        assert fixed.cache.currsize == self.model.currsize
        assert fixed.cache.currsize == sum(v.size for v in fixed.data.values())
        assert tuple(fixed.cache.stat()) == self.model.stat()
        # Bounded work: every popitem call that returned removed an item, so an
        # operation makes at most one call per item it saw plus one that raises.
        assert fixed.idle_popitems == 0
        assert fixed.popitem_calls == self.model.popitem_calls
        if kind == "clear":
            assert fixed.popitem_calls <= data_before
        # Pinned items leave only through clear() or an explicit pop().
        if kind not in ("clear", "pop"):
            assert pinned_before <= fixed.data.keys()
        if kind == "clear" and got[0] == "ok":
            assert not fixed.order and not fixed.data
        # Operations never add desync; only the planting rules do.
        assert fixed.desync() <= desync_before

        self._run_plain(fn, got)
        return got

    def _run_plain(self, fn: Callable[[Any], Any], fixed_outcome: Outcome) -> None:
        plain = self.plain
        if plain is None:
            return
        got = plain.call(fn)
        if got == ("stalled",):
            # The unpatched class hung where the fixed one finished: only possible
            # after a touch left an order-only key behind (vLLM <= 0.23).
            assert self.VERSION in GHOST_TOUCH_VERSIONS and self.touched_missing
            assert fixed_outcome != ("stalled",)
            self.plain = None
            return
        assert got == fixed_outcome, (got, fixed_outcome)
        fixed = self.fixed
        assert list(plain.data.items()) == list(fixed.data.items())
        assert [k for k in plain.order if k in plain.data] == list(fixed.order)
        assert plain.cache.pinned_items == fixed.cache.pinned_items
        assert plain.cache.currsize == fixed.cache.currsize
        assert tuple(plain.cache.stat()) == tuple(fixed.cache.stat())

    def _note_touch(self, key: str) -> None:
        if key not in self.fixed.data:
            self.touched_missing = True

    # -- operations

    @rule(key=keys)
    def get(self, key: str) -> None:
        self._run(lambda c: c.get(key))

    @rule(key=keys)
    def getitem(self, key: str) -> None:
        self._run(lambda c: c[key])

    @rule(key=keys)
    def touch(self, key: str) -> None:
        self._note_touch(key)
        self._run(lambda c: c.touch(key))

    @rule(key=keys, size=sizes)
    def put(self, key: str, size: int) -> None:
        value = self._val(key, size)
        self._run(lambda c: c.put(key, value))

    @precondition(lambda self: hasattr(self.base, "put_if_fits"))
    @rule(key=keys, size=sizes)
    def put_if_fits(self, key: str, size: int) -> None:
        value = self._val(key, size)
        self._run(lambda c: c.put_if_fits(key, value))

    @rule(key=keys)
    def pop(self, key: str) -> None:
        self._run(lambda c: c.pop(key), kind="pop")

    @rule(key=keys)
    def pin(self, key: str) -> None:
        self._run(lambda c: c.pin(key))

    @rule()
    def clear(self) -> None:
        self._run(lambda c: c.clear(), kind="clear")

    @rule(delta=st.booleans())
    def stat(self, delta: bool) -> None:
        self._run(lambda c: c.stat(delta=delta))

    @rule(
        request=st.lists(st.tuples(keys, sizes), min_size=1, max_size=4, unique_by=lambda t: t[0]),
        abort_at=st.one_of(st.none(), st.integers(0, 3)),
    )
    def request(self, request: list[tuple[str, int]], abort_at: int | None) -> None:
        items = [self._val(k, s) for k, s in request]
        for item in items:
            self._note_touch(item.key)
        self._run(lambda c: p1_request(c, items, abort_at))

    # -- faults that keep order and data in step

    @rule()
    def fail_next_getsizeof(self) -> None:
        for target in self._targets():
            target.size_fault = True

    @rule(after=st.integers(0, 3))
    def fail_on_remove(self, after: int) -> None:
        for target in self._targets():
            target.remove_countdown = after

    def _targets(self) -> Iterator[Harness | Model]:
        yield self.fixed
        yield self.model
        if self.plain is not None:
            yield self.plain

    # -- desync planted in the private state (the unpatched class is retired)

    def _plant(self) -> None:
        self.plain = None

    @rule(key=keys, position=st.integers(0, 8))
    def plant_order_only(self, key: str, position: int) -> None:
        if key in self.fixed.data:
            return
        self._plant()
        for order in (self.fixed.order, self.model.order):
            order[key] = None
            tail = list(order)[position:]
            for k in tail:
                if k != key:
                    order.move_to_end(k)

    @rule(key=keys)
    def plant_data_only(self, key: str) -> None:
        if key not in self.fixed.data or key not in self.fixed.order:
            return
        self._plant()
        del self.fixed.order[key]
        del self.model.order[key]

    @rule(orphan=keys, ghost=keys)
    def plant_both(self, orphan: str, ghost: str) -> None:
        if orphan not in self.fixed.order or ghost in self.fixed.data:
            return
        if orphan not in self.fixed.data:
            return
        self._plant()
        for order in (self.fixed.order, self.model.order):
            del order[orphan]
            order[ghost] = None
            order.move_to_end(ghost, last=False)

    @rule(key=keys, size=st.integers(0, 3))
    def plant_new_data_only(self, key: str, size: int) -> None:
        """An item in the data that the order never saw."""
        fixed = self.fixed
        if key in fixed.data or key in fixed.order:
            return
        if fixed.cache.currsize + size > fixed.cache.maxsize or fixed.size_fault:
            return
        self._plant()
        value = self._val(key, size)
        cachetools.Cache.__setitem__(fixed.cache, key, value)
        self.model.data[key] = value


def _machine(version: str) -> type[CacheMachine]:
    name = "CacheMachine_" + version.replace(".", "_")
    return type(name, (CacheMachine,), {"VERSION": version})


@pytest.fixture
def watchdog() -> Iterator[None]:
    faulthandler.dump_traceback_later(WATCHDOG_SECONDS, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


@pytest.mark.parametrize("version", VERSIONS)
def test_fixed_cache_state_machine(version: str, watchdog: None) -> None:
    run_state_machine_as_test(
        _machine(version),
        settings=settings(
            max_examples=EXAMPLES_PER_VERSION,
            stateful_step_count=40,
            deadline=timedelta(seconds=5),
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
            print_blob=True,
        ),
    )


# --------------------------------------------------------------------------- direct checks


def test_model_probes_match_installed_cachetools() -> None:
    major = int(cachetools.__version__.split(".")[0])
    assert GETITEM_RESTORES == (major < 7)
    assert SETITEM_DIFFSIZE == (major >= 7)


@pytest.mark.parametrize("version", VERSIONS)
def test_accounting_catches_unpatched_stall(version: str) -> None:
    """The ``popitem`` accounting used above does detect the unpatched loop."""
    harness = Harness(realsrc.load_lru_module(version).LRUCache, 2)
    harness.call(lambda c: c.put("a", Val("a", 1, 1)))
    harness.order["ghost"] = None
    harness.order.move_to_end("ghost", last=False)
    harness.call(lambda c: c.put("b", Val("b", 1, 2)))
    assert harness.call(lambda c: c.put("c", Val("c", 1, 3))) == ("stalled",)


@pytest.mark.parametrize("version", VERSIONS)
def test_orphans_keep_their_lru_position(version: str) -> None:
    """A data-only key is evicted before the keys the order still knows.

    Otherwise the item that lost its entry would outlive every eviction until
    a full flush.
    """
    cache = fixed_lru_class(realsrc.load_lru_module(version).LRUCache)(4)
    setattr(cache, QUIET_ATTR, True)
    for key in "abcd":
        cache[key] = key
    del cache._LRUCache__order["a"]  # "a" is the oldest item and loses its entry
    for key in "efghij":
        cache[key] = key
    assert "a" not in cache
    assert list(cache.order) == list(cache._Cache__data)


# --------------------------------------------------------------------------- real hangs

_SCENARIO = """
import sys
from harness import realsrc
from vllm_mmcache_fix.lru_eviction.cache import fixed_lru_class

version, variant, scenario = sys.argv[1:4]
cls = realsrc.load_lru_module(version).LRUCache
if variant == "fixed":
    cls = fixed_lru_class(cls)
cache = cls(2)
order = cache._LRUCache__order

def ghost_in_front():
    order["ghost"] = None
    order.move_to_end("ghost", last=False)

print("START", flush=True)  # the interpreter is up: a hang is timed from here
try:
    if scenario == "ghost_evict":
        cache["a"] = 1
        ghost_in_front()
        cache["b"] = 2
        cache["c"] = 3
    elif scenario == "ghost_clear":
        cache["a"] = 1
        ghost_in_front()
        cache.clear()
    elif scenario == "touch_then_skip":
        cache["a"] = 1
        cache.touch("x")  # the request fails before "x" is inserted
        cache["b"] = 2
        cache["c"] = 3
        cache["d"] = 4
    elif scenario == "ghost_all_pinned":
        cache["a"] = 1
        cache["b"] = 2
        cache.pin("a")
        cache.pin("b")
        ghost_in_front()
        cache["c"] = 3
    elif scenario == "orphan_clear":
        cache["a"] = 1
        cache["b"] = 2
        del order["a"]
        cache.clear()
except Exception as exc:
    print("raised", type(exc).__name__)
else:
    print("done", sorted(order) == sorted(cache._Cache__data))
"""

# (scenario, versions where the unpatched class hangs, its result elsewhere,
#  the fixed class's result)
_HANGS: list[tuple[str, frozenset[str] | None, str, str]] = [
    ("ghost_evict", None, "", "done True"),
    ("ghost_clear", None, "", "done True"),
    ("touch_then_skip", GHOST_TOUCH_VERSIONS, "done True", "done True"),
    ("ghost_all_pinned", None, "", "raised RuntimeError"),
    ("orphan_clear", frozenset(), "raised StopIteration", "done True"),
]
HANG_S = 2.0
"""A scenario hangs when it is still running this long after its ``START`` line (the
interpreter's start-up and the release's import are not part of it)."""
START_TIMEOUT_S = 60.0


@dataclass
class Scenario:
    hung: bool
    returncode: int | None
    stdout: str
    stderr: str


def _run_scenario(version: str, variant: str, scenario: str, must_end: bool) -> Scenario:
    cmd, env = realsrc.snippet_command(_SCENARIO, args=[version, variant, scenario])
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    head = b""
    deadline = time.monotonic() + START_TIMEOUT_S
    try:
        while b"START\n" not in head:  # read unbuffered: what follows START stays in `head`
            left = deadline - time.monotonic()
            ready, _, _ = select.select([proc.stdout], [], [], max(0.0, left))
            chunk = os.read(proc.stdout.fileno(), 4096) if ready else b""
            if not chunk:
                raise AssertionError(f"{scenario}: no START within {START_TIMEOUT_S} s")
            head += chunk
        try:
            proc.wait(timeout=START_TIMEOUT_S if must_end else HANG_S)
            hung = False
        except subprocess.TimeoutExpired:
            hung = True
    finally:
        if proc.poll() is None:
            proc.kill()
        out, err = proc.communicate(timeout=30)
    rest = (head + out).decode().split("START\n", 1)[-1]
    return Scenario(hung, None if hung else proc.returncode, rest, err.decode())


def _expected(version: str, variant: str) -> dict[str, str | None]:
    """Expected first output line per scenario; None means the process must hang."""
    out: dict[str, str | None] = {}
    for scenario, hang_versions, plain_result, fixed_result in _HANGS:
        if variant == "fixed":
            out[scenario] = fixed_result
        elif hang_versions is None or version in hang_versions:
            out[scenario] = None
        else:
            out[scenario] = plain_result
    return out


@pytest.mark.parametrize("variant", ["plain", "fixed"])
@pytest.mark.parametrize("version", VERSIONS)
def test_real_hang_in_subprocess(version: str, variant: str) -> None:
    """The unpatched class really hangs on these states; the fixed class finishes."""
    expected = _expected(version, variant)

    def run(scenario: str) -> Scenario:
        return _run_scenario(version, variant, scenario, must_end=expected[scenario] is not None)

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = dict(zip(expected, pool.map(run, expected), strict=True))
    for scenario, want in expected.items():
        res = results[scenario]
        if want is None:
            assert res.hung, (scenario, res.stdout, res.stderr)
        else:
            assert not res.hung and res.returncode == 0, (scenario, res.stderr)
            assert res.stdout.strip() == want, (scenario, res.stdout, res.stderr)


# --------------------------------------------------------------------------- other cachetools


@pytest.mark.parametrize(
    "ct_version", [v for v in realsrc.CACHETOOLS_VERSIONS if v != cachetools.__version__]
)
def test_state_machine_under_other_cachetools(ct_version: str) -> None:
    """The same machine with cachetools' 5.x/6.x LRU internals (fewer examples)."""
    examples = max(len(VERSIONS) * 20, TOTAL_EXAMPLES // 5)
    res = realsrc.run_snippet(
        "import sys, pytest\n"
        "sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', sys.argv[1],"
        " '-k', 'state_machine[ or probes_match']))\n",
        ct_version,
        timeout=240.0,
        env={EXAMPLES_ENV: str(examples)},
        args=[__file__],
    )
    assert not res.timed_out and res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert f"{len(VERSIONS) + 1} passed" in res.stdout, res.stdout[-2000:]
