"""Lifecycle of the stall sentinel: where it runs, its thread, its report."""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

from ..core import counters, log
from ..core.lifecycle import DidNotEnable, Fix
from ..core.messages import STALL, STALL_SENTINEL_ACTIVE
from ..core.process import process_label, process_name
from ..core.settings import ENV_STALL_SECONDS, Mode, read_mode, read_stall_seconds
from .detect import Detector, Stall

INTERVAL_S = 1.0
THREAD_NAME = "mmcache-fix-stall-sentinel"
NATIVE_THREAD_NAME = "mmcache-stall"
"""What ``top -H`` and ``/proc/<pid>/task/<tid>/comm`` show for the sentinel's thread."""
ENGINE_CORE = "EngineCore"
API_SERVER = "API server"


def _title() -> str:
    try:
        with open("/proc/self/cmdline", "rb") as handle:
            return handle.read().split(b"\0", 1)[0].decode("utf-8", "replace")
    except OSError:
        return ""


def process_kind(name: str | None = None, title: str | None = None) -> str | None:
    """``EngineCore``, ``API server``, or None for any other process (workers...)."""
    name = process_name() if name is None else name
    title = _title() if title is None else title
    if name.startswith("EngineCore") or (name == "MainProcess" and "EngineCore" in title):
        return ENGINE_CORE
    if "Worker" in title or "Worker" in name:
        return None
    if name.startswith("ApiServer") or name == "MainProcess":
        return API_SERVER
    return None


