"""Every ``MMCACHE_FIX_*`` setting has one row in ``plugin.settings()`` (the plugin's own in
``core/settings_table``, each fix's in its declaration), which ``check``
reports and validates, and each row reads the environment as the plugin does."""

from __future__ import annotations

import pytest

from vllm_mmcache_fix import plugin
from vllm_mmcache_fix.core import settings as s
from vllm_mmcache_fix.core import settings_table as table


def test_every_setting_has_a_row() -> None:
    """A new ``ENV_*`` name without a row fails here (``check`` lists it unvalidated)."""
    names = [spec.name for spec in plugin.settings()]
    assert len(names) == len(set(names))
    assert set(table.setting_names()) <= set(names)
    assert all(name.startswith(s.ENV_PREFIX) for name in names)
    for spec in plugin.settings():
        assert spec.values and spec.meaning
        assert spec.read({}).problem is None  # the default is always fine


READERS = {
    s.ENV_MODE: lambda env: s.read_mode(env).value,
    s.ENV_DRIFT: lambda env: s.read_drift_mode(env).value,
    s.ENV_HEALTH_TIMEOUT: lambda env: s.read_health_timeout(env).value,
    s.ENV_STALL_SECONDS: lambda env: s.read_stall_seconds(env).value,
}


VALUES = ["on", "OFF", " warn ", "recover", "0", "10", "2.5", "-3", "30s", "", "nan", "inf", "é"]


@pytest.mark.parametrize("name", sorted(READERS))
@pytest.mark.parametrize("raw", VALUES)
def test_the_table_reads_as_the_plugin_reads(name: str, raw: str) -> None:
    env = {name: raw}
    [spec] = [spec for spec in plugin.settings() if spec.name == name]
    reading = spec.read(env)
    assert reading.value == READERS[name](env)
    [row] = [r for r in table.report_settings(env) if r.name == name]
    assert row.effective == reading.value and row.raw == raw
    assert (row.problem is None) == (reading.problem is None)


@pytest.mark.parametrize(
    ("name", "raw"),
    [
        (s.ENV_HEALTH_TIMEOUT, "30s"),
        (s.ENV_STALL_SECONDS, "-3"),
        (s.ENV_DRIFT, "maybe"),
        (s.ENV_MODE, "of"),
        (s.ENV_PATCHES_DIR, "/nonexistent"),
        (s.ENV_FAIL_AT, "*"),
    ],
)
def test_bad_or_risky_values_are_flagged(name: str, raw: str) -> None:
    [row] = [r for r in table.report_settings({name: raw}) if r.name == name]
    assert row.problem and name in row.problem


def test_unknown_names_are_flagged_not_dropped() -> None:
    rows = table.report_settings({"MMCACHE_FIX_STALL_SECOND": "3", "OTHER": "x"})
    unknown = [r for r in rows if not r.known]
    assert [r.name for r in unknown] == ["MMCACHE_FIX_STALL_SECOND"]
    assert "not a setting" in (unknown[0].problem or "")
