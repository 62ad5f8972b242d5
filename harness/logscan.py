"""What a server log says: incident markers, the plugin's lines and counters, process names."""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, field
from pathlib import Path

from vllm_mmcache_fix.core import messages
from vllm_mmcache_fix.core.guard import InjectedFault

PLUGIN_TAG = messages.PREFIX.rstrip()

LOG_MARKERS = {
    "cached_item_assert": "Expected a cached item",
    "engine_dead": "EngineDeadError",
    "cache_drift": "P0/P1 cache drift",
    "too_long": "exceeds model's maximum context length",
    "traceback": "Traceback (most recent call last)",
}

# EngineCore asked for an item it does not hold (P0/P1 drift reached it):
# vLLM <= 0.27 fails an assertion, 0.28+ logs a cache miss.
ENGINE_MISS_MARKERS = (
    "AssertionError: Expected a cached item",
    "Multi-modal cache miss for request",
)

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_PROC_PREFIX = re.compile(r"^\((?P<name>[^()\s]+) pid=(?P<pid>\d+)\)\s*")
_SELF_NAMED = re.compile(r"\bin (?P<name>[A-Za-z][\w.-]*) pid=(?P<pid>\d+)")
_LOG_PREFIX = re.compile(r"^\((?P<name>[A-Za-z][\w.-]*) pid=(?P<pid>\d+)\)")
_TOTALS = re.compile(r"totals:(?P<rest>.*)$", re.I)
_COUNTER = re.compile(r"(?P<key>[a-z_]+)=(?P<value>\d+)")


def _lines(log_path: Path, upto: int | None = None) -> list[str]:
    """The log's lines (its first ``upto`` bytes only, when given); empty when unreadable."""
    try:
        with open(log_path, "rb") as f:
            data = f.read() if upto is None else f.read(upto)
    except OSError:
        return []
    return data.decode(errors="replace").splitlines()


_SUPPORTED_TASKS = re.compile(
    r"[Ss]upported[_ ]tasks:?\s*(?P<tasks>\[[^\]]*\]|\{[^}]*\}|\([^)]*\))"
)
"""``Supported tasks: ['generate']`` (0.12+); ``Supported_tasks: ['generate']`` (0.11);
a set or tuple in some releases."""


def supported_tasks(log_path: Path) -> list[str] | None:
    """The tasks vLLM said it serves (``Supported tasks: ['generate']``); None if unsaid.

    A model whose config vLLM does not read as a generative model is served for pooling:
    every request then fails or returns without generating, so callers check this.
    """
    for line in _lines(log_path):
        m = _SUPPORTED_TASKS.search(line)
        if m:
            return re.findall(r"['\"]([^'\"]+)['\"]", m.group("tasks"))
    return None


def log_markers(log_path: Path, upto: int | None = None) -> dict[str, int]:
    """How many log lines carry each known incident marker (first ``upto`` bytes only)."""
    lines = _lines(log_path, upto)
    if not lines and not Path(log_path).exists():
        return {}
    return {key: sum(1 for ln in lines if text in ln) for key, text in LOG_MARKERS.items()}


def engine_cache_misses(log_path: Path, upto: int | None = None) -> int:
    """Log lines in which EngineCore reports an item it should have had (first ``upto`` bytes)."""
    return sum(1 for line in _lines(log_path, upto) if any(m in line for m in ENGINE_MISS_MARKERS))


def plugin_lines(log_path: Path) -> dict[str, list[str]]:
    """Lines with the plugin tag, grouped by the process that wrote them."""
    out: dict[str, list[str]] = {}
    for raw in _lines(log_path):
        line = _ANSI.sub("", raw)
        if PLUGIN_TAG not in line:
            continue
        m = _PROC_PREFIX.match(line) or _SELF_NAMED.search(line)
        proc = m.group("name") if m else "main"
        out.setdefault(proc, []).append(line)
    return out


def plugin_trouble(log_path: Path) -> list[str]:
    """The plugin's lines that no healthy run may print: an engine liveness check turned off,
    an internal error other than a fault a test injected (``InjectedFault``)."""
    bad = (messages.PREFIX + messages.ENGINE_CHECK_OFF, messages.PREFIX + messages.INTERNAL_ERROR)
    return [
        line
        for lines in plugin_lines(log_path).values()
        for line in lines
        if any(marker in line for marker in bad) and InjectedFault.__name__ not in line
    ]


def log_process_names(log_path: Path) -> dict[int, str]:
    """PID -> name from vLLM's ``(Name pid=N)`` log prefixes (first name seen wins)."""
    names: dict[int, str] = {}
    with contextlib.suppress(OSError), open(log_path, encoding="utf-8", errors="replace") as f:
        for line in f:
            m = _LOG_PREFIX.match(line)
            if m:
                names.setdefault(int(m.group("pid")), m.group("name"))
    return names


@dataclass
class PluginCounters:
    lines: int = 0
    active_in: list[str] = field(default_factory=list)
    repair_lines: int = 0
    drift_lines: int = 0
    rollback_lines: int = 0
    warning_lines: int = 0
    totals: dict[str, dict[str, int]] = field(default_factory=dict)
    """Highest value of each counter a process logged in a "totals" clause."""
    last_lines: list[str] = field(default_factory=list)


def plugin_counters(log_path: Path, keep_last: int = 8) -> PluginCounters:
    """The plugin's log lines, counted by kind, with the counters they carry."""
    counters = PluginCounters()
    every: list[str] = []
    for proc, lines in sorted(plugin_lines(log_path).items()):
        for line in lines:
            every.append(line)
            counters.lines += 1
            if " WARNING " in line:
                counters.warning_lines += 1
            if f"{messages.PREFIX}{messages.ACTIVE} " in line:
                counters.active_in.append(proc)
            if messages.REPAIRED in line:
                counters.repair_lines += 1
            if "multimodal cache drift" in line:
                counters.drift_lines += 1
            if "undid the multimodal cache changes" in line:
                counters.rollback_lines += 1
            m = _TOTALS.search(line)
            if m:
                seen = counters.totals.setdefault(proc, {})
                for c in _COUNTER.finditer(m.group("rest")):
                    key, value = c.group("key"), int(c.group("value"))
                    seen[key] = max(seen.get(key, 0), value)
    counters.last_lines = [line[:240] for line in every[-keep_last:]]
    return counters
