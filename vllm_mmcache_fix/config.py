"""Settings read from the environment.

Names carry no ``VLLM_`` prefix: vLLM 0.17 and later warn about unknown
``VLLM_*`` variables.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping
from dataclasses import dataclass

ENV_MODE = "MMCACHE_FIX_MODE"


class Mode(str, enum.Enum):
    ON = "on"
    """Patch the multimodal caches (default)."""
    WARN = "warn"
    """Patch nothing; only warn at start-up when the installed vLLM is exposed."""
    OFF = "off"
    """Do nothing at all."""


DEFAULT_MODE = Mode.ON


@dataclass(frozen=True)
class ModeSetting:
    mode: Mode
    problem: str | None = None
    """A sentence explaining why the environment value was not used."""


def read_mode(environ: Mapping[str, str] | None = None) -> ModeSetting:
    env = os.environ if environ is None else environ
    raw = env.get(ENV_MODE)
    if raw is None or raw.strip() == "":
        return ModeSetting(DEFAULT_MODE)
    value = raw.strip().lower()
    for mode in Mode:
        if value == mode.value:
            return ModeSetting(mode)
    allowed = "|".join(m.value for m in Mode)
    return ModeSetting(
        DEFAULT_MODE,
        f"{ENV_MODE}={raw!r} is not one of {allowed}; using {DEFAULT_MODE.value!r}",
    )
