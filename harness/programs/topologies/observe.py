"""What a shape run records about a running vLLM: processes, memory, ``/health``, ``/metrics``,
the plugin's log lines, and stacks when something hangs.

Everything here reads; nothing changes the server. Process data comes from
:mod:`harness.procs`, log lines from :mod:`harness.logscan`, ``/health`` polls from
:class:`harness.programs.health.HealthPoller`.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from harness import procs
from harness.http import http_get
from harness.logscan import log_process_names, plugin_lines
from harness.paths import cache_root
from harness.programs.health import parse_metrics, scrape
from vllm_mmcache_fix.core import messages
from vllm_mmcache_fix.metrics import names
from vllm_mmcache_fix.tools.diagnose import is_engine_core
from vllm_mmcache_fix.vllm_layout import ENGINE_PING_METHOD

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_NAMED = {
    messages.ACTIVE: re.compile(
        rf"{re.escape(messages.PREFIX)}{messages.ACTIVE} (?P<name>[A-Za-z][\w.-]*) pid=(?P<pid>\d+)"
    ),
    messages.STALL_SENTINEL_ACTIVE: re.compile(
        rf"{re.escape(messages.STALL_SENTINEL_ACTIVE)} (?P<name>[A-Za-z][\w.-]*) pid=(?P<pid>\d+)"
    ),
}
VLLM_SUCCESS = "vllm:request_success_total"


# ----------------------------------------------------------------------------- processes


def role(pid: int, root: int, log_names: dict[int, str]) -> str:
    """A process's role: the name vLLM logs it under, else its title (``VLLM::EngineCore``)."""
    if pid in log_names:
        return log_names[pid]
    title = procs.cmdline(pid)
    if title.startswith("VLLM::") or title.startswith("ray::"):
        return title.split()[0]
    if pid == root:
        return "main"
    comm = procs.comm(pid)
    for text in (title, comm):
        for mark in ("resource_tracker", "raylet", "gcs_server", "dashboard", "Worker"):
            if mark in text:
                return mark
    return comm or title.split(" ")[0] or f"pid{pid}"


def snapshot(root: int, log_path: Path) -> list[dict[str, Any]]:
    """Every process of the tree: pid, role, title (shortened), resident MiB."""
    log_names = log_process_names(log_path)
    rows = []
    for pid in procs.tree(root):
        rows.append(
            {
                "pid": pid,
                "role": role(pid, root, log_names),
                "title": procs.process_name(pid)[:100],
                "rss_mb": procs.rss_mb(pid),
            }
        )
    return rows


def total_rss(rows: list[dict[str, Any]]) -> float:
    return round(sum(r.get("rss_mb") or 0.0 for r in rows), 1)


