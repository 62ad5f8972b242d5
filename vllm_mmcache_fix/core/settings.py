"""Settings read from the environment, one parser for all of them.

Names carry no ``VLLM_`` prefix: vLLM 0.17 and later warn about unknown
``VLLM_*`` variables. A bad value is never fatal: the default is used and the
setting carries one sentence saying why.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Generic, TypeVar

from .records import frozen

ENV_MODE = "MMCACHE_FIX_MODE"
ENV_DRIFT = "MMCACHE_FIX_DRIFT"
ENV_FAIL_AT = "MMCACHE_FIX_FAIL_AT"
ENV_HEALTH_TIMEOUT = "MMCACHE_FIX_HEALTH_TIMEOUT"


class Mode(str, enum.Enum):
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


@frozen
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


class Switch(str, enum.Enum):
    OFF = "off"
    ON = "on"


DEFAULT_ABORT_STUCK = Switch.OFF


def read_abort_stuck(environ: Mapping[str, str] | None = None) -> Setting[Switch]:
    """``MMCACHE_FIX_ABORT_STUCK``: on | off (default off)."""
    return read_choice(ENV_ABORT_STUCK, Switch, DEFAULT_ABORT_STUCK, environ)


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


def _read_snapshot_dir(environ: Mapping[str, str]) -> Reading:
    path, problem = read_snapshot_dir(environ)
    return Reading(path, problem)


# --------------------------------------------------------------------------- the table

ENV_PATCHES_DIR = "MMCACHE_FIX_PATCHES_DIR"
"""Where ``vllm-mmcache-fix patch`` finds ``index.json`` and the diffs (default: the wheel's)."""

ENV_PREFIX = "MMCACHE_FIX_"


@frozen
class Reading:
    """One setting as a process would read it: the value it uses and, if the environment's
    value was not usable (or is risky), one sentence saying why."""

    value: object
    problem: str | None = None


def _read_fail_at(environ: Mapping[str, str]) -> Reading:
    places = read_fail_at(environ)
    if not places:
        return Reading("")
    return Reading(
        ",".join(sorted(places)),
        f"{ENV_FAIL_AT}={environ.get(ENV_FAIL_AT)!r} makes the plugin fail on purpose at "
        "these places (fault injection, for tests only); unset it in production",
    )


def _read_patches_dir(environ: Mapping[str, str]) -> Reading:
    raw = environ.get(ENV_PATCHES_DIR)
    if raw is None or raw.strip() == "":
        return Reading("")
    path = os.path.expanduser(raw)
    if not os.path.isfile(os.path.join(path, "index.json")):
        return Reading(
            path, f"{ENV_PATCHES_DIR}={raw!r} has no index.json: `patch` will fail with it"
        )
    return Reading(path)


@frozen
class SettingSpec:
    name: str
    default: str
    """The default as an operator would write it ("" for unset)."""
    values: str
    """What the setting accepts, in a few words."""
    meaning: str
    read: Callable[[Mapping[str, str]], Reading]


def choice_reader(
    reader: Callable[[Mapping[str, str] | None], Setting[Any]],
) -> Callable[[Mapping[str, str]], Reading]:
    def read(environ: Mapping[str, str]) -> Reading:
        setting = reader(environ)
        return Reading(setting.value.value, setting.problem)

    return read


def float_reader(
    reader: Callable[[Mapping[str, str] | None], FloatSetting],
) -> Callable[[Mapping[str, str]], Reading]:
    def read(environ: Mapping[str, str]) -> Reading:
        setting = reader(environ)
        return Reading(setting.value, setting.problem)

    return read


SETTINGS_BEFORE_FIXES: tuple[SettingSpec, ...] = (
    SettingSpec(
        ENV_MODE,
        DEFAULT_MODE.value,
        "on | warn | off",
        "on: patch the multimodal caches; warn: leave the caches as vLLM has them, warn when "
        "exposed, keep the stall detection (/health check, sentinel, metrics); off: nothing",
        choice_reader(read_mode),
    ),
)
SETTINGS_AFTER_FIXES: tuple[SettingSpec, ...] = (
    SettingSpec(
        ENV_SNAPSHOT_DIR,
        "",
        "a directory",
        "where the API server writes one JSON stall snapshot at each stall's first verdict "
        "(default: <temp dir>/" + SNAPSHOT_DIR_NAME + ")",
        _read_snapshot_dir,
    ),
    SettingSpec(
        ENV_FAIL_AT,
        "",
        "place names, comma-separated, or *",
        "fault injection for tests: the named places of the plugin fail on purpose",
        _read_fail_at,
    ),
    SettingSpec(
        ENV_PATCHES_DIR,
        "",
        "a directory",
        "where `vllm-mmcache-fix patch` finds index.json and the diffs",
        _read_patches_dir,
    ),
)
"""The settings of the plugin as a whole; each fix declares its own (``<fix>/owns.py``) and
``plugin.settings()`` lists them all, in this order, for ``check``. A new ``ENV_*`` name
gets a row somewhere (``tests/unit/test_settings_table.py`` fails until it has one)."""


def setting_names() -> list[str]:
    """Every ``ENV_*`` name this module defines, with or without a row in :data:`SETTINGS`."""
    return sorted(
        value
        for key, value in globals().items()
        if key.startswith("ENV_") and key != "ENV_PREFIX" and isinstance(value, str)
    )


@frozen
class SettingReport:
    name: str
    raw: str | None
    """The environment's value, None when unset."""
    effective: object
    """The value the plugin uses (the default when unset or bad)."""
    default: str
    values: str
    problem: str | None
    known: bool = True


def report_settings(
    environ: Mapping[str, str] | None = None, specs: Sequence[SettingSpec] | None = None
) -> list[SettingReport]:
    """Every setting (``specs``, by default ``plugin.settings()``, or ``MMCACHE_FIX_*`` in the
    environment) with its effective value and the problem with it, if any. An unknown
    ``MMCACHE_FIX_*`` name is reported: a typo would otherwise be ignored silently."""
    env = os.environ if environ is None else environ
    if specs is None:
        from .. import plugin

        specs = plugin.settings()
    rows: list[SettingReport] = []
    for spec in specs:
        raw = env.get(spec.name)
        try:
            reading = spec.read(env)
        except Exception as exc:  # a reader must never break the report
            reading = Reading(None, f"{spec.name}={raw!r} could not be read: {exc!r}")
        rows.append(
            SettingReport(spec.name, raw, reading.value, spec.default, spec.values, reading.problem)
        )
    listed = {spec.name for spec in specs}
    for name in setting_names():
        if name not in listed:
            # A setting defined above without a row yet: reported, not validated.
            rows.append(SettingReport(name, env.get(name), env.get(name), "", "", None))
    known = {row.name for row in rows}
    for name in sorted(env):
        if name.startswith(ENV_PREFIX) and name not in known:
            rows.append(
                SettingReport(
                    name,
                    env[name],
                    None,
                    "",
                    "",
                    f"{name} is not a setting of vllm-mmcache-fix; it has no effect",
                    known=False,
                )
            )
    return rows
