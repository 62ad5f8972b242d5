"""One case of an HTTP shape: a server started one way, the incident replayed against it.

The server is :class:`harness.server.Server` (its process group, the server lock), started
with the shape's arguments; ``python -m vllm.entrypoints.openai.api_server`` gets that
module's command line instead of ``vllm serve``. One text-only request warms it up (its
first compile is not the replay's). While ``/health`` is polled every half
second, the incident sequence of :mod:`harness.programs.incident` is sent (a long prompt with image
0 rejected after the image was cached, image 0 again, new images until the cache
evicts); a pooling server gets the same sequence through ``/v1/embeddings`` and then a
run of requests that reuse a few large images, with the API server's resident memory
sampled. Around it: the process table with memory before and after, each EngineCore's CPU
after the load, ``/metrics``, the plugin's log lines and, when a request hangs, the stacks
of every process (``py-spy dump``).
"""

from __future__ import annotations

import contextlib
import re
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import procs
from harness.http import Reply, http_post
from harness.lock import ServerLock
from harness.logscan import log_markers, supported_tasks
from harness.payloads import (
    SHORT_TEXT,
    chat_payload,
    choose_word_count,
    image_part,
    make_png,
    media_payload,
    user_request,
    words_text,
)
from harness.programs.health import HealthPoller
from harness.programs.incident import _short_body, step_names
from harness.programs.topologies import observe
from harness.programs.topologies.shapes import API_SERVER_MODULE, POOLING, Shape
from harness.server import Server

HEALTH_INTERVAL_S = 0.5
HEALTH_CLIENT_TIMEOUT_S = 30.0
SLOW_REQUEST_S = 5.0
"""A request in flight this long gets the processes' CPU and stacks recorded."""
POOL_IMAGES = 4
POOL_IMAGE_SIDE = 448
"""Large enough that a decoded image kept per request shows in resident memory (0.6 MB)."""


def module_command(serve_cmd: list[str]) -> list[str]:
    """``vllm serve MODEL ARGS`` as ``python -m vllm.entrypoints.openai.api_server --model
    MODEL ARGS`` (the module has no positional model)."""
    python, dash_m, module, verb, model, *rest = serve_cmd
    if (dash_m, module, verb) != ("-m", "vllm.entrypoints.cli.main", "serve"):
        raise ValueError(f"not a vllm serve command: {serve_cmd[:4]}")
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, *rest]


_EXCEPTION = re.compile(
    r"^(?:\([^()]*\) )?(?:[A-Z]+ \d\d-\d\d [\d:]+ \[[^\]]*\] )?"
    r"(?P<kind>[A-Za-z_][\w.]*(?:Error|Exception)): (?P<text>.+)$"
)
"""An exception line of a traceback, with or without vLLM's log prefix."""
_WRAPPERS = ("See root cause above", "server exited with", "initialization failed")


def start_failure(log_path: Path) -> str:
    """Why a server or program did not start: the first exception its log names that is not
    one of vLLM's wrappers ("Engine core initialization failed. See root cause above"),
    else the last error-like line."""
    try:
        lines = Path(log_path).read_text(errors="replace").splitlines()
    except OSError:
        return ""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", ln) for ln in lines]
    for line in lines:
        m = _EXCEPTION.search(line)
        if m and not any(w in line for w in _WRAPPERS):
            return f"{m.group('kind')}: {m.group('text')}"[:400]
    keys = ("Error", "error:", "Exception", "refus", "assert")
    hits = [ln for ln in lines if any(k in ln for k in keys)]
    return (hits[-1] if hits else (lines[-1] if lines else ""))[-400:]


def embeddings_payload(text: str, png: bytes | None) -> dict[str, object]:
    parts = [] if png is None else [image_part(png)]
    return user_request(parts, text, encoding_format="float")


def _detail(reply: Reply) -> str:
    if reply.error:
        return reply.error[:200]
    if '"embedding"' in reply.body:
        return "ok: embedding"
    return _short_body(reply.body)[:200]