def merge_memory(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per process seen in either snapshot, with RSS before and after."""
    by_pid: dict[int, dict[str, Any]] = {}
    for row in before:
        by_pid[row["pid"]] = {
            "pid": row["pid"],
            "role": row["role"],
            "title": row["title"],
            "rss_mb_before": row["rss_mb"],
            "rss_mb_after": None,
        }
    for row in after:
        entry = by_pid.setdefault(
            row["pid"],
            {"pid": row["pid"], "role": row["role"], "title": row["title"], "rss_mb_before": None},
        )
        entry["rss_mb_after"] = row["rss_mb"]
        if entry["role"].startswith("pid") or entry["role"] in ("main", "python"):
            entry["role"] = row["role"]
    return list(by_pid.values())


def engine_pids(root: int) -> list[int]:
    return [pid for pid in procs.tree(root) if is_engine_core(procs.comm(pid), procs.cmdline(pid))]


def engines_after(root: int, seconds: float = 2.0) -> dict[str, Any]:
    """CPU and spinning of each EngineCore of the tree over ``seconds`` (the diagnosis's view)."""
    found, error = procs.sample_tree(root, seconds)
    if found is None:
        return {"error": error}
    engines = set(engine_pids(root))
    out: dict[str, Any] = {"engines": []}
    for report in found.processes:
        if report.pid in engines and report.threads:
            spin = procs.spin_sample(report, found.interval)
            out["engines"].append(
                {
                    "pid": spin.pid,
                    "cpu_percent": spin.cpu_percent,
                    "spinning": spin.spinning,
                    "spinning_threads": spin.spinning_threads,
                }
            )
    out["spinning"] = any(e["spinning"] for e in out["engines"])
    out["cpu_percent"] = max((e["cpu_percent"] for e in out["engines"]), default=None)
    return out


PY_SPY = cache_root() / "venvs" / "dev" / "bin" / "py-spy"


def dump_stacks(
    root: int,
    out: Path,
    timeout: float = 30.0,
    native: bool = False,
    deepest_first: bool = False,
) -> dict[str, Any]:
    """``py-spy dump`` of every Python process of the tree into ``out``; a short summary.
    ``native``: with C/C++ frames (where a thread waits in OpenMP or a collective)."""
    if not PY_SPY.exists():
        return {"error": f"{PY_SPY} missing"}
    summary: dict[str, Any] = {"file": str(out), "processes": {}}
    pids = procs.tree(root)
    with open(out, "w", encoding="utf-8") as handle:
        for pid in reversed(pids) if deepest_first else pids:
            title = procs.process_name(pid)[:100]
            try:
                res = subprocess.run(
                    [str(PY_SPY), "dump", "--pid", str(pid), *(["--native"] if native else [])],
                    capture_output=True,
                    text=True,
                    timeout=timeout,
                )
                text = res.stdout or res.stderr
            except (OSError, subprocess.TimeoutExpired) as exc:
                text = f"py-spy failed: {exc}"
            handle.write(f"===== pid {pid} {title}\n{text}\n")
            summary["processes"][str(pid)] = {"title": title, "threads": _threads(text)}
    return summary


def cpu_by_process(root: int, seconds: float = 1.0) -> dict[str, Any]:
    """Each process's CPU over ``seconds`` and its busiest thread (percent of one core)."""
    found, error = procs.sample_tree(root, seconds)
    if found is None:
        return {"error": error}
    out: dict[str, Any] = {}
    for report in found.processes:
        busiest = report.threads[0] if report.threads else None
        out[str(report.pid)] = {
            "title": (report.cmdline or report.comm)[:60],
            "cpu_percent": round(100.0 * report.cpu_fraction, 1),
            "busiest_thread": busiest.label[:60] if busiest else None,
            "busiest_percent": round(100.0 * busiest.cpu_fraction, 1) if busiest else None,
        }
    return out


class SlowWatch:
    """Looks at the whole tree once a request has been in flight for ``after_s`` seconds:
    CPU per process, then every process's stacks with native frames (``py-spy dump
    --native``), for at most ``limit`` requests of a case. A slow first request is where an
    intermittent timeout starts; this is what it was doing."""

    def __init__(self, root: int, log_path: Path, after_s: float = 5.0, limit: int = 2) -> None:
        self.root = root
        self.log_path = log_path
        self.after_s = after_s
        self.limit = limit
        self.seen: list[dict[str, Any]] = []
        self._timer: threading.Timer | None = None

    def start(self, step: str) -> None:
        self.stop()
        if len(self.seen) >= self.limit:
            return
        self._timer = threading.Timer(self.after_s, self.look, args=(step,))
        self._timer.daemon = True
        self._timer.start()

    def stop(self) -> None:
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()

    def look(self, step: str) -> None:
        """Record the tree now (the request for ``step`` has been slow): which processes
        there are (with their parents: a compiler or helper a worker started shows here),
        every process's stacks, the deepest processes first (workers, then EngineCore),
        then CPU per process over a second."""
        if len(self.seen) >= self.limit:
            return
        safe = re.sub(r"[^\w.-]", "_", step)
        entry: dict[str, Any] = {"step": step, "after_s": self.after_s}
        self.seen.append(entry)
        try:
            entry["tree"] = [
                {"pid": pid, "ppid": procs.parent(pid), "title": procs.process_name(pid)[:120]}
                for pid in procs.tree(self.root)
            ]
            out = self.log_path.with_suffix(f".slow-{safe}.txt")
            entry["stacks"] = dump_stacks(self.root, out, native=True, deepest_first=True)
            entry["cpu"] = cpu_by_process(self.root)
        except Exception as exc:  # noqa: BLE001 - recorded
            entry["error"] = repr(exc)[:300]


def _threads(dump: str) -> list[str]:
    """``thread name (state): innermost frame`` for each thread of one py-spy dump."""
    out = []
    lines = dump.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("Thread "):
            frame = lines[i + 1].strip() if i + 1 < len(lines) else ""
            out.append(f"{line.strip()[:80]} | {frame[:120]}")
    return out[:20]


# ----------------------------------------------------------------------------- the log


def named_lines(log_path: Path) -> dict[str, list[str]]:
    """Processes that logged the plugin active, and those that ran the stall sentinel."""
    found: dict[str, set[str]] = {messages.ACTIVE: set(), messages.STALL_SENTINEL_ACTIVE: set()}
    for lines in plugin_lines(log_path).values():
        for raw in lines:
            line = _ANSI.sub("", raw)
            for key, pattern in _NAMED.items():
                m = pattern.search(line)
                if m:
                    found[key].add(f"{m.group('name')} pid={m.group('pid')}")
    return {
        "active_in": sorted(found[messages.ACTIVE]),
        "sentinel_in": sorted(found[messages.STALL_SENTINEL_ACTIVE]),
    }


def names_only(entries: list[str]) -> list[str]:
    """``["APIServer pid=1", "EngineCore pid=2"]`` -> ``["APIServer", "EngineCore"]``."""
    return sorted(e.split(" pid=")[0] for e in entries)


_LEVEL = re.compile(r"^(?:\([^()]+\) )?(?P<level>[A-Z]+) \d")


def plugin_warnings(log_path: Path, limit: int = 8) -> list[str]:
    """The plugin's WARNING and ERROR lines (stalls, internal errors, drift), shortened."""
    out = []
    for lines in plugin_lines(log_path).values():
        for raw in lines:
            line = _ANSI.sub("", raw)
            m = _LEVEL.match(line)
            if m and m.group("level") in ("WARNING", "ERROR"):
                out.append(line[:240])
    return out[:limit]


FAILED_PING = f"Invocation of {ENGINE_PING_METHOD} method failed"
"""What EngineCore logs (with a traceback) when the liveness round trip reaches an engine
without the plugin's answer method."""


def log_count(log_path: Path, text: str, upto: int | None = None) -> int:
    try:
        with open(log_path, "rb") as handle:
            data = handle.read() if upto is None else handle.read(upto)
    except OSError:
        return 0
    return data.decode(errors="replace").count(text)


# ----------------------------------------------------------------------------- /health


def health_summary(
    polls: list[tuple[float, int | None, float]],
    start: float,
    end: float,
    hang_at: float | None = None,
) -> dict[str, Any]:
    """``/health`` polls between ``start`` and ``end`` (monotonic times): statuses counted,
    slowest answer, and, when a request hung at ``hang_at``, when the first non-200 came."""
    window = [p for p in polls if start <= p[0] <= end]
    counts = Counter("none" if s is None else str(s) for _, s, _ in window)
    out: dict[str, Any] = {
        "polls": len(window),
        "statuses": dict(sorted(counts.items())),
        "max_s": round(max((t for _, _, t in window), default=0.0), 3),
    }
    if hang_at is not None:
        bad = [p for p in window if p[0] >= hang_at and p[1] != 200]
        out["first_non_200_after_hang_s"] = round(bad[0][0] - hang_at, 1) if bad else None
        after = [s for t, s, _ in window if t >= hang_at]
        out["after_hang"] = dict(
            sorted(Counter("none" if s is None else str(s) for s in after).items())
        )
    return out


# ----------------------------------------------------------------------------- /metrics


def metrics_record(base_url: str, health_calls: int = 12) -> dict[str, Any]:
    """The plugin's samples on ``/metrics`` (and vLLM's finished-request counter), read after
    ``health_calls`` ``/health`` calls (EngineCore's counters travel with the round trip) and
    a pause for the exporter's one-second sync."""
    for _ in range(health_calls):
        http_get(base_url + "/health", 30)
    time.sleep(2.5)
    status: int | None = None
    plugin: dict[str, float] = {}
    text = ""
    for _ in range(3):  # with several API servers, each scrape may land on another one
        status, plugin, text = scrape(base_url)
        if status == 200 and plugin:
            break
        time.sleep(1.0)
    vllm = parse_metrics(text, prefix=VLLM_SUCCESS)
    rec: dict[str, Any] = {
        "status": status,
        "protected_api_server": plugin.get(
            f'{names.PROTECTED_PROCESSES}{{kind="{names.KIND_API_SERVER}"}}'
        ),
        "protected_engine_core": plugin.get(
            f'{names.PROTECTED_PROCESSES}{{kind="{names.KIND_ENGINE_CORE}"}}'
        ),
        "rollbacks": plugin.get(names.ROLLBACKS),
        "recoveries": plugin.get(names.RECOVERIES),
        "drift_events": plugin.get(names.DRIFT_EVENTS),
        "round_trips": plugin.get(f"{names.ROUND_TRIP_SECONDS}_count"),
        "round_trips_failed": sum(
            v for k, v in plugin.items() if k.startswith(names.STUCK_HEALTH_CHECKS)
        ),
        "stalls": sum(v for k, v in plugin.items() if k.startswith(names.STALLS)),
        "internal_errors": sum(v for k, v in plugin.items() if k.startswith(names.INTERNAL_ERRORS)),
        "vllm_request_success": sum(vllm.values()) if vllm else None,
        "plugin_series": len(plugin),
    }
    return rec


def stop_offset(log_path: Path) -> int | None:
    with contextlib.suppress(OSError):
        return Path(log_path).stat().st_size
    return None
