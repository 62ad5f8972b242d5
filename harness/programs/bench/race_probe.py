"""Race a cache reset against the input thread on the real vLLM ``LRUCache``.

One thread runs vLLM's receiver pattern (touch every hash of a request, then get or
insert each; some hits, many misses, evictions), another calls ``clear()`` the way
``reset_mm_cache`` does from the engine thread. ``sys.setswitchinterval`` is made tiny
to provoke interleavings. Each trial records whether a thread froze, which exceptions
escaped either thread, and the state left behind: order-only keys, data-only keys,
``currsize`` drift from the sum of sizes. Then one more full eviction (an insert of
capacity size) shows whether the next eviction freezes (unpatched) or repairs the
state (fixed).

Variants: ``plain`` (the release's own class), ``fixed`` (``fixed_lru_class``) and
``locked`` (the fixed class with an ``RLock`` around its entry points, a prototype).
Every cachetools release runs in its own interpreter; a frozen thread cannot be
stopped, so a worker that sees one reports and exits, and the remaining trials go to a
fresh worker.

Usage::

    scripts/race-probe                      # defaults below
    scripts/race-probe --trials 50 --vllm 0.23.0 --cachetools 5.5.2 8.0.2
    scripts/race-probe --bench-only
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from harness import realsrc
from vllm_mmcache_fix.catalogue import NEWEST_SOURCES_CHECKED

VARIANTS = ("plain", "fixed", "locked")
LOCKED_METHODS = (
    "touch",
    "get",
    "__getitem__",
    "__setitem__",
    "__delitem__",
    "pop",
    "popitem",
    "clear",
    "put",
    "put_if_fits",
    "pin",
    "stat",
)

CAPACITY = 12
KEY_POOL = 40
REQUEST_ITEMS = 3
FREEZE_SECONDS = 3.0


# --------------------------------------------------------------------------- classes


def locked_class(cls: type) -> type:
    """``cls`` with one re-entrant lock per instance around every entry point."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        def locked(self: Any, *args: Any, **kwargs: Any) -> Any:
            with self._mmfix_lock:
                return fn(self, *args, **kwargs)

        locked.__name__ = fn.__name__
        return locked

    namespace: dict[str, Any] = {}
    for name in LOCKED_METHODS:
        fn = getattr(cls, name, None)
        if fn is not None:
            namespace[name] = wrap(fn)

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807
        self._mmfix_lock = threading.RLock()
        base_init: Callable[..., None] = getattr(cls, "__init__")  # noqa: B009 - the class's own
        base_init(self, *args, **kwargs)

    namespace["__init__"] = __init__
    return type("Locked" + cls.__name__, (cls,), namespace)


def make_class(version: str, variant: str) -> type:
    from vllm_mmcache_fix.lru_eviction.cache import fixed_lru_class

    base = realsrc.load_lru_module(version).LRUCache
    if variant == "plain":
        return base
    fixed = fixed_lru_class(base)
    if variant == "fixed":
        return fixed
    if variant == "locked":
        return locked_class(fixed)
    raise ValueError(variant)


def new_cache(cls: type, capacity: int) -> Any:
    from vllm_mmcache_fix.lru_eviction.cache import QUIET_ATTR

    cache = cls(capacity, getsizeof=len)
    setattr(cache, QUIET_ATTR, True)
    return cache


def p1_request(cache: Any, keys: Sequence[str], values: Sequence[bytes]) -> None:
    for key in keys:
        cache.touch(key)
    for key, value in zip(keys, values):
        if cache.get(key) is None:
            cache[key] = value


# --------------------------------------------------------------------------- worker


COUNTS = (
    "trials",
    "froze_during",  # a thread still running at the deadline
    "froze_next_eviction",  # the full eviction after the trial did not return
    "desync_trials",  # the order and the data disagree after the trial
    "order_only_trials",
    "data_only_trials",
    "drift_trials",  # currsize is not the sum of the entries' sizes
    "repaired_by_next_eviction",
    "desync_after_next_eviction",
    "exception_trials",
)
"""What a probe counts, in the order of its results."""


