"""One case of a program shape: an ``AsyncLLM`` embedded in a program, or offline ``LLM(...)``.

The program (``programs/embedded_async.py`` or ``programs/offline_llm.py``) runs with the
venv's Python in its own process group, under the server lock the caller holds (the lock
file names its group, so a later holder stops it if this process dies). It writes its
outcomes as ``@@topo`` lines into its log, which is read as it grows. Every wait is
bounded: the start, each request (the harness's own clock: ``LLM.chat`` blocks, and a
frozen engine never returns), and the end; the whole group is killed afterwards.

Before the first request and after the last one the program waits for a go-ahead file,
so the process table and its memory are read while the engine is still up.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import procs, tiny_models
from harness.lock import ServerLock
from harness.logscan import log_markers
from harness.payloads import SHORT_TEXT, make_png
from harness.programs.topologies import observe
from harness.programs.topologies.shapes import EMBEDDED, Shape
from harness.server import MAX_MODEL_LEN, server_env, skips_mm_profiling
from harness.venvs import venv_python, venv_vllm_version

PROGRAMS = Path(__file__).resolve().parent / "programs"
EVENT_PREFIX = "@@topo "
SLOW_REQUEST_S = 5.0
"""A request in flight this long gets the processes' CPU and stacks recorded."""
ENGINE_ARGS: dict[str, object] = {
    "load_format": "dummy",
    "enforce_eager": True,
    "max_model_len": MAX_MODEL_LEN,
    "max_num_seqs": 4,
    "mm_processor_cache_gb": 0.001,
    "limit_mm_per_prompt": {"image": 1, "video": 0},
}
"""What :func:`harness.server.server_command` gives a server, as engine keyword arguments."""