def warm_up(base_url: str, pooling: bool, timeout: float) -> dict[str, Any]:
    """One text-only request, so that the replay's timeouts measure the cache and not a
    cold server's first compile; touches no multimodal cache. Its status and latency."""
    if pooling:
        route, payload = "/v1/embeddings", embeddings_payload(SHORT_TEXT, None)
    else:
        route, payload = "/v1/chat/completions", chat_payload(SHORT_TEXT, None)
    reply = http_post(base_url + route, payload, timeout)
    return {
        "status": "timeout" if reply.timed_out else reply.status,
        "latency_s": round(reply.latency_s, 3),
    }


def replay(
    base_url: str,
    *,
    pooling: bool,
    n_images: int,
    request_timeout: float,
    watch: observe.SlowWatch | None = None,
) -> tuple[list[dict[str, Any]], float | None, dict[str, Any]]:
    """The incident sequence; (steps, monotonic start of the request that hung, prompt).
    ``watch`` looks at the processes while a request is slow."""
    words, tokens = choose_word_count(base_url, request_timeout)
    route = "/v1/embeddings" if pooling else "/v1/chat/completions"
    steps: list[dict[str, Any]] = []
    hang_at: float | None = None

    def send(step: str, text: str, index: int) -> bool:
        nonlocal hang_at
        if pooling:
            payload = embeddings_payload(text, make_png(index))
        else:
            payload = media_payload(text, "image", index)
        t0 = time.monotonic()
        if watch is not None:
            watch.start(step)
        try:
            reply = http_post(base_url + route, payload, request_timeout)
        finally:
            if watch is not None:
                watch.stop()
        steps.append(
            {
                "step": step,
                "status": "timeout" if reply.timed_out else reply.status,
                "latency_s": round(reply.latency_s, 3),
                "detail": _detail(reply),
            }
        )
        if reply.timed_out:
            hang_at = t0
        return not reply.timed_out

    step_a, step_b, prefix = step_names("image")
    if send(step_a, words_text(words), 0) and send(step_b, SHORT_TEXT, 0):
        for i in range(1, n_images + 1):
            if not send(f"{prefix}{i}", SHORT_TEXT, i):
                break
    return steps, hang_at, {"words": words, "text_tokens": tokens}


