"""The stall snapshot the API server wrote at a ``/health`` verdict, read back for diagnose.

``diagnose --snapshot FILE`` shows one; ``diagnose --pid N`` shows the newest one an API
server of the diagnosed process tree wrote (its pid is in the file name) in the snapshot
directory (``MMCACHE_FIX_SNAPSHOT_DIR`` as diagnose sees it, else the default). Nothing here
prints; the CLI passes everything through its redaction.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

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
    rf"^{re.escape(FILE_PREFIX)}.+?-(\d+)-\d{{8}}T\d{{6}}-\d{{3}}(?:-\d+)?\.json$"
)
SHOWN_FRAMES = 6
"""Innermost frames shown per thread in the text (the JSON keeps all)."""


class SnapshotError(Exception):
    """A file that is not a readable stall snapshot (the message says why)."""


def load_snapshot(path: Path) -> dict[str, Any]:
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise SnapshotError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    if size > 4 * MAX_BYTES:
        raise SnapshotError(f"{path}: {size} bytes, not a stall snapshot (at most {MAX_BYTES})")
    try:
        data = json.loads(path.read_text(errors="replace"))
    except (OSError, ValueError) as exc:
        raise SnapshotError(f"{path}: not JSON ({exc})") from None
    if not isinstance(data, dict) or data.get(KEY_KIND) != KIND_VALUE:
        raise SnapshotError(f"{path}: not a vllm-mmcache-fix stall snapshot")
    return data


def find_snapshot(pids: Iterable[int], directory: Path | None = None) -> Path | None:
    """The newest snapshot written by one of ``pids`` (None: none)."""
    if directory is None:
        directory = Path(read_snapshot_dir()[0])
    wanted = {str(p) for p in pids}
    try:
        files = list(directory.glob(f"{FILE_PREFIX}*.json"))
    except OSError:
        return None
    mine = []
    for file in files:
        match = _PID_IN_NAME.match(file.name)
        if match and match.group(1) in wanted:
            try:
                mine.append((file.stat().st_mtime, file))
            except OSError:
                continue
    return max(mine)[1] if mine else None


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
