"""Settings read from the environment, one parser for all of them.

Names carry no ``VLLM_`` prefix: vLLM 0.17 and later warn about unknown
``VLLM_*`` variables. A bad value is never fatal: the default is used and the
setting carries one sentence saying why. The table of every setting, as ``check`` reports
them, is :mod:`.settings_table` (not loaded by a vLLM worker).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from .records import frozen

ENV_MODE = "MMCACHE_FIX_MODE"
ENV_DRIFT = "MMCACHE_FIX_DRIFT"
ENV_FAIL_AT = "MMCACHE_FIX_FAIL_AT"
ENV_HEALTH_TIMEOUT = "MMCACHE_FIX_HEALTH_TIMEOUT"


class Mode:
    """``MMCACHE_FIX_MODE``'s values (plain strings: an ``enum.Enum`` class costs 0.1 ms to
    build, in every vLLM process)."""

    ON = "on"
    """Patch the multimodal caches (default)."""
    WARN = "warn"
    """Leave vLLM's multimodal caches and sender cache as they are (no eviction fix, no drift
    guard) and warn at start-up when the installed vLLM is exposed; the stall detection still
    runs: the ``/health`` engine check (503 for a stuck engine; off with
    ``MMCACHE_FIX_HEALTH_TIMEOUT=0``), the stall sentinel (off with
    ``MMCACHE_FIX_STALL_SECONDS=0``) and the metrics. It is the mode to see the freeze happen
    and be restarted, without the fix."""
    OFF = "off"
    """Do nothing at all."""


class DriftMode:
    """``MMCACHE_FIX_DRIFT``'s values."""

    ON = "on"
    """Undo the cache changes of rejected requests and recover from EngineCore misses."""
    RECOVER = "recover"
    """Only recover from EngineCore misses (re-send with data)."""
    OFF = "off"
    """Patch nothing for drift."""


MODES = (Mode.ON, Mode.WARN, Mode.OFF)
DRIFT_MODES = (DriftMode.ON, DriftMode.RECOVER, DriftMode.OFF)
DEFAULT_MODE = Mode.ON
DEFAULT_DRIFT = DriftMode.ON


@frozen
class Setting:
    value: str
    """One of the setting's choices."""
    problem: str | None = None
    """A sentence explaining why the environment value was not used."""

    @property
    def mode(self) -> str:
        return self.value


def read_choice(
    name: str, choices: Sequence[str], default: str, environ: Mapping[str, str] | None = None
) -> Setting:
    """One of ``choices`` (case and spaces ignored); empty means ``default``."""
    env = os.environ if environ is None else environ
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return Setting(default)
    value = raw.strip().lower()
    if value in choices:
        return Setting(value)
    allowed = "|".join(choices)
    return Setting(default, f"{name}={raw!r} is not one of {allowed}; using {default!r}")


def read_mode(environ: Mapping[str, str] | None = None) -> Setting:
    return read_choice(ENV_MODE, MODES, DEFAULT_MODE, environ)


def read_drift_mode(environ: Mapping[str, str] | None = None) -> Setting:
    return read_choice(ENV_DRIFT, DRIFT_MODES, DEFAULT_DRIFT, environ)


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


@frozen
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


ENV_STEP_TIMEOUT = "MMCACHE_FIX_STEP_TIMEOUT"
VLLM_STEP_TIMEOUT = "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"
"""vLLM's own bound on one step (its default: :data:`DEFAULT_STEP_TIMEOUT`)."""
DEFAULT_STEP_TIMEOUT = 300.0


def read_step_timeout(environ: Mapping[str, str] | None = None) -> FloatSetting:
    """How long one EngineCore step may run before ``/health`` calls the busy loop stuck:
    ``MMCACHE_FIX_STEP_TIMEOUT`` when set, else vLLM's own bound (its
    ``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS``, 300 s by default). Never below the health
    timeout (the heartbeat takes the larger)."""
    env = os.environ if environ is None else environ
    vllm_own = read_float(VLLM_STEP_TIMEOUT, DEFAULT_STEP_TIMEOUT, env, MIN_HEALTH_TIMEOUT)
    default = vllm_own.value
    setting = read_float(ENV_STEP_TIMEOUT, default, env, MIN_HEALTH_TIMEOUT)
    if env.get(ENV_STEP_TIMEOUT, "").strip() == "" and vllm_own.problem:
        return FloatSetting(default, vllm_own.problem)
    return setting


