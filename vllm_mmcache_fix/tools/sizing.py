"""What the multimodal processor caches of one ``vllm serve`` command line cost at full.

An LRU cache never shrinks: once traffic has filled it, it holds its whole budget
(``--mm-processor-cache-gb``, 4 GiB by default) for the life of the process. Which processes
hold one is decided by vLLM's own rule (``_get_cache_type`` in ``vllm/multimodal``, the same
0.11.0 – 0.34.0):

- one API server and one engine, or data parallelism behind an external load balancer
  (``lru``, the default type): each EngineCore holds the items (the *receiver*); the API
  server's *sender* mirrors only their sizes, a few hundred bytes per item;
- the same shapes with ``--mm-processor-cache-type shm``: one shared-memory ring buffer of the
  budget, in ``/dev/shm``, written by the API server and read by the workers;
- several API servers, or data parallelism with vLLM's own load balancing: no cache in
  EngineCore, and every API server holds the items itself (*processor only*).

vLLM's documentation gives the bound ``budget x (API servers + engines)``; the figure here is
what this shape really fills. It is compared with the container's memory limit (cgroup v2
``memory.max`` or v1 ``memory.limit_in_bytes`` of this process's cgroup) and the host's RAM.

Threshold: a warning when the caches at full take half of the smaller of the two or more.
The caches sit beside everything else vLLM keeps in host memory for the server's life (on a
GPU host the API server and every EngineCore and worker process, torch and CUDA context, the
tokenizer and the processor's own buffers, several GiB per process; on CPU builds also the
weights and the KV cache, ``VLLM_CPU_KVCACHE_SPACE``); past half, the caches, which are
the only part that grows with traffic, get more room than all of that, and the container is
killed by traffic that arrives long after start-up, not at start-up. At or above the limit,
filling the caches alone is enough for the kernel to kill it.

Pure logic over a command line and a file tree (``root``), so it is tested on a fake cgroup
tree; nothing here imports vLLM.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

GiB = 1 << 30
DEFAULT_CACHE_GB = 4.0
WARN_SHARE = 0.5
"""Caches at full / the smaller of the container's limit and the host's RAM."""
SHM_SINCE = (0, 11, 0)
"""First release with ``--mm-processor-cache-type`` (read off the released sources)."""
UNLIMITED_V1 = 1 << 60
"""cgroup v1 writes a page-rounded 2**63 - 1 for "no limit"; anything this large is none."""

OK = "ok"
WARN = "warn"
CRITICAL = "critical"


@dataclass
class ServeShape:
    """The parts of a ``vllm serve`` command line that decide the caches."""

    cache_gb: float = DEFAULT_CACHE_GB
    cache_type: str = "lru"
    api_servers: int | None = None
    """``--api-server-count``; None: vLLM's default for the shape."""
    dp_size: int = 1
    dp_size_local: int | None = None
    external_lb: bool = False
    hybrid_lb: bool = False
    headless: bool = False
    unknown: list[str] = field(default_factory=list)
    """Flags that looked relevant and could not be read (bad values)."""

    def api_server_count(self) -> int:
        if self.headless:
            return 0
        if self.api_servers is not None:
            return self.api_servers
        # vLLM's default: 1 behind an external load balancer, the local DP size with hybrid
        # load balancing, the DP size with its own (vllm/entrypoints/cli/serve.py).
        if self.external_lb:
            return 1
        if self.hybrid_lb:
            return self.dp_size_local or 1
        return self.dp_size

    def engines(self) -> int:
        """EngineCores on this node."""
        if self.external_lb:
            return 1
        return self.dp_size_local or self.dp_size


