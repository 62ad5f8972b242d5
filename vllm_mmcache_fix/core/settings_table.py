"""The table of every ``MMCACHE_FIX_*`` setting, as ``check`` reports and validates them.

Each fix declares its settings' rows (``<fix>/owns.py``); this module has the plugin's own
and the machinery. The readers themselves are in :mod:`.settings`, which every process that
installs a fix loads; this table comes only with a declaration that has settings (not in a
vLLM worker).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence

from . import settings
from .records import frozen
from .settings import (
    DEFAULT_MODE,
    ENV_FAIL_AT,
    ENV_MODE,
    ENV_PATCHES_DIR,
    ENV_PREFIX,
    ENV_SNAPSHOT_DIR,
    SNAPSHOT_DIR_NAME,
    FloatSetting,
    Setting,
    read_fail_at,
    read_mode,
    read_snapshot_dir,
)


@frozen
class Reading:
    """One setting as a process would read it: the value it uses and, if the environment's
    value was not usable (or is risky), one sentence saying why."""

    value: object
    problem: str | None = None


def _read_snapshot_dir(environ: Mapping[str, str]) -> Reading:
    path, problem = read_snapshot_dir(environ)
    return Reading(path, problem)


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


def reading_of(
    reader: Callable[[Mapping[str, str] | None], Setting | FloatSetting],
) -> Callable[[Mapping[str, str]], Reading]:
    """A table row's reader from a setting's own parser (a choice or a number)."""

    def read(environ: Mapping[str, str]) -> Reading:
        setting = reader(environ)
        return Reading(setting.value, setting.problem)

    return read


SETTINGS_BEFORE_FIXES: tuple[SettingSpec, ...] = (
    SettingSpec(
        ENV_MODE,
        DEFAULT_MODE,
        "on | warn | off",
        "on: patch the multimodal caches; warn: leave the caches as vLLM has them, warn when "
        "exposed, keep the stall detection (/health check, sentinel, metrics); off: nothing",
        reading_of(read_mode),
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
    """Every ``ENV_*`` name :mod:`.settings` defines, with or without a row."""
    return sorted(
        value
        for key, value in vars(settings).items()
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
