"""What the multimodal cache series show on real workloads: the README's healthy figures.

One server per release with the plugin and the harness's 1 MiB cache (the shared servers'
shape: two images and one video per prompt), then, on the same server, the incident replay
(a 400, the same image again, twenty new images) and the concurrent workload (150 requests
from 8 clients: long prompts, reused and new images, pairs, n=2, short videos). After each,
``/metrics`` is read once EngineCore's figures have arrived; per workload and cache the
hit rate per modality, evictions per 100 requests, occupancy and entries are recorded in
``compat/cache_figures.json``.

    scripts/cache-figures --versions 0.23.0 0.32.0
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from harness import runner
from harness.paths import REPO_ROOT
from harness.payloads import mm_limits_args
from harness.programs import concurrent, incident
from harness.programs.health import scrape
from harness.venvs import complete_venv
from vllm_mmcache_fix.metrics import names as n

RESULTS = REPO_ROOT / "compat" / "cache_figures.json"
ROLES = (("sender", ""), ("receiver", "EngineCore"))
MODALITIES = ("image", "video")


def series(metrics: dict[str, float], name: str, **labels: str) -> float | None:
    """The value of ``name`` with exactly these labels."""
    for key, value in metrics.items():
        if not key.startswith(name + "{"):
            continue
        got = dict(part.split("=", 1) for part in key[len(name) + 1 : -1].split(",") if "=" in part)
        if {k: v.strip('"') for k, v in got.items()} == labels:
            return value
    return None


CounterKey = tuple[str, str, str, "str | None"]


def counters(metrics: dict[str, float]) -> dict[CounterKey, float]:
    """Hits and misses per modality, evictions and items too large, of both caches."""
    out: dict[CounterKey, float] = {}
    for role, engine in ROLES:
        for metric in (n.MM_CACHE_HITS, n.MM_CACHE_MISSES):
            for modality in MODALITIES:
                key = (metric, role, engine, modality)
                out[key] = series(metrics, metric, role=role, engine=engine, modality=modality) or 0
        for metric in (n.MM_CACHE_EVICTIONS, n.MM_CACHE_TOO_LARGE):
            out[(metric, role, engine, None)] = (
                series(metrics, metric, role=role, engine=engine) or 0
            )
    return out


def settled(base_url: str, deadline_s: float = 30.0) -> dict[str, float]:
    """/metrics once the cache counters stay put across a heartbeat answer (every 2 s):
    EngineCore's figures arrive with it, so a read right after a request may lack them."""
    end = time.monotonic() + deadline_s
    _, metrics, _ = scrape(base_url)
    while time.monotonic() < end:
        time.sleep(3.0)
        _, again, _ = scrape(base_url)
        if counters(again) == counters(metrics):
            return again
        metrics = again
    raise AssertionError(f"cache counters still moving after {deadline_s} s: {counters(metrics)}")


def figures(before: dict[str, float], after: dict[str, float], requests: int) -> dict[str, Any]:
    """Per cache: the workload's hit rate per modality, evictions per 100 requests, and the
    occupancy and entries at its end."""
    b, a = counters(before), counters(after)
    out: dict[str, Any] = {"requests": requests}
    for role, engine in ROLES:
        row: dict[str, Any] = {}
        for modality in MODALITIES:
            hits = (
                a[(n.MM_CACHE_HITS, role, engine, modality)]
                - b[(n.MM_CACHE_HITS, role, engine, modality)]
            )
            misses = (
                a[(n.MM_CACHE_MISSES, role, engine, modality)]
                - b[(n.MM_CACHE_MISSES, role, engine, modality)]
            )
            row[f"{modality}_lookups"] = int(hits + misses)
            row[f"{modality}_hit_rate"] = (
                round(hits / (hits + misses), 3) if hits + misses else None
            )
        evictions = (
            a[(n.MM_CACHE_EVICTIONS, role, engine, None)]
            - b[(n.MM_CACHE_EVICTIONS, role, engine, None)]
        )
        row["evictions_per_100_requests"] = (
            round(100 * evictions / requests, 1) if requests else None
        )
        row["too_large"] = int(
            a[(n.MM_CACHE_TOO_LARGE, role, engine, None)]
            - b[(n.MM_CACHE_TOO_LARGE, role, engine, None)]
        )
        used = series(after, n.MM_CACHE_BYTES, role=role, engine=engine)
        capacity = series(after, n.MM_CACHE_CAPACITY, role=role, engine=engine)
        row["occupancy"] = round(used / capacity, 3) if used is not None and capacity else None
        row["entries"] = series(after, n.MM_CACHE_ENTRIES, role=role, engine=engine)
        out[role] = row
    return out


def measure(version: str) -> dict[str, Any]:
    venv = complete_venv(version)
    plan = concurrent.plan_requests(150, 7)
    spec = runner.ServerSpec(venv, args=mm_limits_args(images=2, videos=1), name="cache-figures")
    out: dict[str, Any] = {"vllm": version, "cache_bytes": int(0.001 * (1 << 30))}
    with runner.Session(spec) as session:
        start = settled(session.base_url)
        replay = incident.replay_on(session, first_item=1_000_000)
        after_replay = settled(session.base_url)
        out["incident_replay"] = figures(start, after_replay, len(replay.steps))
        result = concurrent.drive(
            session, plan, concurrent.ConcurrentOptions(clients=8), first_image=2_000_000
        )
        after = settled(session.base_url)
        out["concurrent"] = figures(after_replay, after, result.sent)
        out["concurrent"]["statuses"] = result.status_counts
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versions", nargs="+", default=["0.23.0", "0.32.0"])
    parser.add_argument(
        "--again", action="store_true", help="measure releases already measured on this commit"
    )
    args = parser.parse_args(argv)
    from harness import commits

    commit = commits.package()
    data = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    for version in args.versions:
        if not args.again and data.get(version, {}).get("plugin_commit") == commit:
            print(f"{version}: measured on {commit[:10]} already (--again to repeat)")
            continue
        data[version] = measure(version)
        data[version]["plugin_commit"] = commit
        data[version]["date"] = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
        RESULTS.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        print(json.dumps(data[version], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