_VALUE_FLAGS = {
    "--mm-processor-cache-gb": "cache_gb",
    "--mm-processor-cache-type": "cache_type",
    "--api-server-count": "api_servers",
    "-asc": "api_servers",
    "--data-parallel-size": "dp_size",
    "-dp": "dp_size",
    "--data-parallel-size-local": "dp_size_local",
    "-dpl": "dp_size_local",
    "--data-parallel-rank": "dp_rank",
    "-dpr": "dp_rank",
    "--data-parallel-start-rank": "dp_start_rank",
    "-dpsr": "dp_start_rank",
}
_BOOL_FLAGS = {
    "--data-parallel-external-lb": "external_lb",
    "--data-parallel-hybrid-lb": "hybrid_lb",
    "--headless": "headless",
}


def parse_serve_args(command: str | Sequence[str]) -> ServeShape:
    """Read a ``vllm serve ...`` command line (or its arguments); other flags are ignored."""
    words = shlex.split(command) if isinstance(command, str) else list(command)
    shape = ServeShape()
    i = 0
    while i < len(words):
        word = words[i]
        name, eq, inline = word.partition("=")
        name = name.replace("_", "-") if name.startswith("--") else name
        if name in _BOOL_FLAGS and not eq:
            setattr(shape, _BOOL_FLAGS[name], True)
        elif name in _VALUE_FLAGS:
            if eq:
                value = inline
            elif i + 1 < len(words):
                i += 1
                value = words[i]
            else:
                shape.unknown.append(f"{name} without a value")
                break
            _set(shape, _VALUE_FLAGS[name], name, value)
        i += 1
    return shape


def _set(shape: ServeShape, attr: str, flag: str, value: str) -> None:
    try:
        if attr == "cache_gb":
            shape.cache_gb = float(value)
        elif attr == "cache_type":
            shape.cache_type = value
        elif attr == "dp_rank":
            shape.external_lb = True  # vLLM: a rank given = external load balancing
            int(value)
        elif attr == "dp_start_rank":
            shape.hybrid_lb = True
            int(value)
        else:
            setattr(shape, attr, int(value))
    except ValueError:
        shape.unknown.append(f"{flag} {value!r} is not a number")


# -------------------------------------------------------------------------------- memory


@dataclass
class MemoryLimits:
    cgroup_version: int | None = None
    cgroup_path: str | None = None
    cgroup_limit: int | None = None
    """Bytes; None when the cgroup sets none (or none could be read)."""
    host_ram: int | None = None
    dev_shm: int | None = None
    """Size of ``/dev/shm`` (where the ``shm`` cache lives), bytes."""
    notes: list[str] = field(default_factory=list)

    def effective(self) -> int | None:
        known = [v for v in (self.cgroup_limit, self.host_ram) if v]
        return min(known) if known else None


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def read_memory_limits(root: str | os.PathLike[str] = "/", pid: str = "self") -> MemoryLimits:
    """The memory limit of process ``pid``'s cgroup (v2 or v1), the host's RAM and /dev/shm,
    read under ``root``."""
    base = Path(root)
    limits = MemoryLimits()
    meminfo = _read(base / "proc" / "meminfo") or ""
    for line in meminfo.splitlines():
        if line.startswith("MemTotal:"):
            parts = line.split()
            try:
                limits.host_ram = int(parts[1]) * 1024
            except (IndexError, ValueError):
                limits.notes.append(f"unreadable MemTotal line: {line!r}")
    cgroups = _read(base / "proc" / pid / "cgroup")
    if cgroups is None:
        limits.notes.append("no /proc/<pid>/cgroup: container limit unknown")
    else:
        _read_cgroup(base, cgroups, limits)
    try:
        stat = os.statvfs(base / "dev" / "shm")
        limits.dev_shm = stat.f_frsize * stat.f_blocks
    except OSError:
        pass
    return limits