def _name_native_thread(name: str) -> None:
    """Linux ``prctl(PR_SET_NAME)`` for the calling thread; nothing elsewhere."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(15, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)


def format_stall(stall: Stall, where: str) -> str:
    runnable = ""
    if stall.runnable_percent is not None:
        runnable = f" (runnable {stall.runnable_percent:.0f}%)"
    lines = [
        f"{STALL} {where}: thread {stall.thread_name!r} (tid {stall.native_id}) has stayed in "
        f"{stall.anchor_function} (innermost {stall.top_function}) for {stall.seconds:.1f} s "
        f"at {stall.cpu_percent:.0f}% CPU"
        f"{runnable}, "
        f"voluntary switches +{stall.voluntary}, involuntary +{stall.involuntary}; "
        "a frozen engine answers no request (vllm#43941 stalls in LRUCache.popitem). "
        "Stack, innermost first:"
    ]
    lines += [f"    {line}" for line in stall.stack]
    if stall.frames_total > len(stall.stack):
        lines.append(f"    ... {stall.frames_total - len(stall.stack)} outer frames")
    return "\n".join(lines)


_FORK_HOOKED: list[StallSentinelFix] = []


def _after_fork_in_child() -> None:
    for fix in _FORK_HOOKED:
        try:
            fix._after_fork()
        except Exception:
            pass


class StallSentinelFix(Fix):
    id = "stall-sentinel"
    runs_in = "EngineCore and API server"

    def __init__(self) -> None:
        super().__init__()
        self.threshold_s: float | None = None
        self.interval_s = INTERVAL_S
        self.kind: str | None = None
        self.stalls = 0
        self.last_stall: dict[str, Any] | None = None
        self.samples = 0
        self.sample_ms_total = 0.0
        self.sample_ms_max = 0.0
        self.thread_cpu_s = 0.0
        self.stopped_reason: str | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._failed = False
        self._site = self.errors.site("stall.sample")

    # -- lifecycle -----------------------------------------------------------------

    def _install(self) -> None:
        if read_mode().value is Mode.OFF:
            raise DidNotEnable("disabled by MMCACHE_FIX_MODE=off")
        setting = read_stall_seconds()
        if setting.problem:
            self.note_problem(setting.problem)
            log.warning("%s", setting.problem)
        if setting.value == 0:
            raise DidNotEnable(f"{ENV_STALL_SECONDS}=0")
        self.threshold_s = setting.value
        kind = process_kind()
        if kind is None:
            raise DidNotEnable("runs only in EngineCore and the API server")
        self.kind = kind
        if self not in _FORK_HOOKED:
            if not _FORK_HOOKED and hasattr(os, "register_at_fork"):
                os.register_at_fork(after_in_child=_after_fork_in_child)
            _FORK_HOOKED.append(self)
        self._start(decide_kind_later=False)

    def _uninstall(self) -> None:
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5.0)
        self.__init__()  # type: ignore[misc]

    def _status(self) -> dict[str, Any]:
        thread = self._thread
        return {
            "threshold_s": self.threshold_s,
            "interval_s": self.interval_s,
            "process_kind": self.kind,
            "running": bool(thread is not None and thread.is_alive()),
            "stalls": self.stalls,
            "last_stall": dict(self.last_stall) if self.last_stall else None,
            "samples": self.samples,
            "sample_ms_mean": round(self.sample_ms_total / self.samples, 3)
            if self.samples
            else None,
            "sample_ms_max": round(self.sample_ms_max, 3),
            "thread_cpu_s": round(self.thread_cpu_s, 4),
            "stopped_reason": self.stopped_reason,
        }

    def _on_internal_error(self, where: str, exc: BaseException) -> None:
        self._failed = True
        self.stopped_reason = f"{where}: {exc!r}"
        self.note_problem(f"{where}: {exc!r}")

    # -- the thread ------------------------------------------------------------------

    def _start(self, *, decide_kind_later: bool) -> None:
        self._stop = threading.Event()
        self._failed = False
        thread = threading.Thread(
            target=self._run, args=(decide_kind_later,), name=THREAD_NAME, daemon=True
        )
        self._thread = thread
        thread.start()

    def _after_fork(self) -> None:
        """A forked child has none of the parent's threads: start again, decide later.

        vLLM forks EngineCore (and workers) from processes where the sentinel
        runs; the child's name is set only after the fork, and vLLM does not call
        plugins again in a forked child."""
        self.lock = threading.RLock()
        if not self.enabled or self._failed:
            return
        self.stalls = 0
        self.last_stall = None
        self.samples = 0
        self.sample_ms_total = self.sample_ms_max = self.thread_cpu_s = 0.0
        self.kind = None
        self._start(decide_kind_later=True)

    def _run(self, decide_kind_later: bool) -> None:
        try:
            self._loop(decide_kind_later)
        except Exception as exc:
            self.errors.record("stall.thread", exc)

    def _loop(self, decide_kind_later: bool) -> None:
        stop = self._stop
        if decide_kind_later:
            if stop.wait(self.interval_s):
                return
            self.kind = process_kind()
            if self.kind is None:
                self.stopped_reason = "not EngineCore or the API server"
                return
        assert self.threshold_s is not None
        try:
            _name_native_thread(NATIVE_THREAD_NAME)
        except Exception:
            pass  # a name for operators only
        detector = Detector(self.threshold_s, self._on_stall)
        detector.ignore_idents.add(threading.get_ident())
        announced = False
        cpu_start = time.thread_time()
        while not stop.wait(self.interval_s):
            started = time.perf_counter()
            with self._site:
                if not announced and log.has_destination():
                    announced = True
                    log.info(
                        "%s %s: one WARNING when a thread stays in the same code burning a "
                        "core for more than %g s (%s), sampling every %g s",
                        STALL_SENTINEL_ACTIVE,
                        process_label(),
                        self.threshold_s,
                        ENV_STALL_SECONDS,
                        self.interval_s,
                    )
                detector.sample()
            if self._failed:
                self._thread_stopped()
                return
            spent_ms = (time.perf_counter() - started) * 1e3
            self.samples += 1
            self.sample_ms_total += spent_ms
            self.sample_ms_max = max(self.sample_ms_max, spent_ms)
            self.thread_cpu_s = time.thread_time() - cpu_start

    def _thread_stopped(self) -> None:
        try:
            log.info("stall sentinel stopped in %s; vLLM goes on", process_label())
        except Exception:
            pass

    def _on_stall(self, stall: Stall) -> None:
        self.stalls += 1
        counters.count_stall()  # mmcache_fix_stalls_total on the API server's /metrics
        self.last_stall = {
            "thread": stall.thread_name,
            "tid": stall.native_id,
            "seconds": round(stall.seconds, 1),
            "in": stall.anchor_function,
            "cpu_percent": round(stall.cpu_percent, 1),
            "voluntary": stall.voluntary,
            "involuntary": stall.involuntary,
            "top": [str(line) for line in stall.stack[:5]],
        }
        label = process_label()
        where = label if str(self.kind) in label else f"{self.kind} ({label})"
        log.warning("%s", format_stall(stall, where))
