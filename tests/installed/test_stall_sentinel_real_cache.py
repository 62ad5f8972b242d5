"""The stall sentinel on vLLM 0.23.0's own ``LRUCache`` frozen by a ghost key (no server).

vLLM 0.23.0's ``touch`` puts a key with no data in the eviction order; the next
insert that must evict spins in ``popitem`` forever. A thread doing that in the
venv's Python must get one sentinel WARNING naming ``Cache.__setitem__`` and a
stack through vLLM's ``LRUCache.popitem``.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap

from harness.paths import REPO_ROOT
from harness.venvs import python
from vllm_mmcache_fix.core.messages import PREFIX, STALL

PROGRAM = textwrap.dedent(
    """
    import json, logging, sys, threading, time
    logger = logging.getLogger("vllm")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logger.addHandler(handler); logger.setLevel(logging.INFO); logger.propagate = False
    from vllm_mmcache_fix.stall_sentinel.fix import StallSentinelFix
    from vllm.utils.cache import LRUCache
    sentinel = StallSentinelFix(); sentinel.install()
    from vllm_mmcache_fix.core import signals
    signals.ENGINE_CORE_RUNNING.send()  # identified, as an EngineCore's busy loop does
    cache = LRUCache(2)
    cache.touch("ghost")
    def fill():
        for i in range(10):
            cache[f"k{i}"] = i
    threading.Thread(target=fill, name="cache-writer", daemon=True).start()
    time.sleep(7)
    print(json.dumps(sentinel.status()))
    """
)


def test_sentinel_reports_vllms_lru_cache_spinning_on_a_ghost_key(vllm_venv) -> None:
    venv = vllm_venv("0.23.0")
    proc = subprocess.run(
        [str(python(venv)), "-c", PROGRAM],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(REPO_ROOT),
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "MMCACHE_FIX_STALL_SECONDS": "2"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    status = json.loads(proc.stdout.strip().splitlines()[-1])
    # Importing vLLM sets up its own handler for the ``vllm`` logger (on stdout).
    lines = (proc.stdout + proc.stderr).splitlines()
    headers = [i for i, line in enumerate(lines) if PREFIX + STALL in line]
    assert len(headers) == 1, (proc.stdout + proc.stderr)[-3000:]
    header = lines[headers[0]]
    assert "thread 'cache-writer'" in header, header
    assert "stayed in Cache.__setitem__ (innermost" in header, header
    assert "vllm#43941" in header, header  # the eviction frames are on the stack
    stack = [line.strip() for line in lines[headers[0] + 1 : headers[0] + 12]]
    assert any("vllm/utils/cache.py" in line and "LRUCache.popitem" in line for line in stack)
    assert any("cachetools/__init__.py" in line for line in stack), stack
    assert status["stalls"] == 1 and status["last_stall"]["in"] == "Cache.__setitem__"
    assert status["last_stall"]["cause"] == "cache_eviction"