def _read_cgroup(base: Path, cgroups: str, limits: MemoryLimits) -> None:
    entries = [line.split(":", 2) for line in cgroups.splitlines()]
    entries = [e for e in entries if len(e) == 3]
    # A v1 memory controller wins (hybrid hosts list "0::/" too, with no memory there).
    for _, controllers, path in entries:
        if "memory" in controllers.split(","):
            limits.cgroup_version, limits.cgroup_path = 1, path
            mount = base / "sys" / "fs" / "cgroup" / "memory"
            # Inside a container the v1 hierarchy is mounted at the group itself.
            for group in (mount / path.lstrip("/"), mount):
                raw = _read(group / "memory.limit_in_bytes")
                if raw is None:
                    continue
                try:
                    value = int(raw)
                except ValueError:
                    limits.notes.append(f"{group}: {raw!r} is not a number")
                    break
                limits.cgroup_limit = value if value < UNLIMITED_V1 else None
                break
            return
    for hierarchy, controllers, path in entries:
        if hierarchy == "0" and controllers == "":
            # cgroup v2: the smallest limit of this group and its ancestors.
            limits.cgroup_version, limits.cgroup_path = 2, path
            for group in _ancestors(base / "sys" / "fs" / "cgroup", path.lstrip("/")):
                raw = _read(group / "memory.max")
                if raw is None or raw == "max":
                    continue
                try:
                    value = int(raw)
                except ValueError:
                    limits.notes.append(f"{group / 'memory.max'}: {raw!r} is not a number")
                    continue
                limits.cgroup_limit = min(limits.cgroup_limit or value, value)
            return
    limits.notes.append("no memory cgroup found for this process")


def _ancestors(mount: Path, rel: str) -> list[Path]:
    parts = [p for p in rel.split("/") if p]
    return [mount.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]


# -------------------------------------------------------------------------------- verdict


@dataclass
class Sizing:
    level: str
    cache_type: str | None
    """What vLLM builds for this shape: ``lru``, ``shm``, ``processor_only`` or None (off)."""
    budget_bytes: int
    api_servers: int
    engines: int
    holders: str
    """Which processes hold the items, in words."""
    bytes_at_full: int
    vllm_bound_bytes: int
    """``budget x (API servers + engines)``, vLLM's documented bound."""
    limit_bytes: int | None
    share: float | None
    messages: list[str]
    limits: dict[str, Any]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _gib(value: float) -> str:
    return f"{value / GiB:.1f} GiB"


def _version_key(version: str | None) -> tuple[int, ...] | None:
    if not version:
        return None
    out = []
    for part in version.split("+")[0].split(".")[:3]:
        digits = "".join(c for c in part if c.isdigit())
        if not digits:
            break
        out.append(int(digits))
    return tuple(out) if out else None


