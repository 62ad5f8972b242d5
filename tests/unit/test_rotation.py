"""CI's rotating cases and the e2e tier's order: pure logic, no server."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
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
    monkeypatch.setenv("MMCACHE_HARNESS_E2E_VERSIONS", "0.23.0 0.32.0")
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
    assert keys == [(0, 0, 0), (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)] + [(1, 0, 0)] * 3
    assert ordered[0] is items[5] and ordered[1] is items[7]  # file order kept within a group
    # The tests with servers of their own keep their collection order, whatever their
    # release: a module-scoped fixture split in two would start its servers twice.
    assert ordered[5:] == [items[0], items[2], items[4]]


@pytest.mark.parametrize("value", ["sequentail", "all concurrent", "soak", "sequential,typo"])
def test_a_misspelt_case_name_fails_loudly(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    # Quietly selecting nothing would skip both soaks with a green run.
    monkeypatch.setenv("SOME_TURN", value)
    with pytest.raises(rotation.UnknownCase, match="SOME_TURN=.*unknown.*sequential, concurrent"):
        rotation.this_turn(rotation.SOAKS, "SOME_TURN")


@pytest.mark.parametrize("value", ["0.23", "0.23.0 0.32", "v0.32.0", "0.32.o", " , "])
def test_a_misspelt_release_under_test_fails_loudly(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], value: str
) -> None:
    from harness import venvs

    monkeypatch.setenv(venvs.VERSIONS_ENV, value)
    with pytest.raises(ValueError, match="MMCACHE_HARNESS_E2E_VERSIONS"):
        venvs.e2e_versions()
    assert venvs.print_e2e_versions([]) == 2
    assert "MMCACHE_HARNESS_E2E_VERSIONS" in capsys.readouterr().err


def test_releases_under_test_read_spaces_and_commas(monkeypatch: pytest.MonkeyPatch) -> None:
    from harness import venvs

    monkeypatch.setenv(venvs.VERSIONS_ENV, "0.23.0, 0.10.1.1,0.8.5.post1")
    assert venvs.e2e_versions() == ["0.23.0", "0.10.1.1", "0.8.5.post1"]
    monkeypatch.delenv(venvs.VERSIONS_ENV)
    assert venvs.e2e_versions() == list(venvs.DEFAULT_VERSIONS)


def test_the_real_e2e_tier_runs_each_module_with_its_own_servers_in_one_piece() -> None:
    # Collected as CI collects it: a module whose servers come from a module-scoped
    # fixture must not be split by the ordering (it would start them again per piece).
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "MMCACHE_HARNESS_E2E_VERSIONS": "0.23.0 0.32.0"}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            "-p",
            "no:cacheprovider",
            "tests/e2e",
        ],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    ).stdout
    modules = [line.split("::")[0] for line in out.splitlines() if "::" in line]
    owning = {m for m in set(modules) if 'scope="module"' in (root / m).read_text(encoding="utf-8")}
    assert {"tests/e2e/test_e2e_liveness.py", "tests/e2e/test_e2e_abort_stuck.py"} <= owning
    pieces = [m for i, m in enumerate(modules) if i == 0 or modules[i - 1] != m]
    for module in owning:
        assert pieces.count(module) == 1, (module, pieces)
