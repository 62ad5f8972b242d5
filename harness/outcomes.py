"""A pytest plugin that writes every test's outcome to ``$MMCACHE_HARNESS_OUTCOMES``.

``tests/conftest.py`` loads it; ``python -m harness skip-check`` (:mod:`harness.skips`) reads
the file. Recorded per test: passed, failed, xfailed/xpassed, skipped (with pytest's reason:
``pytest.skip``, ``skipif``, an empty parameter set), deselected (``-k``, ``-m``), and the
modules skipped whole at collection. Nothing is written without the variable.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

OUTCOMES_ENV = "MMCACHE_HARNESS_OUTCOMES"
_PATH = os.environ.pop(OUTCOMES_ENV, "")
"""Taken out of the environment: a pytest a test starts in a child must not write there."""
_outcomes: dict[str, dict[str, object]] = {}
_collect_skips: list[dict[str, object]] = []
_markers: dict[str, list[str]] = {}


def _recording() -> bool:
    return bool(_PATH)


def _marker_names(item: pytest.Item) -> list[str]:
    return sorted({m.name for m in item.iter_markers()})


def _skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        reason = str(longrepr[2])
        return reason[len("Skipped: ") :] if reason.startswith("Skipped: ") else reason
    return str(longrepr or "")


def pytest_collection_finish(session: pytest.Session) -> None:
    if _recording():
        for item in session.items:
            _markers[item.nodeid] = _marker_names(item)


def pytest_deselected(items: list[pytest.Item]) -> None:
    if _recording():
        for item in items:
            _outcomes[item.nodeid] = {"outcome": "deselected", "markers": _marker_names(item)}


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if _recording() and report.skipped:
        _collect_skips.append({"node": report.nodeid, "reason": _skip_reason(report)})


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """A skip in set-up or call, else the call's result; an error anywhere is a failure."""
    if not _recording():
        return
    entry = _outcomes.setdefault(
        report.nodeid, {"outcome": "passed", "markers": _markers.get(report.nodeid, [])}
    )
    if entry["outcome"] in ("failed", "skipped"):
        return
    if hasattr(report, "wasxfail"):
        entry["outcome"] = "xfailed" if report.skipped else "xpassed"
    elif report.skipped:
        entry["outcome"] = "skipped"
        entry["reason"] = _skip_reason(report)
    elif report.failed:
        entry["outcome"] = "failed"


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    path = _PATH
    if not path:
        return
    doc = {
        "python": ".".join(map(str, sys.version_info[:2])),
        "args": [str(a) for a in session.config.invocation_params.args],
        "exitstatus": int(exitstatus),
        "items": [{"node": node, **entry} for node, entry in sorted(_outcomes.items())],
        "collect_skips": _collect_skips,
    }
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