def assess(
    shape: ServeShape,
    limits: MemoryLimits,
    vllm_version: str | None = None,
    warn_share: float = WARN_SHARE,
) -> Sizing:
    """The caches' cost at full for ``shape`` against ``limits``."""
    budget = int(max(shape.cache_gb, 0.0) * GiB)
    api, engines = shape.api_server_count(), shape.engines()
    ipc = api <= 1 and (shape.dp_size == 1 or shape.external_lb)
    messages = [f"ignored: {problem}" for problem in shape.unknown]
    if budget <= 0:
        cache_type: str | None = None
        holders, at_full = "no process (--mm-processor-cache-gb 0: the cache is off)", 0
    elif ipc and shape.cache_type == "shm":
        cache_type, holders, at_full = "shm", "one shared-memory buffer (/dev/shm)", budget
    elif ipc:
        cache_type = "lru"
        holders = (
            f"{engines} EngineCore receiver cache(s); the API server's sender keeps sizes only"
        )
        at_full = budget * engines
    else:
        cache_type = "processor_only"
        holders = f"{api} API server(s), each its own copy (EngineCore keeps none)"
        at_full = budget * api
    limit = limits.effective()
    share = at_full / limit if limit and at_full else (0.0 if limit else None)
    level = OK
    if share is not None and share >= 1.0:
        level = CRITICAL
    elif share is not None and share >= warn_share:
        level = WARN
    where = (
        f"the container's limit {_gib(limits.cgroup_limit)} (cgroup v{limits.cgroup_version})"
        if limits.cgroup_limit and limit == limits.cgroup_limit
        else f"the host's RAM {_gib(limits.host_ram or 0)}"
    )
    if at_full and limit:
        messages.append(
            f"multimodal caches at full: {_gib(at_full)} = {shape.cache_gb:g} GiB x "
            f"{at_full // budget} ({holders}); {share:.0%} of {where}"
        )
    if level == CRITICAL:
        messages.append(
            "filling the caches alone exceeds the memory limit: the server will be killed "
            "(OOM) under multimodal traffic, not at start-up"
        )
    elif level == WARN:
        messages.append(
            f"the caches at full take {warn_share:.0%} or more of the memory: little is left "
            "for vLLM's own processes (weights and KV cache on CPU, torch, tokenizer)"
        )
    if level != OK and budget:
        fits = int(limit * warn_share / max(at_full // budget, 1) / GiB * 10) / 10 if limit else 0
        messages.append(
            f"to stay under {warn_share:.0%}: --mm-processor-cache-gb {fits:g} or less"
            if fits > 0
            else "lower --mm-processor-cache-gb"
        )
    if cache_type == "shm" and limits.dev_shm is not None and limits.dev_shm < budget:
        messages.append(
            f"/dev/shm is {_gib(limits.dev_shm)}, smaller than the {_gib(budget)} shm cache: "
            "give the container more (docker --shm-size, a Memory-backed emptyDir)"
        )
    key = _version_key(vllm_version)
    shm_known = key is None or key >= SHM_SINCE
    if budget <= 0 and ipc and shm_known:
        messages.append(
            "the cache is off; --mm-processor-cache-type shm with a budget keeps it on, one "
            "copy in shared memory (/dev/shm must hold it)"
        )
    elif cache_type == "lru" and level != OK and shm_known:
        messages.append(
            "alternative to --mm-processor-cache-gb 0 (no cache at all): "
            "--mm-processor-cache-type shm keeps one copy of the budget in shared memory "
            f"({_gib(budget)}, counted in the container's memory; /dev/shm must hold it)"
            + ("" if key else "; needs vLLM 0.11.0 or newer")
        )
    elif cache_type == "processor_only" and level != OK:
        messages.append(
            "--mm-processor-cache-type shm is not possible in this shape (vLLM uses it only "
            "with one API server and no internal data parallelism): lower the budget"
        )
    return Sizing(
        level=level,
        cache_type=cache_type,
        budget_bytes=budget,
        api_servers=api,
        engines=engines,
        holders=holders,
        bytes_at_full=at_full,
        vllm_bound_bytes=budget * (api + engines),
        limit_bytes=limit,
        share=share,
        messages=messages,
        limits=asdict(limits),
    )


def check_sizing(
    serve_args: str | Sequence[str] | None, vllm_version: str | None = None, root: str = "/"
) -> Sizing:
    """:func:`assess` for a command line (vLLM's defaults when None) in this environment."""
    shape = parse_serve_args(serve_args or "")
    return assess(shape, read_memory_limits(root), vllm_version)


def sizing_report(serve_args: str | None, vllm_version: str | None) -> dict[str, Any]:
    """:func:`check_sizing` as plain data for ``check``; an error is reported, never raised.
    ``given`` says whether a command line was given (otherwise vLLM's defaults are assumed)."""
    try:
        data = check_sizing(serve_args, vllm_version).as_dict()
    except Exception as exc:
        return {
            "level": "error",
            "messages": [f"sizing failed: {exc!r}"],
            "given": bool(serve_args),
        }
    data["given"] = bool(serve_args)
    return data


def sizing_lines(data: dict[str, Any] | None) -> list[str]:
    """What ``check`` prints: with a command line always, for vLLM's defaults only past the
    threshold."""
    if not data or (not data.get("given") and data.get("level") in (OK, None)):
        return []
    return [f"cache sizing ({data.get('level')}): {m}" for m in data.get("messages", [])]