@dataclass
class Totals:
    counts: Counter[str] = field(default_factory=Counter)
    exceptions: Counter[str] = field(default_factory=Counter)
    """Exception names raised in the trials' threads."""
    next_eviction_errors: Counter[str] = field(default_factory=Counter)

    def bump(self, name: str, by: int = 1) -> None:
        self.counts[name] += by

    def merge(self, other: dict[str, Any]) -> None:
        self.counts.update({name: other[name] for name in COUNTS})
        self.exceptions.update(other["exceptions"])
        self.next_eviction_errors.update(other["next_eviction_errors"])

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {name: self.counts[name] for name in COUNTS}
        out["exceptions"] = dict(self.exceptions)
        out["next_eviction_errors"] = dict(self.next_eviction_errors)
        return out


def _state(cache: Any) -> tuple[set[Any], set[Any], int]:
    order = set(cache._LRUCache__order)
    data = cache._Cache__data
    keys = set(data)
    drift = cache.currsize - sum(len(v) for v in data.values())
    return order - keys, keys - order, drift


def run_trial(cls: type, seed: int, iters: int, clears: int, totals: Totals) -> bool:
    """One trial; False when a thread froze (the worker must stop)."""
    cache = new_cache(cls, CAPACITY)
    errors: Counter[str] = Counter()
    lock = threading.Lock()

    def note(where: str, exc: BaseException) -> None:
        with lock:
            errors[f"{where}:{type(exc).__name__}"] += 1

    def input_thread() -> None:
        rng = random.Random(seed)
        for _ in range(iters):
            keys = rng.sample(range(KEY_POOL), REQUEST_ITEMS)
            names = [f"h{k}" for k in keys]
            values = [b"x" * (1 + k % 3) for k in keys]
            try:
                p1_request(cache, names, values)
            except Exception as exc:
                note("input", exc)

    def engine_thread() -> None:
        for _ in range(clears):
            try:
                cache.clear()
            except Exception as exc:
                note("clear", exc)
            time.sleep(0)

    threads = [
        threading.Thread(target=input_thread, daemon=True),
        threading.Thread(target=engine_thread, daemon=True),
    ]
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + FREEZE_SECONDS
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
    finally:
        sys.setswitchinterval(old)
    totals.bump("trials")
    if any(t.is_alive() for t in threads):
        totals.bump("froze_during")
        return False
    if errors:
        totals.bump("exception_trials")
        totals.exceptions.update(errors)
    order_only, data_only, drift = _state(cache)
    if order_only or data_only:
        totals.bump("desync_trials")
    totals.bump("order_only_trials", bool(order_only))
    totals.bump("data_only_trials", bool(data_only))
    totals.bump("drift_trials", drift != 0)

    # One more full eviction, alone: freezes the unpatched class on a leftover
    # order-only key, repairs the fixed one.
    outcome: dict[str, str] = {}

    def full_eviction() -> None:
        try:
            cache["full"] = b"x" * CAPACITY
        except Exception as exc:
            outcome["error"] = type(exc).__name__

    t = threading.Thread(target=full_eviction, daemon=True)
    t.start()
    t.join(FREEZE_SECONDS)
    if t.is_alive():
        totals.bump("froze_next_eviction")
        return False
    if "error" in outcome:
        totals.next_eviction_errors[outcome["error"]] += 1
    order_only, data_only, _ = _state(cache)
    if order_only or data_only:
        totals.bump("desync_after_next_eviction")
    else:
        totals.bump("repaired_by_next_eviction")
    return True


def worker(
    version: str, variant: str, trials: int, first_seed: int, iters: int, clears: int
) -> dict[str, Any]:
    cls = make_class(version, variant)
    totals = Totals()
    for i in range(trials):
        if not run_trial(cls, first_seed + i, iters, clears, totals):
            break
    return totals.as_dict()


def _worker_main(argv: Sequence[str]) -> None:
    version, variant, trials, seed, iters, clears = argv
    result = worker(version, variant, int(trials), int(seed), int(iters), int(clears))
    print("RESULT " + json.dumps(result), flush=True)
    # A frozen daemon thread would keep spinning through interpreter shutdown.
    os._exit(0)


_WORKER_SNIPPET = """
import sys
from harness.programs.bench.race_probe import _worker_main
_worker_main(sys.argv[1:])
"""