def pooling_memory(
    base_url: str, api_pid: int, requests: int, request_timeout: float
) -> dict[str, Any]:
    """``requests`` embeddings requests that cycle through :data:`POOL_IMAGES` large images;
    the API server's RSS before, every tenth of the run, and after."""
    pngs = [make_png(9000 + i, side=POOL_IMAGE_SIDE) for i in range(POOL_IMAGES)]
    statuses: Counter[str] = Counter()
    samples = [procs.rss_mb(api_pid)]
    every = max(1, requests // 10)
    t0 = time.monotonic()
    for i in range(requests):
        reply = http_post(
            base_url + "/v1/embeddings",
            embeddings_payload(SHORT_TEXT, pngs[i % POOL_IMAGES]),
            request_timeout,
        )
        statuses["timeout" if reply.timed_out else str(reply.status)] += 1
        if reply.timed_out:
            break
        if (i + 1) % every == 0:
            samples.append(procs.rss_mb(api_pid))
    seconds = time.monotonic() - t0
    first, last = samples[0], samples[-1]
    return {
        "requests": sum(statuses.values()),
        "image_side": POOL_IMAGE_SIDE,
        "images": POOL_IMAGES,
        "statuses": dict(sorted(statuses.items())),
        "api_server_rss_mb": samples,
        "api_server_growth_mb": round(last - first, 1) if first and last else None,
        "seconds": round(seconds, 1),
    }


@dataclass(frozen=True)
class HttpCaseOptions:
    """The options of one case on a server (:func:`run_http_case`)."""

    n_images: int = 20
    """New images of the replay."""
    request_timeout: float = 20.0
    """Per-request timeout (s)."""
    startup_timeout: float = 300.0
    warmup_timeout: float = 300.0
    """The text-only request sent before the replay (a cold server compiles kernels then:
    vLLM's tensor-parallel embedding is ``torch.compile``d, tens of seconds on two cores)."""
    hang_watch_s: float = 25.0
    """How long ``/health`` is watched while the engine stays stuck."""
    pooling_requests: int = 1000
    """Requests of the pooling memory measurement (0: none), pooling shapes only."""


def run_http_case(
    shape: Shape,
    venv: Path,
    model: Path,
    log_path: Path,
    env: dict[str, str],
    options: HttpCaseOptions = HttpCaseOptions(),
    *,
    lock: ServerLock,
) -> dict[str, Any]:
    """One server of ``shape``, the incident replayed against it; the record (a dict)."""
    o = options
    n_images, request_timeout, pooling_requests = o.n_images, o.request_timeout, o.pooling_requests
    server = Server(venv, model, log_path, extra_args=list(shape.args), env=env, lock=lock)
    if shape.entry == API_SERVER_MODULE:
        server.cmd = module_command(server.cmd)
    rec: dict[str, Any] = {"log": str(log_path), "started": False, "error": ""}
    upto: int | None = None
    try:
        server.start()
        assert server.proc is not None
        root = server.proc.pid
        rec["startup_s"] = round(server.wait_ready(o.startup_timeout), 1)
        rec["started"] = True
        rec["supported_tasks"] = supported_tasks(log_path)
        rec["warmup"] = warm_up(server.base_url, shape.entry == POOLING, o.warmup_timeout)
        before = observe.snapshot(root, log_path)
        with HealthPoller(
            server.base_url, interval=HEALTH_INTERVAL_S, timeout=HEALTH_CLIENT_TIMEOUT_S
        ) as poller:
            t_start = time.monotonic()
            watch = observe.SlowWatch(root, log_path, after_s=SLOW_REQUEST_S)
            steps, hang_at, prompt = replay(
                server.base_url,
                pooling=shape.entry == POOLING,
                n_images=n_images,
                request_timeout=request_timeout,
                watch=watch,
            )
            rec["slow_requests"] = watch.seen
            if hang_at is not None:
                rec["engines_at_hang"] = observe.engines_after(root)
                rec["stacks"] = observe.dump_stacks(root, log_path.with_suffix(".stacks.txt"))
                # /health while the engine stays stuck (the plugin's liveness times out first).
                wait_until = time.monotonic() + o.hang_watch_s
                while time.monotonic() < wait_until:
                    time.sleep(0.5)
            else:
                time.sleep(HEALTH_INTERVAL_S * 4)
            t_end = time.monotonic()
        rec["steps"] = steps
        rec["statuses"] = [s["status"] for s in steps]
        rec["prompt"] = prompt
        rec["hung"] = hang_at is not None
        rec["health"] = observe.health_summary(poller.polls, t_start, t_end, hang_at)
        if hang_at is None:
            rec["engines_after"] = observe.engines_after(root)
            rec["metrics"] = observe.metrics_record(server.base_url)
            if shape.entry == POOLING and pooling_requests:
                rec["pooling_memory"] = pooling_memory(
                    server.base_url, root, pooling_requests, request_timeout
                )
        else:
            rec["engines_after"] = observe.engines_after(root)
        after = observe.snapshot(root, log_path)
        rec["processes"] = observe.merge_memory(before, after)
        rec["rss_mb_before"] = observe.total_rss(before)
        rec["rss_mb_after"] = observe.total_rss(after)
    except Exception as exc:  # noqa: BLE001 - recorded
        rec["error"] = f"{type(exc).__name__}: {exc}"[:500]
        if not rec["started"]:
            rec["start_failure"] = start_failure(log_path)
    finally:
        upto = observe.stop_offset(log_path)
        with contextlib.suppress(Exception):
            server.stop()
    rec.update(observe.named_lines(log_path))
    rec["plugin_warnings"] = observe.plugin_warnings(log_path)
    rec["failed_pings"] = observe.log_count(log_path, observe.FAILED_PING, upto)
    rec["log_markers"] = log_markers(log_path, upto)
    return rec