ENV_PROGRESS_TIMEOUT = "MMCACHE_FIX_PROGRESS_TIMEOUT"
DEFAULT_PROGRESS_TIMEOUT = 60.0
"""Seconds without net progress while eligible work waits before ``/health`` fails: 65 s
at most from the last progress to the 503 (two answers, 2 s apart, must agree)."""
PROGRESS_TIMEOUT_RANGE = (30.0, 600.0)


def read_progress_timeout(environ: Mapping[str, str] | None = None) -> FloatSetting:
    """``MMCACHE_FIX_PROGRESS_TIMEOUT``: 30-600 s, or 0 (the progress rule off)."""
    env = os.environ if environ is None else environ
    setting = read_float(ENV_PROGRESS_TIMEOUT, DEFAULT_PROGRESS_TIMEOUT, env)
    low, high = PROGRESS_TIMEOUT_RANGE
    if setting.problem or setting.value == 0 or low <= setting.value <= high:
        return setting
    return FloatSetting(
        DEFAULT_PROGRESS_TIMEOUT,
        f"{ENV_PROGRESS_TIMEOUT}={env.get(ENV_PROGRESS_TIMEOUT)!r} is outside {low:g}-{high:g} "
        f"s (0 turns the rule off); using {DEFAULT_PROGRESS_TIMEOUT:g}",
    )


ENV_ABORT_STUCK = "MMCACHE_FIX_ABORT_STUCK"
"""Whether EngineCore aborts the oldest stuck request at a zero-token livelock (default off)."""


class Switch:
    OFF = "off"
    ON = "on"


SWITCHES = (Switch.OFF, Switch.ON)
DEFAULT_ABORT_STUCK = Switch.OFF


def read_abort_stuck(environ: Mapping[str, str] | None = None) -> Setting:
    """``MMCACHE_FIX_ABORT_STUCK``: on | off (default off)."""
    return read_choice(ENV_ABORT_STUCK, SWITCHES, DEFAULT_ABORT_STUCK, environ)


ENV_STALL_SECONDS = "MMCACHE_FIX_STALL_SECONDS"
DEFAULT_STALL_SECONDS = 10.0


def read_stall_seconds(environ: Mapping[str, str] | None = None) -> FloatSetting:
    """How long a thread may stay in one place burning CPU before it is reported; 0: off."""
    return read_float(ENV_STALL_SECONDS, DEFAULT_STALL_SECONDS, environ)


ENV_SNAPSHOT_DIR = "MMCACHE_FIX_SNAPSHOT_DIR"
"""Where the API server writes the stall snapshot at a verdict (default: a temp dir)."""
SNAPSHOT_DIR_NAME = "vllm-mmcache-fix-snapshots"


def read_snapshot_dir(environ: Mapping[str, str] | None = None) -> tuple[str, str | None]:
    """The snapshot directory, and the problem with the setting (then the default is used)."""
    import tempfile

    env = os.environ if environ is None else environ
    default = os.path.join(tempfile.gettempdir(), SNAPSHOT_DIR_NAME)
    raw = env.get(ENV_SNAPSHOT_DIR, "").strip()
    if not raw:
        return default, None
    path = os.path.expanduser(raw)
    if os.path.exists(path) and not os.path.isdir(path):
        return default, f"{ENV_SNAPSHOT_DIR}={raw!r} is not a directory; using {default}"
    return path, None


ENV_PATCHES_DIR = "MMCACHE_FIX_PATCHES_DIR"
"""Where ``vllm-mmcache-fix patch`` finds ``index.json`` and the diffs (default: the wheel's)."""

ENV_PREFIX = "MMCACHE_FIX_"