class LogEvents:
    """The ``@@topo`` events of a growing log, read incrementally."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.partial = b""
        self.events: list[dict[str, Any]] = []
        self.cursor = 0

    def poll(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as handle:
                handle.seek(self.offset)
                data = handle.read()
        except OSError:
            return []
        self.offset += len(data)
        data = self.partial + data
        lines = data.split(b"\n")
        self.partial = lines.pop()
        new = []
        for raw in lines:
            line = raw.decode(errors="replace")
            at = line.find(EVENT_PREFIX)
            if at < 0:
                continue
            try:
                event = json.loads(line[at + len(EVENT_PREFIX) :])
            except ValueError:
                continue
            event["seen"] = time.monotonic()
            new.append(event)
        self.events.extend(new)
        return new

    def wait(
        self, kinds: tuple[str, ...], timeout: float, proc: subprocess.Popen[bytes]
    ) -> dict[str, Any] | None:
        """The next event of one of ``kinds`` after the last one taken (events of other
        kinds stay in :attr:`events`); None on timeout or when the program exited first."""
        deadline = time.monotonic() + timeout
        while True:
            self.poll()
            for index in range(self.cursor, len(self.events)):
                if self.events[index]["event"] in kinds:
                    self.cursor = index + 1
                    return self.events[index]
            if proc.poll() is not None and not self.poll():
                return None
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.2)


def write_config(
    shape: Shape,
    model: Path,
    work: Path,
    *,
    n_images: int,
    request_timeout: float,
    skip_mm_profiling: bool = False,
) -> Path:
    images = []
    for i in range(n_images + 1):
        path = work / f"img{i}.png"
        path.write_bytes(make_png(i))
        images.append(str(path))
    cfg = {
        "model": str(model),
        "engine_args": {
            **ENGINE_ARGS,
            **({"skip_mm_profiling": True} if skip_mm_profiling else {}),
            **shape.engine_args,
        },
        "images": images,
        "words": list(tiny_models.model_module().WORDS),
        "target_tokens": MAX_MODEL_LEN - 7,
        "short_text": SHORT_TEXT,
        "request_timeout_s": request_timeout,
        "health_timeout_s": 30.0,
        "health_interval_s": 0.5,
        "health_after_hang_s": 25.0,
        "go_file": str(work / "go"),
        "finish_file": str(work / "finish"),
    }
    path = work / "config.json"
    path.write_text(json.dumps(cfg, indent=1))
    return path


def run_program_case(
    shape: Shape,
    venv: Path,
    model: Path,
    log_path: Path,
    env: dict[str, str],
    *,
    lock: ServerLock,
    n_images: int = 20,
    request_timeout: float = 20.0,
    startup_timeout: float = 300.0,
) -> dict[str, Any]:
    program = "embedded_async.py" if shape.entry == EMBEDDED else "offline_llm.py"
    rec: dict[str, Any] = {"log": str(log_path), "started": False, "error": ""}
    log_path.parent.mkdir(parents=True, exist_ok=True)
    proc: subprocess.Popen[bytes] | None = None
    upto: int | None = None
    with tempfile.TemporaryDirectory(prefix="topologies-") as tmp:
        work = Path(tmp)
        cfg = write_config(
            shape,
            model,
            work,
            n_images=n_images,
            request_timeout=request_timeout,
            skip_mm_profiling=skips_mm_profiling(venv_vllm_version(venv)),
        )
        try:
            with open(log_path, "wb") as log:
                proc = subprocess.Popen(
                    [str(venv_python(venv)), str(PROGRAMS / program), str(cfg)],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=server_env(env),
                    cwd=str(work),
                    start_new_session=True,
                )
            lock.update(server_pgid=proc.pid, port=None, log=str(log_path))
            root = proc.pid
            events = LogEvents(log_path)
            t_launch = time.monotonic()
            ready = events.wait(("ready", "error"), startup_timeout, proc)
            if ready is None or ready["event"] != "ready":
                rec["error"] = (ready or {}).get("error") or (
                    f"program exited with {proc.returncode}"
                    if proc.poll() is not None
                    else f"not ready after {startup_timeout:.0f} s"
                )
                from harness.programs.topologies.http_case import start_failure

                rec["start_failure"] = start_failure(log_path)
                return rec
            rec["started"] = True
            rec["startup_s"] = round(time.monotonic() - t_launch, 1)
            before = observe.snapshot(root, log_path)
            (work / "go").touch()
            rec.update(_follow(events, proc, root, log_path, n_images, request_timeout))
            after = observe.snapshot(root, log_path)
            rec["processes"] = observe.merge_memory(before, after)
            rec["rss_mb_before"] = observe.total_rss(before)
            rec["rss_mb_after"] = observe.total_rss(after)
            (work / "finish").touch()
            if not rec.get("hung"):
                try:
                    rec["exit_code"] = proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    rec["exit_code"] = "no exit within 60 s"
        except Exception as exc:  # noqa: BLE001 - recorded
            rec["error"] = f"{type(exc).__name__}: {exc}"[:500]
        finally:
            upto = observe.stop_offset(log_path)
            if proc is not None:
                members = procs.tree(proc.pid)
                procs.kill_group(proc.pid, grace=5.0)
                for pid in members[1:]:
                    if procs.cmdline(pid):
                        try:
                            os.kill(pid, 9)
                        except (ProcessLookupError, PermissionError):
                            pass
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
            lock.update(server_pgid=None, port=None, log=None)
    rec.update(observe.named_lines(log_path))
    rec["plugin_warnings"] = observe.plugin_warnings(log_path)
    rec["failed_pings"] = observe.log_count(log_path, observe.FAILED_PING, upto)
    rec["log_markers"] = log_markers(log_path, upto)
    return rec


def _pending(events: LogEvents, steps: list[dict[str, Any]]) -> str | None:
    """The step the program said it is sending and has not answered yet."""
    answered = {s["step"] for s in steps}
    sent = [e["step"] for e in events.events if e["event"] == "sending"]
    pending = [name for name in sent if name not in answered]
    return pending[-1] if pending else None


def _follow(
    events: LogEvents,
    proc: subprocess.Popen[bytes],
    root: int,
    log_path: Path,
    n_images: int,
    request_timeout: float,
) -> dict[str, Any]:
    """The program's steps, each within ``request_timeout`` plus a margin; its ``done``."""
    out: dict[str, Any] = {"steps": [], "hung": False}
    t_start = time.monotonic()
    hang_at: float | None = None
    harness_saw_hang = False
    watch = observe.SlowWatch(root, log_path, after_s=SLOW_REQUEST_S)
    out["slow_requests"] = watch.seen
    kinds = ("step", "done", "error")
    for _ in range(n_images + 2):
        deadline = time.monotonic() + request_timeout + 15.0
        step = events.wait(kinds, SLOW_REQUEST_S, proc)
        if step is None and proc.poll() is None:
            watch.look(_pending(events, out["steps"]) or "?")
            step = events.wait(kinds, max(0.0, deadline - time.monotonic()), proc)
        if step is None:
            sending = [e for e in events.events if e["event"] == "sending"]
            hang_at = sending[-1]["t"] if sending else time.monotonic() - request_timeout
            harness_saw_hang = True
            out["steps"].append(
                {
                    "step": _pending(events, out["steps"]) or "?",
                    "status": "timeout",
                    "latency_s": None,
                    "detail": "no answer from the program in time",
                }
            )
            break
        if step["event"] != "step":
            if step["event"] == "error":
                out["error"] = step.get("error", "")
            break
        out["steps"].append({k: step.get(k) for k in ("step", "status", "latency_s", "detail")})
        if step.get("status") == "timeout":
            hang_at = step["t"] - float(step.get("latency_s") or 0.0)
            break
    out["statuses"] = [s["status"] for s in out["steps"]]
    out["hung"] = hang_at is not None
    if hang_at is not None:
        out["engines_at_hang"] = observe.engines_after(root)
        out["stacks"] = observe.dump_stacks(root, log_path.with_suffix(".stacks.txt"))
    # A program stuck inside a blocking call never says "done"; one that timed the request
    # out itself watches its health check for a while first.
    done = None if harness_saw_hang else events.wait(("done",), 60.0, proc)
    if done is not None:
        out["plugin_in_process"] = done.get("plugin")
    out["engines_after"] = observe.engines_after(root)
    health = [e for e in events.events if e["event"] == "health"]
    if health:
        # The program's clock is the machine's monotonic clock, as the harness's.
        polls: list[tuple[float, int | None, float]] = [
            (e["t"], 200 if e["outcome"] == "ok" else 503, e["seconds"]) for e in health
        ]
        out["health"] = observe.health_summary(polls, t_start, time.monotonic(), hang_at)
        out["health"]["check"] = "AsyncLLM.check_health()"
        failures = sorted({e["outcome"][:160] for e in health if e["outcome"] != "ok"})
        out["health"]["failures"] = failures[:3]
    else:
        out["health"] = {"check": "none: offline LLM has no health check"}
    return out
