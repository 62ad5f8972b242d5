"""Hot-path cost of the fixed cache against the installed vLLM's own class.

Run it with the Python of a vLLM environment (``PYTHON=<venv>/bin/python
scripts/bench-cache``): it imports that vLLM's ``LRUCache`` and times, in
one process and interleaved, the same workloads on vLLM's class and on the
fixed class built from it. Prints a ratio per workload (fixed / vLLM; 1.00 is
free) and the per-process cost of importing and applying the plugin.

Without vLLM installed, ``--release X`` benchmarks a release's real
``LRUCache`` loaded from its sources (see :mod:`harness.realsrc`).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

from harness.paths import REPO_ROOT

ITEM = 1000  # bytes per item; capacity holds 64 items


def load_vllm_lru(release: str | None) -> tuple[type, str]:
    if release is None:
        try:
            from vllm.utils.cache import LRUCache  # vLLM 0.11.1+
        except ImportError:
            from vllm.utils import LRUCache  # 0.11.0 and older
        import vllm

        return LRUCache, f"installed vLLM {vllm.__version__}"
    from harness import realsrc

    return realsrc.load_lru_module(release).LRUCache, f"vLLM {release} real source"


def _keys(n: int, distinct: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [f"mm-hash-{rng.randrange(distinct):06d}" for _ in range(n)]


def receiver_workload(cls: type, keys: list[str]) -> Callable[[], None]:
    """vLLM's P1 pattern: touch every hash of a request, then get or insert it."""
    value = b"x" * ITEM

    def run() -> None:
        cache = cls(64 * ITEM, getsizeof=len)
        for key in keys:
            cache.touch(key)
            if cache.get(key) is None:
                cache[key] = value

    return run


def sender_workload(cls: type, keys: list[str]) -> Callable[[], None]:
    """vLLM's P0 pattern: membership test, then get or insert (no touch)."""
    value = b"x" * ITEM

    def run() -> None:
        cache = cls(64 * ITEM, getsizeof=len)
        for key in keys:
            if key in cache:
                cache.get(key)
            else:
                cache[key] = value

    return run


def hits_only(cls: type, keys: list[str]) -> Callable[[], None]:
    value = b"x" * ITEM
    cache = cls(64 * ITEM, getsizeof=len)
    hot = sorted(set(keys))[:32]
    for key in hot:
        cache[key] = value
    stream = [hot[i % len(hot)] for i in range(len(keys))]

    def run() -> None:
        for key in stream:
            cache.touch(key)
            cache.get(key)

    return run


def evictions_only(cls: type, keys: list[str]) -> Callable[[], None]:
    value = b"x" * ITEM
    stream = [f"new-{i}" for i in range(len(keys))]

    def run() -> None:
        cache = cls(64 * ITEM, getsizeof=len)
        for key in stream:
            cache[key] = value

    return run


WORKLOADS = {
    "receiver (touch+get/insert, ~50% hits)": (receiver_workload, 128),
    "sender (contains+get/insert, ~50% hits)": (sender_workload, 128),
    "hits only (touch+get)": (hits_only, 32),
    "evictions only (insert)": (evictions_only, 0),
}


def time_pair(
    make: Callable[[type, list[str]], Callable[[], None]],
    base: type,
    fixed: type,
    keys: list[str],
    rounds: int,
) -> tuple[float, float]:
    """Interleave the two classes round by round; return the best time of each."""
    runs = {"base": make(base, keys), "fixed": make(fixed, keys)}
    best = {"base": float("inf"), "fixed": float("inf")}
    samples: dict[str, list[float]] = {"base": [], "fixed": []}
    gc.disable()
    try:
        for i in range(rounds):
            order = ("base", "fixed") if i % 2 == 0 else ("fixed", "base")
            for name in order:
                start = time.perf_counter()
                runs[name]()
                elapsed = time.perf_counter() - start
                samples[name].append(elapsed)
                best[name] = min(best[name], elapsed)
    finally:
        gc.enable()
    return best["base"], best["fixed"]


def plugin_cost(python: str) -> dict[str, float]:
    """Fresh-interpreter cost of importing the plugin and of register() (vLLM imported)."""
    code = (
        "import time, sys\n"
        "import vllm.multimodal.cache\n"
        "t0 = time.perf_counter()\n"
        "import vllm_mmcache_fix\n"
        "t1 = time.perf_counter()\n"
        "vllm_mmcache_fix.register()\n"
        "t2 = time.perf_counter()\n"
        "assert vllm_mmcache_fix.status()['installed'], vllm_mmcache_fix.status()\n"
        "print((t1 - t0) * 1e3, (t2 - t1) * 1e3)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), VLLM_LOGGING_LEVEL="ERROR")
    imports, registers = [], []
    for _ in range(5):
        out = subprocess.run(
            [python, "-c", code], capture_output=True, text=True, env=env, timeout=300
        )
        if out.returncode != 0:
            return {"error": out.stderr.strip().splitlines()[-1] if out.stderr else "failed"}  # type: ignore[dict-item]
        a, b = (float(x) for x in out.stdout.split()[-2:])
        imports.append(a)
        registers.append(b)
    return {"import_ms": statistics.median(imports), "register_ms": statistics.median(registers)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--release", help="use this release's real source instead of vLLM")
    parser.add_argument("--ops", type=int, default=20000, help="operations per round")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    from vllm_mmcache_fix.lru_eviction.cache import fixed_lru_class

    base, label = load_vllm_lru(args.release)
    fixed = fixed_lru_class(base)
    results = []
    for name, (make, distinct) in WORKLOADS.items():
        keys = _keys(args.ops, distinct or args.ops, seed=len(name))
        t_base, t_fixed = time_pair(make, base, fixed, keys, args.rounds)
        results.append(
            {
                "workload": name,
                "vllm_us_per_op": t_base / args.ops * 1e6,
                "fixed_us_per_op": t_fixed / args.ops * 1e6,
                "ratio": t_fixed / t_base,
            }
        )
    cost = plugin_cost(sys.executable) if args.release is None else {}
    if args.json:
        print(json.dumps({"against": label, "workloads": results, "plugin": cost}, indent=2))
        return 0
    print(f"fixed cache vs {label} (best of {args.rounds} rounds x {args.ops} ops, interleaved)")
    print(f"{'workload':<44} {'vLLM us/op':>11} {'fixed us/op':>12} {'ratio':>7}")
    for row in results:
        print(
            f"{row['workload']:<44} {row['vllm_us_per_op']:>11.3f} "
            f"{row['fixed_us_per_op']:>12.3f} {row['ratio']:>7.3f}"
        )
    if cost:
        if "error" in cost:
            print(f"plugin import/register cost: not measured ({cost['error']})")
        else:
            print(
                f"plugin per process: import {cost['import_ms']:.2f} ms, "
                f"register() {cost['register_ms']:.2f} ms (median of 5 fresh interpreters)"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