def probe(
    version: str,
    variant: str,
    cachetools_version: str,
    trials: int,
    *,
    iters: int = 300,
    clears: int = 150,
    seed: int = 0,
) -> dict[str, Any]:
    """Run ``trials`` trials in fresh interpreters pinned to one cachetools release."""
    totals = Totals()
    done = 0
    while done < trials:
        res = realsrc.run_snippet(
            _WORKER_SNIPPET,
            cachetools_version,
            timeout=60.0 + 4 * FREEZE_SECONDS * (trials - done),
            args=[version, variant, str(trials - done), str(seed + done), str(iters), str(clears)],
        )
        line = next((x for x in res.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            raise RuntimeError(f"worker failed: {res.stderr[-3000:]}")
        part = json.loads(line[len("RESULT ") :])
        if part["trials"] == 0:
            raise RuntimeError("worker ran no trial")
        totals.merge(part)
        done += part["trials"]
    return totals.as_dict()


# --------------------------------------------------------------------------- hot path


def bench(version: str, requests: int = 20_000, rounds: int = 7) -> dict[str, float]:
    """Seconds per P1 request (single thread) per variant: best of ``rounds``.

    The variants take turns within each round, so a busy machine slows them alike.
    """
    rng = random.Random(1)
    reqs = []
    for _ in range(requests):
        keys = rng.sample(range(200), REQUEST_ITEMS)
        reqs.append(([f"h{k}" for k in keys], [b"x" * (1 + k % 3) for k in keys]))
    classes = {variant: make_class(version, variant) for variant in VARIANTS}
    best = dict.fromkeys(VARIANTS, float("inf"))
    for _ in range(rounds):
        for variant, cls in classes.items():
            cache = new_cache(cls, 128)
            start = time.perf_counter()
            for names, values in reqs:
                p1_request(cache, names, values)
            best[variant] = min(best[variant], time.perf_counter() - start)
    return {variant: seconds / requests for variant, seconds in best.items()}


_BENCH_SNIPPET = """
import json, sys
from harness.programs.bench.race_probe import bench
print("RESULT " + json.dumps(bench(sys.argv[1])))
"""


def bench_under(version: str, cachetools_version: str) -> dict[str, float]:
    res = realsrc.run_snippet(
        _BENCH_SNIPPET,
        cachetools_version,
        timeout=300.0,
        args=[version],
    ).check()
    line = next(x for x in res.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


# --------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=30)
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--clears", type=int, default=150)
    parser.add_argument("--vllm", nargs="+", default=["0.23.0", NEWEST_SOURCES_CHECKED])
    parser.add_argument("--cachetools", nargs="+", default=["5.5.2", "8.0.2"])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--bench-only", action="store_true")
    args = parser.parse_args(argv)

    if not args.bench_only:
        print(
            f"{'vllm':7} {'cachetools':10} {'variant':7} {'trials':>6} {'froze':>5} "
            f"{'froze+1':>7} {'desync':>6} {'ghost':>5} {'orphan':>6} {'drift':>5} "
            f"{'exc':>4} {'repaired':>8}  exceptions / next-eviction errors"
        )
        for version in args.vllm:
            for ct in args.cachetools:
                for variant in args.variants:
                    r = probe(
                        version, variant, ct, args.trials, iters=args.iters, clears=args.clears
                    )
                    print(
                        f"{version:7} {ct:10} {variant:7} {r['trials']:>6} "
                        f"{r['froze_during']:>5} {r['froze_next_eviction']:>7} "
                        f"{r['desync_trials']:>6} {r['order_only_trials']:>5} "
                        f"{r['data_only_trials']:>6} {r['drift_trials']:>5} "
                        f"{r['exception_trials']:>4} {r['repaired_by_next_eviction']:>8}  "
                        f"{r['exceptions']} / {r['next_eviction_errors']}",
                        flush=True,
                    )
    print()
    print(
        f"{'vllm':7} {'cachetools':10} {'plain us':>9} {'fixed us':>9} {'locked us':>9} "
        f"{'fixed/plain':>11} {'locked/plain':>12}"
    )
    for version in args.vllm:
        for ct in args.cachetools:
            b = bench_under(version, ct)
            print(
                f"{version:7} {ct:10} {b['plain'] * 1e6:9.2f} {b['fixed'] * 1e6:9.2f} "
                f"{b['locked'] * 1e6:9.2f} {b['fixed'] / b['plain']:11.3f} "
                f"{b['locked'] / b['plain']:12.3f}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
