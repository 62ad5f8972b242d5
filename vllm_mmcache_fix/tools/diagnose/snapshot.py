"""The stall snapshot the API server wrote at a ``/health`` verdict, read back for diagnose.

``diagnose --snapshot FILE`` shows one; ``diagnose --pid N`` shows the newest one an API
server of the diagnosed process tree wrote (its pid is in the file name) in the snapshot
directory (``MMCACHE_FIX_SNAPSHOT_DIR`` as diagnose sees it, else the default), after that
process started: a PID is reused (PID 1 in every container), and a snapshot an earlier
process with the same PID left is not this one's. Only a regular file of at most
:data:`MAX_FILE_BYTES` whose fields have a snapshot's shapes is read. Nothing here prints;
the CLI passes everything through its redaction.
"""

from __future__ import annotations

import calendar
import json
import os
import re
import stat
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ...core.procfs import parse_stat
from ...core.settings import read_snapshot_dir
from ...engine_liveness.snapshot import (
    FILE_PREFIX,
    KEY_DETAILS,
    KEY_KIND,
    KEY_REQUESTS,
    KEY_STACKS,
    KEY_VERDICT,
    KIND_VALUE,
    MAX_BYTES,
)

_PID_IN_NAME = re.compile(
    rf"^{re.escape(FILE_PREFIX)}.+?-(\d+)-(\d{{8}}T\d{{6}})-(\d{{3}})(?:-\d+)?\.json$"
)
MAX_FILE_BYTES = 4 * MAX_BYTES
"""The largest file read as a snapshot (the plugin writes at most :data:`MAX_BYTES`)."""
START_SLACK_S = 2.0
"""How much earlier than its process's start a snapshot's time may be and still be that
process's: the boot time ``/proc/stat`` gives is in whole seconds."""
SHOWN_FRAMES = 6
"""Innermost frames shown per thread in the text (the JSON keeps all)."""


class SnapshotError(Exception):
    """A file that is not a readable stall snapshot (the message says why)."""


def load_snapshot(path: Path) -> dict[str, Any]:
    """The snapshot in ``path``; :class:`SnapshotError` for anything else (not a regular
    file, larger than :data:`MAX_FILE_BYTES`, not JSON, not a snapshot, fields of the
    wrong shape)."""
    data = _read_json(path)
    if not isinstance(data, dict) or data.get(KEY_KIND) != KIND_VALUE:
        raise SnapshotError(f"{path}: not a vllm-mmcache-fix stall snapshot")
    problem = _shape_problem(data)
    if problem:
        raise SnapshotError(f"{path}: not a well-formed stall snapshot ({problem})")
    return data


def _read_json(path: Path) -> Any:
    """The JSON in a regular file of at most :data:`MAX_FILE_BYTES`. Opened without
    blocking (a FIFO would wait for a writer) and checked on the open file (what ``path``
    names may change in between)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise SnapshotError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise SnapshotError(f"{path}: not a regular file, not a stall snapshot")
        with os.fdopen(fd, "rb", closefd=False) as handle:
            raw = handle.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise SnapshotError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    finally:
        os.close(fd)
    if len(raw) > MAX_FILE_BYTES:
        raise SnapshotError(
            f"{path}: more than {MAX_FILE_BYTES} bytes, not a stall snapshot (at most {MAX_BYTES})"
        )
    try:
        return json.loads(raw.decode("utf-8", "replace"))
    except ValueError as exc:
        raise SnapshotError(f"{path}: not JSON ({exc})") from None


# Where each object and list of a snapshot is (None: one of the top level's fields).
_OBJECTS = (
    (None, KEY_VERDICT),
    (None, KEY_DETAILS),
    (None, "last_answer"),
    ("last_answer", "progress"),
    ("last_answer", "loop"),
)
_LISTS = ((KEY_DETAILS, KEY_REQUESTS), (KEY_DETAILS, KEY_STACKS), ("progress", "recent_steps_s"))


def _shape_problem(data: Mapping[str, Any]) -> str | None:
    """The first field that is not the object or list :func:`render_snapshot` reads."""
    found: dict[str | None, Mapping[str, Any]] = {None: data}
    for parent, key in _OBJECTS:
        value = (found.get(parent) or {}).get(key)
        if value is not None and not isinstance(value, Mapping):
            return f"{key} is {type(value).__name__}, not an object"
        found[key] = value or {}
    for parent, key in _LISTS:
        value = found[parent].get(key)
        if value is not None and not isinstance(value, list):
            return f"{key} is {type(value).__name__}, not a list"
    for item in found[KEY_DETAILS].get(KEY_STACKS) or []:
        frames = item.get("frames") if isinstance(item, Mapping) else None
        if frames is not None and not isinstance(frames, list):
            return f"a stack's frames are {type(frames).__name__}, not a list"
    return None


def find_snapshot(
    pids: Iterable[int], directory: Path | None = None, *, proc_root: Path = Path("/proc")
) -> Path | None:
    """The newest snapshot written by one of ``pids`` since it started (None: none).

    A file names the writer's pid and when it was written (UTC, to the millisecond); one
    written more than :data:`START_SLACK_S` before the process now holding that pid started
    was left by an earlier process with the same pid, and is not shown. Where the start
    cannot be read (the process has gone, ``/proc`` is not readable), no snapshot is
    tied to that pid."""
    if directory is None:
        directory = Path(read_snapshot_dir()[0])
    started = {str(p): process_started(p, proc_root) for p in pids}
    try:
        files = list(directory.glob(f"{FILE_PREFIX}*.json"))
    except OSError:
        return None
    mine = []
    for file in files:
        match = _PID_IN_NAME.match(file.name)
        if match is None or started.get(match.group(1)) is None:
            continue
        written = _written_at(match.group(2), match.group(3))
        start = started[match.group(1)]
        if written is None or start is None or written < start - START_SLACK_S:
            continue
        try:
            mine.append((written, file.stat().st_mtime, file))
        except OSError:
            continue
    return max(mine)[2] if mine else None


def _written_at(stamp: str, millis: str) -> float | None:
    """Seconds since the epoch of a file name's ``YYYYmmddTHHMMSS`` (UTC) and milliseconds."""
    try:
        return calendar.timegm(time.strptime(stamp, "%Y%m%dT%H%M%S")) + int(millis) / 1000
    except ValueError:
        return None


