"""CI's rotating cases and the e2e tier's order: pure logic, no server."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from harness import rotation, shared_servers


def test_rotate_is_a_stable_choice_that_walks_the_pool() -> None:
    pool = ["a", "b", "c", "d"]
    assert rotation.rotate(pool, key="x") == rotation.rotate(pool, key="x")
    assert len(set(rotation.rotate(pool, 3, key="x"))) == 3
    seen = {rotation.rotate(pool, key=f"{i:040x}")[0] for i in range(40)}
    assert seen == set(pool)
    assert rotation.rotate([], key="x") == []


def test_this_turn_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SOME_TURN", "all")
    assert rotation.this_turn(rotation.SOAKS, "SOME_TURN") == list(rotation.SOAKS)
    monkeypatch.setenv("SOME_TURN", "concurrent")
    assert rotation.this_turn(rotation.SOAKS, "SOME_TURN") == ["concurrent"]
    monkeypatch.delenv("SOME_TURN")
    monkeypatch.setenv(rotation.KEY_ENV, "k")
    assert rotation.this_turn(rotation.SOAKS, "SOME_TURN") == rotation.rotate(rotation.SOAKS)


def _item(version: str | None, kind: str | None) -> Any:
    marker = SimpleNamespace(args=(kind,)) if kind else None
    callspec = SimpleNamespace(params={"version": version}) if version else None
    return SimpleNamespace(callspec=callspec, get_closest_marker=lambda name: marker)


def test_e2e_tests_run_grouped_by_shared_server(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MMCACHE_FIX_E2E_VERSIONS", "0.23.0 0.32.0")
    items = [
        _item("0.32.0", None),
        _item("0.23.0", "noplugin"),
        _item(None, None),
        _item("0.32.0", "plugin"),
        _item("0.23.0", None),
        _item("0.23.0", "plugin"),
        _item("0.32.0", "noplugin"),
        _item("0.23.0", "plugin"),
    ]
    ordered = sorted(items, key=shared_servers.server_order)
    keys = [shared_servers.server_order(i) for i in ordered]
    assert keys == [(0, 0), (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2), (2, 2)]
    assert ordered[0] is items[5] and ordered[1] is items[7]  # file order kept within a group
