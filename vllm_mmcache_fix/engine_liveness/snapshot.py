"""The stall snapshot: what the operator gets at the first verdict of a stall.

Two ends:

- **EngineCore** (:func:`engine_details`, in the input thread, only while a stall is
  building: no net progress, or one step/add/abort, for :data:`DETAIL_AFTER_S`): the answer
  to the heartbeat carries the stuck requests (the first running ones and the head of the
  waiting queue, at most :data:`MAX_REQUESTS`: status, age, computed tokens, why it waits),
  the KV and encoder-cache usage, the pause and sleep state and the stacks of EngineCore's
  threads (``sys._current_frames``: read, never waits). The busy loop pays nothing for it;
  its only per-step work is the step duration (:mod:`.progress`).
- **API server** (:class:`SnapshotWriter`): at the first verdict of a stall episode, one
  JSON file with the verdict, the engine's last answer and those details, written by a
  daemon thread (``/health`` and the event loop never wait on the disk), bounded in size
  (:data:`MAX_BYTES`) and in number (:data:`KEEP_FILES` in the directory), in
  ``MMCACHE_FIX_SNAPSHOT_DIR`` (default: ``<temp dir>/vllm-mmcache-fix-snapshots``).
  ``vllm-mmcache-fix diagnose --snapshot FILE`` shows it.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..core import log
from ..core.settings import ENV_SNAPSHOT_DIR, read_snapshot_dir

SNAPSHOT_SCHEMA = 1
FILE_PREFIX = "stall-"
DETAIL_AFTER_S = 15.0
"""Seconds of no net progress (or of one step) after which answers carry the details: less
than the smallest progress timeout (30 s), so the answers of the verdict carry them."""
MAX_REQUESTS = 8
MAX_THREADS = 24
MAX_FRAMES = 12
MAX_BYTES = 256 * 1024
KEEP_FILES = 50
"""Snapshot files kept in the directory (the oldest ones beyond are removed)."""

# JSON keys read by ``diagnose`` as well.
KEY_SCHEMA = "schema"
KEY_KIND = "snapshot"
KIND_VALUE = "vllm-mmcache-fix stall snapshot"
KEY_VERDICT = "verdict"
KEY_REQUESTS = "stuck_requests"
KEY_STACKS = "stacks"
KEY_DETAILS = "details"


# -- EngineCore: the details (input thread) -------------------------------------------


def _name(value: Any) -> str | None:
    if value is None:
        return None
    name = getattr(value, "name", None)
    return str(name) if name is not None else str(value)


def _waiting_reason(status: str | None) -> str:
    if status is None:
        return "unknown"
    if status.startswith("WAITING_FOR_"):
        return status[len("WAITING_FOR_") :].lower()  # remote_kvs, structured_output_grammar
    if status == "PREEMPTED":
        return "preempted (to be recomputed)"
    if status == "WAITING":
        return "not scheduled yet"
    if status == "RUNNING":
        return "running, no net progress"
    return status.lower()


def request_facts(request: Any, where: str, wall: float) -> dict[str, Any]:
    """One request as the snapshot shows it (vLLM's ``Request`` fields; each read alone).
    No key names a token: ``diagnose`` redacts the values of keys that contain "token"."""
    status = _name(getattr(request, "status", None))
    arrival = getattr(request, "arrival_time", None)
    out: dict[str, Any] = {
        "request_id": str(getattr(request, "request_id", "?"))[:200],
        "queue": where,
        "status": status,
        "waiting_reason": _waiting_reason(status),
        "computed": getattr(request, "num_computed_tokens", None),
        "age_s": round(wall - arrival, 3) if isinstance(arrival, (int, float)) else None,
    }
    for field, attr in (
        ("prompt_len", "num_prompt_tokens"),
        ("preemptions", "num_preemptions"),
        ("output_len", "num_output_tokens"),
    ):
        value = getattr(request, attr, None)
        if isinstance(value, int):
            out[field] = value
    return out


def stuck_requests(scheduler: Any) -> list[dict[str, Any]]:
    """The first running requests, then the head of the waiting queue (bounded; a list slice
    and ``peek_request`` are safe against the busy loop, a queue walk would not be)."""
    wall = time.time()
    out: list[dict[str, Any]] = []
    running = getattr(scheduler, "running", None)
    if isinstance(running, list):
        out += [request_facts(r, "running", wall) for r in running[:MAX_REQUESTS]]
    waiting = getattr(scheduler, "waiting", None)
    if waiting is not None and len(out) < MAX_REQUESTS:
        try:
            head = waiting.peek_request()
        except Exception:  # empty, or emptied meanwhile
            head = None
        if head is not None:
            out.append(request_facts(head, "waiting", wall))
    return out


def _usage(scheduler: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    kv = getattr(scheduler, "kv_cache_manager", None)
    try:
        usage = kv.usage if kv is not None else None  # vLLM: 1 - free/total blocks, O(1)
        if isinstance(usage, (int, float)):
            out["kv_cache_usage"] = round(float(usage), 4)
    except Exception:
        pass
    encoder = getattr(scheduler, "encoder_cache_manager", None)
    size = getattr(encoder, "cache_size", None)
    free = getattr(encoder, "num_free_slots", None)
    if isinstance(size, int) and isinstance(free, int) and size > 0:
        out["encoder_cache_slots"] = size
        out["encoder_cache_free_slots"] = free
        out["encoder_cache_usage"] = round(1.0 - free / size, 4)
    out["waiting"] = _len(getattr(scheduler, "waiting", None))
    out["running"] = _len(getattr(scheduler, "running", None))
    out["requests"] = _len(getattr(scheduler, "requests", None))
    return out


def _len(value: Any) -> int | None:
    try:
        return len(value) if value is not None else None
    except Exception:
        return None


def thread_stacks() -> list[dict[str, Any]]:
    """The stacks of this process's threads, innermost frame last (bounded)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    out: list[dict[str, Any]] = []
    for ident, frame in list(sys._current_frames().items())[:MAX_THREADS]:
        frames = traceback.extract_stack(frame, limit=MAX_FRAMES)
        out.append(
            {
                "thread": names.get(ident, str(ident)),
                "frames": [f"{f.filename}:{f.lineno} {f.name}" for f in frames],
            }
        )
    return out


def engine_details(engine: Any, scheduler: Any) -> dict[str, Any]:
    """What the answer carries while a stall builds (never raises for a missing field)."""
    details: dict[str, Any] = {KEY_REQUESTS: stuck_requests(scheduler)}
    details.update(_usage(scheduler))
    details["pause_state"] = _name(scheduler.__dict__.get("_pause_state"))
    executor = getattr(engine, "model_executor", None)
    sleeping = getattr(executor, "is_sleeping", None)
    details["sleeping"] = sleeping if isinstance(sleeping, bool) else None
    details[KEY_STACKS] = thread_stacks()
    return details


# -- API server: the file -------------------------------------------------------------


def oldest_request(details: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The stuck request that has waited longest (None: none known)."""
    requests = (details or {}).get(KEY_REQUESTS)
    if not isinstance(requests, list):
        return None
    aged = [r for r in requests if isinstance(r, Mapping) and isinstance(r.get("age_s"), float)]
    if not aged:
        return None
    return dict(max(aged, key=lambda r: r["age_s"]))


def describe_request(request: Mapping[str, Any] | None) -> str:
    if request is None:
        return "oldest stuck request: not known (no answer carried requests)"
    return (
        f"oldest stuck request: {request.get('request_id')} ({request.get('status')}, "
        f"{request.get('age_s')} s old, {request.get('computed')} tokens computed, "
        f"{request.get('waiting_reason')})"
    )


def bounded_json(data: dict[str, Any]) -> str:
    """``data`` as JSON of at most :data:`MAX_BYTES`: stacks, then requests, cut first."""
    text = json.dumps(data, indent=1, default=str)
    if len(text) <= MAX_BYTES:
        return text
    details = data.get(KEY_DETAILS)
    if isinstance(details, dict):
        details = dict(details)
        data = {**data, KEY_DETAILS: details, "truncated": True}
        details.pop(KEY_STACKS, None)
        text = json.dumps(data, indent=1, default=str)
        if len(text) <= MAX_BYTES:
            return text
        details[KEY_REQUESTS] = details.get(KEY_REQUESTS, [])[:1]
        text = json.dumps(data, indent=1, default=str)
        if len(text) <= MAX_BYTES:
            return text
    return json.dumps({k: data[k] for k in (KEY_SCHEMA, KEY_KIND, KEY_VERDICT) if k in data})


class SnapshotWriter:
    """Writes one snapshot per stall episode, off the event loop."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        directory, self.problem = read_snapshot_dir(environ)
        self.directory = Path(directory)
        self.written = 0
        self.failed = 0
        self.last_path: str | None = None
        self.last_error: str | None = None
        self._warned = False
        self._episodes = itertools.count(1)

    def path_for(self, engine: str, when: float) -> Path:
        """A name no other snapshot of this process has (episodes of two engines, or two
        of one engine, can start within the same millisecond)."""
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(when))
        ms = int(when * 1000) % 1000
        name = f"{FILE_PREFIX}{engine}-{os.getpid()}-{stamp}-{ms:03d}-{next(self._episodes)}.json"
        return self.directory / name

    def write(self, data: dict[str, Any], path: Path) -> threading.Thread:
        """Write ``data`` to ``path`` in a daemon thread (returned, for tests to join)."""
        thread = threading.Thread(
            target=self._write, args=(data, path), name="mmcache-fix-snapshot", daemon=True
        )
        thread.start()
        return thread

    def _write(self, data: dict[str, Any], path: Path) -> None:
        try:
            text = bounded_json(data)
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_name(path.name + ".partial")
            partial.write_text(text)
            os.replace(partial, path)
            self.written += 1
            self.last_path = str(path)
            self._prune(path.parent)
        except Exception as exc:  # a full disk, a read-only directory: vLLM goes on
            self.failed += 1
            self.last_error = f"{type(exc).__name__}: {exc}"
            if not self._warned:
                self._warned = True
                log.warning(
                    "the stall snapshot could not be written to %s (%s); set %s to a "
                    "writable directory",
                    path,
                    self.last_error,
                    ENV_SNAPSHOT_DIR,
                )

    @staticmethod
    def _prune(directory: Path) -> None:
        files = sorted(directory.glob(f"{FILE_PREFIX}*.json"), key=lambda p: p.stat().st_mtime)
        for old in files[:-KEEP_FILES]:
            old.unlink(missing_ok=True)