def process_started(pid: int, proc_root: Path = Path("/proc")) -> float | None:
    """When process ``pid`` started, in seconds since the epoch: the boot time (``btime``
    in ``/proc/stat``) plus ``starttime`` of its ``/proc/PID/stat`` (clock ticks since
    boot). None when either cannot be read."""
    try:
        ticks = parse_stat((proc_root / str(pid) / "stat").read_text()).starttime
        boot_lines = (proc_root / "stat").read_text().splitlines()
        boot = next(int(line.split()[1]) for line in boot_lines if line.startswith("btime "))
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def render_snapshot(data: Mapping[str, Any], path: Path | str) -> str:
    verdict = data.get(KEY_VERDICT) or {}
    details = data.get(KEY_DETAILS) or {}
    lines = [
        f"stall snapshot {path}",
        f"  written {data.get('written_at')} by {data.get('api_server')} for "
        f"{data.get('engine')}: stall class {verdict.get('class')}",
        f"  verdict: {verdict.get('text')}",
    ]
    answer = data.get("last_answer") or {}
    progress = answer.get("progress") or {}
    loop = answer.get("loop") or {}
    if loop:
        lines.append(
            f"  busy loop: {loop.get('state')} {loop.get('detail') or ''}for "
            f"{_num(loop.get('for_s'))} s; no net progress for {_num(progress.get('stalled_s'))} "
            f"s; {progress.get('empty_steps')} empty steps of {progress.get('steps')}"
        )
    queued = progress.get("queued_s")
    if isinstance(queued, (int, float)) and queued > 0:
        lines.append(
            f"  a request has waited {_num(queued)} s in EngineCore's input queue: the busy "
            "loop stopped taking it (outside any step or call)"
        )
    recent = progress.get("recent_steps_s")
    if isinstance(recent, list) and recent:
        lines.append("  last step durations (s): " + ", ".join(_num(d) for d in recent))
    if details:
        state = [
            f"{label} {details[key]}"
            for key, label in (
                ("pause_state", "pause state"),
                ("sleeping", "sleeping"),
                ("kv_cache_usage", "KV cache usage"),
                ("encoder_cache_usage", "encoder cache usage"),
                ("running", "running"),
                ("waiting", "waiting"),
            )
            if details.get(key) is not None
        ]
        if state:
            lines.append("  engine: " + "; ".join(state))
    requests = details.get(KEY_REQUESTS) or []
    if requests:
        lines.append(f"  stuck requests ({len(requests)}):")
        for r in requests:
            if isinstance(r, Mapping):
                lines.append(
                    f"    {r.get('request_id')}: {r.get('queue')} {r.get('status')}, "
                    f"{_num(r.get('age_s'))} s old, {r.get('computed')} computed of "
                    f"{r.get('prompt_len')} prompt, {r.get('preemptions', 0)} preemptions; "
                    f"{r.get('waiting_reason')}"
                )
    else:
        lines.append("  stuck requests: not in the last answer (an engine that stopped answering)")
    stacks = details.get(KEY_STACKS) or []
    for stack in stacks:
        if isinstance(stack, Mapping):
            frames = stack.get("frames") or []
            lines.append(f"  thread {stack.get('thread')}:")
            lines += [f"    {f}" for f in frames[-SHOWN_FRAMES:]]
    return "\n".join(lines)


def _num(value: Any) -> str:
    return f"{round(value, 3):g}" if isinstance(value, (int, float)) else str(value)
