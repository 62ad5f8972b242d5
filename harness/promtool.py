"""Where the tests find ``promtool`` (Prometheus' rule checker).

``scripts/run-tests`` unpacks it from Debian's ``prometheus`` package into the cache root
(``apt-get download``, no install, no service); ``MMCACHE_HARNESS_PROMTOOL`` or a ``promtool``
on ``PATH`` take precedence.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from harness.realsrc import cache_root

ENV = "MMCACHE_HARNESS_PROMTOOL"


def unpacked() -> Path:
    return cache_root() / "promtool" / "usr" / "bin" / "promtool"


def find() -> str | None:
    given = os.environ.get(ENV)
    if given:
        return given if os.access(given, os.X_OK) else None
    on_path = shutil.which("promtool")
    if on_path:
        return on_path
    path = unpacked()
    return str(path) if os.access(path, os.X_OK) else None
