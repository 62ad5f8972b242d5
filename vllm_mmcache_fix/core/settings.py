"""Settings read from the environment, one parser for all of them.

Names carry no ``VLLM_`` prefix: vLLM 0.17 and later warn about unknown
``VLLM_*`` variables. A bad value is never fatal: the default is used and the
setting carries one sentence saying why.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

ENV_MODE = "MMCACHE_FIX_MODE"
ENV_DRIFT = "MMCACHE_FIX_DRIFT"
ENV_FAIL_AT = "MMCACHE_FIX_FAIL_AT"
ENV_HEALTH_TIMEOUT = "MMCACHE_FIX_HEALTH_TIMEOUT"


class Mode(str, enum.Enum):
    ON = "on"
    """Patch the multimodal caches (default)."""
    WARN = "warn"
    """Patch nothing; only warn at start-up when the installed vLLM is exposed."""
    OFF = "off"
    """Do nothing at all."""


class DriftMode(str, enum.Enum):
    ON = "on"
    """Undo the cache changes of rejected requests and recover from EngineCore misses."""
    RECOVER = "recover"
    """Only recover from EngineCore misses (re-send with data)."""
    OFF = "off"
    """Patch nothing for drift."""


DEFAULT_MODE = Mode.ON
DEFAULT_DRIFT = DriftMode.ON

E = TypeVar("E", bound=enum.Enum)


@dataclass(frozen=True)
class Setting(Generic[E]):
    value: E
    problem: str | None = None
    """A sentence explaining why the environment value was not used."""

    @property
    def mode(self) -> E:
        return self.value


def read_choice(
    name: str, choices: type[E], default: E, environ: Mapping[str, str] | None = None
) -> Setting[E]:
    env = os.environ if environ is None else environ
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return Setting(default)
    value = raw.strip().lower()
    for choice in choices:
        if value == choice.value:
            return Setting(choice)
    allowed = "|".join(str(c.value) for c in choices)
    return Setting(default, f"{name}={raw!r} is not one of {allowed}; using {default.value!r}")


def read_mode(environ: Mapping[str, str] | None = None) -> Setting[Mode]:
    return read_choice(ENV_MODE, Mode, DEFAULT_MODE, environ)


def read_drift_mode(environ: Mapping[str, str] | None = None) -> Setting[DriftMode]:
    return read_choice(ENV_DRIFT, DriftMode, DEFAULT_DRIFT, environ)


def read_fail_at(environ: Mapping[str, str] | None = None) -> frozenset[str]:
    """Guarded sites made to raise on purpose (fault injection): names, or ``*`` for all."""
    env = os.environ if environ is None else environ
    raw = env.get(ENV_FAIL_AT) or ""
    return frozenset(part.strip() for part in raw.split(",") if part.strip())


DEFAULT_HEALTH_TIMEOUT = 60.0
"""Seconds of evidence before ``/health`` calls an EngineCore stuck: its input thread silent,
or its busy loop inside one step, for this long (docs/health.md: how it was chosen)."""
MIN_HEALTH_TIMEOUT = 5.0
"""The smallest timeout accepted (besides 0, off): the heartbeat pings every 2 s and a loaded
API server may take a second to read an answer, so a shorter one would judge a healthy engine."""


@dataclass(frozen=True)
class FloatSetting:
    value: float
    problem: str | None = None
    """A sentence explaining why the environment value was not used."""


def read_float(
    name: str,
    default: float,
    environ: Mapping[str, str] | None = None,
    minimum: float = 0.0,
) -> FloatSetting:
    """A number of seconds (or similar); empty means ``default``, below ``minimum`` is bad."""
    env = os.environ if environ is None else environ
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return FloatSetting(default)
    try:
        value = float(raw.strip())
    except ValueError:
        value = float("nan")
    if value != value or value in (float("inf"), float("-inf")) or value < minimum:
        return FloatSetting(
            default, f"{name}={raw!r} is not a number >= {minimum:g}; using {default:g}"
        )
    return FloatSetting(value)


def read_health_timeout(environ: Mapping[str, str] | None = None) -> FloatSetting:
    """``MMCACHE_FIX_HEALTH_TIMEOUT``: seconds, at least :data:`MIN_HEALTH_TIMEOUT`; ``0``
    switches the engine heartbeat off."""
    setting = read_float(ENV_HEALTH_TIMEOUT, DEFAULT_HEALTH_TIMEOUT, environ)
    if setting.problem or setting.value == 0 or setting.value >= MIN_HEALTH_TIMEOUT:
        return setting
    raw = (os.environ if environ is None else environ).get(ENV_HEALTH_TIMEOUT)
    return FloatSetting(
        DEFAULT_HEALTH_TIMEOUT,
        f"{ENV_HEALTH_TIMEOUT}={raw!r} is below the floor of {MIN_HEALTH_TIMEOUT:g} s (0 turns "
        f"the check off); using {DEFAULT_HEALTH_TIMEOUT:g}",
    )


ENV_STALL_SECONDS = "MMCACHE_FIX_STALL_SECONDS"
DEFAULT_STALL_SECONDS = 10.0


def read_stall_seconds(environ: Mapping[str, str] | None = None) -> FloatSetting:
    """How long a thread may stay in one place burning CPU before it is reported; 0: off."""
    return read_float(ENV_STALL_SECONDS, DEFAULT_STALL_SECONDS, environ)
