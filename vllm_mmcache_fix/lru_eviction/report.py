"""The start-up line of the eviction fix: one per process, saying whether it is protected.

Computes messages only; the fix decides when to log them.
"""

from __future__ import annotations

from .. import __version__
from ..core.messages import ACTIVE, NOT_PROTECTED
from ..core.process import process_label, vllm_version
from .probe import Exposure

REMEDIES = (
    "install and enable vllm-mmcache-fix (MMCACHE_FIX_MODE=on; if VLLM_PLUGINS is set it "
    "must list 'mmcache_fix'), or start vLLM with --mm-processor-cache-gb 0 (turns the "
    "cache off), or upgrade to vLLM >= 0.24.0 (removes the known trigger only)"
)


def active_line(target: str, layout: str, exposure: Exposure | None) -> str:
    bug = ""
    if exposure is not None:
        bug = (
            "; this vLLM's own LRUCache "
            + ("adds ghost keys on touch and " if exposure.touch_creates_ghost else "")
            + (
                "stalls on them in eviction"
                if exposure.eviction_stalls_on_ghost
                else "evicts safely"
            )
        )
    return (
        f"{ACTIVE} {process_label()}, vLLM {vllm_version()}, vllm-mmcache-fix {__version__}: "
        f"{target} "
        f"[{layout}] now builds caches whose touch/popitem/clear cannot stall{bug}"
    )


def exposure_warning(why_inactive: str, exposure: Exposure, capacity_gb: float | None) -> str:
    size = (
        f"--mm-processor-cache-gb={capacity_gb:g}"
        if capacity_gb is not None
        else "the multimodal processor cache (on by default, 4 GiB)"
    )
    return (
        f"{NOT_PROTECTED} {process_label()}, vLLM {vllm_version()} ({why_inactive}). "
        f"With {size}, a request rejected after its image was cached, followed by the same "
        "image, leaves a ghost key that freezes EngineCore at 100% CPU on the next eviction "
        f"(vllm#43941). Remedies: {REMEDIES}"
    )


def hardening_note(why_inactive: str) -> str:
    return (
        f"not active in {process_label()}, vLLM {vllm_version()} ({why_inactive}); this vLLM "
        "does not create ghost keys on touch, but its eviction still stalls if one appears"
    )


def needs_warning(exposure: Exposure, capacity_gb: float | None) -> bool:
    """Warn when the known trigger applies and the cache is (or may be) on."""
    if capacity_gb is not None and capacity_gb <= 0:
        return False
    return exposure.touch_creates_ghost
