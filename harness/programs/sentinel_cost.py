"""What the stall sentinel costs on an idle real server.

Two servers in one run, one after the other under one hold of the server lock:
the plugin with the sentinel on (default threshold), then the same plugin with
``MMCACHE_FIX_STALL_SECONDS=0``. Each idles for ``--seconds`` after start-up;
the sentinel's own thread (named ``mmcache-stall``) and each process as a whole
are measured from ``/proc/<pid>/task/<tid>/schedstat`` (nanoseconds on a CPU).

    scripts/sentinel-cost --version 0.23.0 --seconds 60 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any, cast

from harness import procs, runner
from harness.venvs import build_wheel, complete_venv
from vllm_mmcache_fix.core.settings import ENV_STALL_SECONDS
from vllm_mmcache_fix.stall_sentinel.fix import NATIVE_THREAD_NAME


def _cpu_ns(pid: int) -> dict[int, tuple[str, int]]:
    """tid -> (comm, ns on a CPU) for every thread of ``pid``."""
    out: dict[int, tuple[str, int]] = {}
    task = f"/proc/{pid}/task"
    for name in os.listdir(task):
        try:
            with open(f"{task}/{name}/comm") as handle:
                comm = handle.read().strip()
            with open(f"{task}/{name}/schedstat") as handle:
                text = handle.read()
        except OSError:
            continue
        fields = text.split()
        if fields and fields[0].isdigit():
            out[int(name)] = (comm, int(fields[0]))
    return out


def measure_idle(server_pid: int, seconds: float) -> dict[str, dict[str, float | None]]:
    pids = {"API server": server_pid, "EngineCore": procs.find_engine_core(server_pid)}
    before = {kind: _cpu_ns(pid) for kind, pid in pids.items() if pid}
    time.sleep(seconds)
    result: dict[str, dict[str, float | None]] = {}
    for kind, pid in pids.items():
        if not pid:
            continue
        after = _cpu_ns(pid)
        total = sum(ns - before[kind].get(tid, (comm, ns))[1] for tid, (comm, ns) in after.items())
        sentinel = [
            ns - before[kind][tid][1]
            for tid, (comm, ns) in after.items()
            if comm == NATIVE_THREAD_NAME and tid in before[kind]
        ]
        result[kind] = {
            "process_cpu_ms": round(total / 1e6, 2),
            "sentinel_cpu_ms": round(sentinel[0] / 1e6, 2) if sentinel else None,
            "sentinel_percent_of_a_core": round(100 * sentinel[0] / 1e9 / seconds, 4)
            if sentinel
            else None,
            "sentinel_ms_per_sample": round(sentinel[0] / 1e6 / seconds, 3) if sentinel else None,
        }
    return result


def sample_cost(threads: int = 16, samples: int = 300) -> dict[str, float]:
    """CPU time of one sentinel sample in this process with ``threads`` idle Python threads."""
    import threading

    from vllm_mmcache_fix.stall_sentinel.detect import Detector

    stop = threading.Event()
    idle = [threading.Thread(target=stop.wait, daemon=True) for _ in range(threads)]
    for thread in idle:
        thread.start()
    detector = Detector(10.0, lambda stall: None)
    spent: list[float] = []
    for _ in range(samples):
        started = time.thread_time()
        detector.sample()
        spent.append(time.thread_time() - started)
    stop.set()
    spent.sort()
    return {
        "python_threads": threads + 1,
        "samples": samples,
        "median_ms": round(1e3 * spent[len(spent) // 2], 3),
        "p99_ms": round(1e3 * spent[int(len(spent) * 0.99)], 3),
    }


def run(version: str, seconds: float) -> dict[str, object]:
    venv = complete_venv(version)
    out: dict[str, object] = {"vllm_version": version, "idle_seconds": seconds}
    out["per-sample cost, 17 Python threads"] = sample_cost(16)
    with tempfile.TemporaryDirectory() as tmp:
        wheel = build_wheel(Path(tmp))
        with runner.plugin_state(venv, wheel, purpose="sentinel cost") as lock:
            for label, env in (("sentinel on", {}), ("sentinel off", {ENV_STALL_SECONDS: "0"})):
                name = f"sentinel-cost-{label.replace(' ', '-')}"
                session = runner.Session(runner.ServerSpec(venv, env=env, name=name), lock=lock)

                def idle(s: runner.Session, label: str = label) -> None:
                    time.sleep(5)  # let start-up work settle
                    assert s.pid is not None
                    out[label] = measure_idle(s.pid, seconds)

                session.run(idle)
                if session.error:
                    raise RuntimeError(f"{label}: {session.error}; see {session.log_path}")
                out[f"{label} log"] = str(session.log_path)
    for kind in ("API server", "EngineCore"):
        on = cast("dict[str, dict[str, Any]]", out["sentinel on"]).get(kind, {})
        off = cast("dict[str, dict[str, Any]]", out["sentinel off"]).get(kind, {})
        if on and off and off.get("process_cpu_ms"):
            out[f"{kind} idle CPU ratio on/off"] = round(
                on["process_cpu_ms"] / off["process_cpu_ms"], 3
            )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--version", default="0.23.0")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--sample-only", action="store_true", help="only the per-sample cost, no server"
    )
    args = parser.parse_args(argv)
    result = (
        {"per-sample cost": [sample_cost(n) for n in (4, 16, 64)]}
        if args.sample_only
        else run(args.version, args.seconds)
    )
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
