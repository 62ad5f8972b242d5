"""Synthetic vLLM package trees for the plugin-wiring tests.

Only the multimodal factory module is synthetic (vLLM's real one imports torch
and most of vLLM); ``vllm/utils/cache.py`` is the real released file of the
chosen version. The real-build evidence lives in the ``installed`` tier.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

from harness.paths import REPO_ROOT as REPO

FACTORY_BODY = '''
GiB_bytes = 1 << 30


class MultiModalCache:
    @classmethod
    def get_lru_cache(cls, capacity_gb, value_type, *, debug=False):
        return LRUCache(GiB_bytes * capacity_gb, getsizeof=lambda x: cls.get_item_size(x))

    @classmethod
    def get_item_size(cls, value):
        return len(value)


class ReceiverCache:
    """The P1 pattern: touch every hash of a request, then get or insert each."""

    def __init__(self, capacity_gb):
        self._cache = MultiModalCache.get_lru_cache(capacity_gb, bytes)

    def get_and_update_features(self, items):
        for mm_hash, _ in items:
            self._cache.touch(mm_hash)
        out = []
        for mm_hash, data in items:
            cached = self._cache.get(mm_hash)
            if cached is not None:
                out.append(cached)
                continue
            assert data is not None, f"Expected a cached item for {mm_hash=}"
            self._cache[mm_hash] = data
            out.append(data)
        return out
'''

STATIC_FACTORY_BODY = """
GiB_bytes = 1 << 30


class ProcessingCache:
    @staticmethod
    def get_lru_cache(capacity_gb, value_type, *, debug=False):
        return LRUCache(GiB_bytes * capacity_gb, getsizeof=len)
"""


def write_layout(root: Path, layout: str, lru_source: Path, version: str = "0.23.0") -> Path:
    """Write a ``vllm`` package of the given layout under ``root``; returns ``root``.

    Layouts: ``package`` (0.31+), ``module`` (0.10.1.1-0.30), ``processing``
    (0.10.0), ``unknown`` (a multimodal cache module without the factory).
    """
    pkg = root / "vllm"
    if pkg.exists():
        shutil.rmtree(pkg)
    (pkg / "utils").mkdir(parents=True)
    (pkg / "multimodal").mkdir()
    (pkg / "__init__.py").write_text(f'__version__ = "{version}"\n')
    (pkg / "utils" / "__init__.py").write_text("")
    shutil.copy(lru_source, pkg / "utils" / "cache.py")
    (pkg / "multimodal" / "__init__.py").write_text("")
    header = "from vllm.utils.cache import LRUCache\n"
    if layout == "package":
        (pkg / "multimodal" / "cache").mkdir()
        (pkg / "multimodal" / "cache" / "base.py").write_text(header + FACTORY_BODY)
        (pkg / "multimodal" / "cache" / "__init__.py").write_text(
            "from .base import ReceiverCache\n"
        )
    elif layout == "module":
        (pkg / "multimodal" / "cache.py").write_text(header + FACTORY_BODY)
    elif layout == "processing":
        (pkg / "multimodal" / "processing.py").write_text(header + STATIC_FACTORY_BODY)
        (pkg / "multimodal" / "cache.py").write_text("")
    elif layout == "unknown":
        (pkg / "multimodal" / "cache.py").write_text(header + "class SomethingElse:\n    pass\n")
        (pkg / "multimodal" / "processing.py").write_text("")
    else:
        raise ValueError(layout)
    return root


PRELUDE = textwrap.dedent(
    """
    import json, logging, sys
    records = []

    class _Keep(logging.Handler):
        def emit(self, record):
            records.append((record.name, record.levelname, record.getMessage()))

    _vllm_logger = logging.getLogger("vllm")
    _vllm_logger.addHandler(_Keep())
    _vllm_logger.setLevel(logging.DEBUG)
    _vllm_logger.propagate = False

    def report(**extra):
        print("RESULT " + json.dumps({"logs": records, **extra}, default=str))

    def ghost_sequence(cache):
        # A ghost key at the LRU end, as vLLM <= 0.23 leaves it, then inserts
        # until eviction. Without the fix this never returns (callers use a
        # subprocess timeout).
        cache._LRUCache__order["ghost"] = None
        cache._LRUCache__order.move_to_end("ghost", last=False)
        for i in range(40):
            cache[f"new-{i}"] = b"x" * 100
        return "ghost" not in cache._LRUCache__order and len(cache) > 0
    """
)


def run_snippet(
    root: Path, code: str, env: dict[str, str] | None = None, timeout: float = 30.0
) -> dict:
    """Run ``code`` in a fresh interpreter with ``root`` and the repo on the path.

    The snippet calls ``report(**values)``; its JSON comes back with the log
    records the ``vllm`` logger saw.
    """
    full_env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("MMCACHE_FIX_", "MMCACHE_HARNESS_"))
    }
    full_env["PYTHONPATH"] = os.pathsep.join([str(root), str(REPO)])
    full_env.update(env or {})
    try:
        proc = subprocess.run(
            [sys.executable, "-c", PRELUDE + textwrap.dedent(code)],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=full_env,
            cwd=str(root),
        )
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"snippet did not finish in {timeout:g} s (a hang?)") from exc
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise AssertionError(
        f"snippet failed (rc={proc.returncode})\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    )
