"""Lifecycle of the stall sentinel: where it runs, its thread, its report."""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

from ..core import counters, log, signals
from ..core.lifecycle import DidNotEnable, Fix
from ..core.messages import BUSY, STALL, STALL_SENTINEL_ACTIVE
from ..core.process import process_label
from ..core.settings import ENV_STALL_SECONDS, Mode, read_mode, read_stall_seconds
from .detect import Detector, Stall, in_cache_eviction

INTERVAL_S = 1.0
THREAD_NAME = "mmcache-fix-stall-sentinel"
NATIVE_THREAD_NAME = "mmcache-stall"
"""What ``top -H`` and ``/proc/<pid>/task/<tid>/comm`` show for the sentinel's thread."""
ENGINE_CORE = "EngineCore"
API_SERVER = "API server"


def _name_native_thread(name: str) -> None:
    """Linux ``prctl(PR_SET_NAME)`` for the calling thread; nothing elsewhere."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(15, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)


def stall_cause(stall: Stall) -> str:
    """``cache_eviction`` when the stack holds the multimodal cache's eviction, else ``busy``."""
    if in_cache_eviction(stall.stack):
        return counters.STALL_CACHE_EVICTION
    return counters.STALL_BUSY


def format_stall(stall: Stall, where: str, cause: str) -> str:
    runnable = ""
    if stall.runnable_percent is not None:
        runnable = f" (runnable {stall.runnable_percent:.0f}%)"
    seen = (
        f"thread {stall.thread_name!r} (tid {stall.native_id}) has stayed in "
        f"{stall.anchor_function} (innermost {stall.top_function}) for {stall.seconds:.1f} s "
        f"at {stall.cpu_percent:.0f}% CPU{runnable}, voluntary switches +{stall.voluntary}, "
        f"involuntary +{stall.involuntary}"
    )
    if cause == counters.STALL_CACHE_EVICTION:
        head = (
            f"{STALL} {where}: {seen}; it spins in the multimodal cache's eviction "
            "(vllm#43941): a frozen engine answers no request."
        )
    else:
        head = (
            f"{BUSY} for {stall.seconds:.0f} s in {where}: {seen}; not the multimodal cache "
            "(no eviction frames on its stack): a long call, which vLLM may well finish."
        )
    lines = [head + " Stack, innermost first:"]
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
        self._site = self.errors.site("stall.sample")
        self._thread_site = self.errors.site("stall.thread")  # the thread's set-up (_run)
        self._reset()

    def _reset(self) -> None:
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
        self._pid: int | None = None
        self._stop = threading.Event()
        self._failed = False

    # -- lifecycle -----------------------------------------------------------------

    def _install(self) -> None:
        if read_mode().value == Mode.OFF:
            raise DidNotEnable("disabled by MMCACHE_FIX_MODE=off")
        setting = read_stall_seconds()
        if setting.problem:
            self.note_problem(setting.problem)
            log.warning("%s", setting.problem)
        if setting.value == 0:
            raise DidNotEnable(f"{ENV_STALL_SECONDS}=0")
        self.threshold_s = setting.value
        # Started only where the process is positively identified: an EngineCore busy loop
        # runs here, or an API server's engine client does (never a user's LLM(...) script).
        signals.ENGINE_CORE_RUNNING.connect(self.start_in_engine_core)
        signals.API_SERVER_SERVING.connect(self.start_in_api_server)
        if self not in _FORK_HOOKED:
            if not _FORK_HOOKED and hasattr(os, "register_at_fork"):
                os.register_at_fork(after_in_child=_after_fork_in_child)
            _FORK_HOOKED.append(self)

    def _uninstall(self) -> None:
        signals.ENGINE_CORE_RUNNING.disconnect(self.start_in_engine_core)
        signals.API_SERVER_SERVING.disconnect(self.start_in_api_server)
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5.0)

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

    def start_in_engine_core(self) -> None:
        self.start(ENGINE_CORE)

    def start_in_api_server(self) -> None:
        self.start(API_SERVER)

    def start(self, kind: str) -> None:
        """Run the sentinel in this process (once; ``kind`` names it in reports)."""
        with self.lock:
            if not self.enabled or self._failed:
                return
            thread = self._thread
            if self._pid == os.getpid() and thread is not None and thread.is_alive():
                return
            self.kind = kind
            self._pid = os.getpid()
            self._stop = threading.Event()
            thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
            self._thread = thread
            thread.start()

    def _after_fork(self) -> None:
        """A forked child has none of the parent's threads and is not identified yet: it
        starts its own sentinel when it is (an EngineCore's busy loop, say), not before."""
        self.lock = threading.RLock()
        self._thread = None
        self._pid = None
        self.kind = None
        self.stalls = 0
        self.last_stall = None
        self.samples = 0
        self.sample_ms_total = self.sample_ms_max = self.thread_cpu_s = 0.0

    def _run(self) -> None:
        try:
            self._loop()
        except Exception as exc:
            self.errors.record(self._thread_site.name, exc)

    def _loop(self) -> None:
        stop = self._stop
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
                        "%s %s: one WARNING when a thread stays in the same call burning a "
                        "core for more than %g s (%s), sampling every %g s",
                        STALL_SENTINEL_ACTIVE,
                        self._where(),
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
        cause = stall_cause(stall)
        self.stalls += 1
        counters.count_stall(cause)  # mmcache_fix_stalls_total{cause} on /metrics
        self.last_stall = {
            "thread": stall.thread_name,
            "tid": stall.native_id,
            "seconds": round(stall.seconds, 1),
            "in": stall.anchor_function,
            "cause": cause,
            "cpu_percent": round(stall.cpu_percent, 1),
            "voluntary": stall.voluntary,
            "involuntary": stall.involuntary,
            "top": [str(line) for line in stall.stack[:5]],
        }
        log.warning("%s", format_stall(stall, self._where(), cause))

    def _where(self) -> str:
        label = process_label()
        return label if str(self.kind) in label else f"{self.kind} ({label})"
