"""vllm-mmcache-fix: multimodal processor caches that cannot freeze vLLM.

Installed next to vLLM, the ``mmcache_fix`` general plugin replaces the LRU
behind vLLM's multimodal processor caches with one whose eviction always
makes progress. Importing this package never imports vLLM.
"""

from __future__ import annotations

from .plugin import instrument, register, status, uninstrument

__version__ = "0.1.0"

__all__ = ["__version__", "instrument", "register", "status", "uninstrument"]
