"""Skip accounting: a run where a required test skipped, or was deselected, fails.

A real pytest run (a subprocess, on a small tier written for the test) records its
outcomes through ``harness.outcomes``; ``harness.skips`` judges them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness import skips
from harness.paths import REPO_ROOT

TIER = """
import pytest

pytestmark = []

def test_runs():
    assert True

@pytest.mark.parametrize("version", [v for v in ["0.23.0"] if v == "{selected}"])
def test_per_release(version):
    assert version

def test_skips_itself():
    pytest.skip("the other soak's turn")

@pytest.mark.realtime
def test_real_threads():
    assert True

@pytest.mark.xfail(strict=True)
def test_known_bug():
    assert False
"""

GONE = """
import pytest
pytest.skip("no sources here", allow_module_level=True)
"""


def _run(tmp_path: Path, *args: str, selected: str = "0.23.0") -> dict:  # type: ignore[type-arg]
    tier = tmp_path / "tests" / "unit"
    tier.mkdir(parents=True, exist_ok=True)
    (tier / "test_a.py").write_text(TIER.replace("{selected}", selected))
    (tier / "test_gone.py").write_text(GONE)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    realtime: x\n")
    out = tmp_path / "outcomes.json"
    env = {**os.environ, "MMCACHE_HARNESS_OUTCOMES": str(out), "PYTHONPATH": str(REPO_ROOT)}
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "harness.outcomes", "-p", "no:cacheprovider"]
        + list(args),
        cwd=str(tmp_path),
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    return json.loads(out.read_text())  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def chosen(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:  # type: ignore[type-arg]
    """One run (``-m "not realtime"``, the release list left empty) and its tier's folder."""
    root = tmp_path_factory.mktemp("run")
    return root / "tests", _run(root, "tests", "-m", "not realtime", selected="0.32.0")


def _outcomes(doc: dict) -> dict[str, str]:  # type: ignore[type-arg]
    found = {i["node"].split("::")[-1]: i["outcome"] for i in doc["items"]}
    found.update({s["node"]: "skipped (module)" for s in doc["collect_skips"]})
    return found


def test_every_kind_of_not_running_is_recorded(chosen: tuple[Path, dict]) -> None:  # type: ignore[type-arg]
    _, doc = chosen
    assert _outcomes(doc) == {
        "test_runs": "passed",
        "test_per_release[NOTSET]": "skipped",  # "got empty parameter set"
        "test_skips_itself": "skipped",
        "test_real_threads": "deselected",
        "test_known_bug": "xfailed",
        "tests/unit/test_gone.py": "skipped (module)",
    }
    reasons = {i["node"].split("::")[-1]: i.get("reason", "") for i in doc["items"]}
    assert "got empty parameter set" in reasons["test_per_release[NOTSET]"]
    assert reasons["test_skips_itself"] == "the other soak's turn"


def _expected(tmp_path: Path, text: str) -> list[skips.Expected]:
    pytest.importorskip("tomllib")  # the checker runs under the test environment's Python
    path = tmp_path / "expected.toml"
    path.write_text(text)
    return skips.load_expected(path)


ALLOW_SOAK = """
[[expected]]
test = "tests/unit/test_a.py::test_skips_itself"
reason = "the other soak's turn"
why = "one soak per commit"
"""
ALLOW_REST = """
[[expected]]
outcome = "deselected"
marker = "realtime"
lanes = ["py3.9"]
why = "ran in the main lane"

[[expected]]
test = "tests/unit/test_gone.py"
reason = "no sources"
why = "x"

[[expected]]
test = "tests/unit/test_a.py::test_per_release*"
reason = "got empty parameter set"
why = "x"
"""


def test_an_unexpected_skip_or_deselection_fails_the_tier(
    tmp_path: Path,
    chosen: tuple[Path, dict],  # type: ignore[type-arg]
) -> None:
    root, doc = chosen
    verdict = skips.check(doc, ["unit"], "main", _expected(tmp_path, ALLOW_SOAK), root)
    assert not verdict.ok
    problems = "\n".join(verdict.lines)
    assert "skipped but required: tests/unit/test_a.py::test_per_release" in problems
    assert "got empty parameter set" in problems
    assert "deselected but required: tests/unit/test_a.py::test_real_threads" in problems
    assert "skipped but required: tests/unit/test_gone.py: no sources here" in problems
    assert not any("test_skips_itself" in line for line in verdict.lines if "required" in line)
    # Each allowed by an entry, in its lane only:
    allowed = _expected(tmp_path, ALLOW_SOAK + ALLOW_REST)
    assert skips.check(doc, ["unit"], "py3.9", allowed, root).ok
    assert not skips.check(doc, ["unit"], "main", allowed, root).ok


def test_a_tier_that_ran_nothing_fails(tmp_path: Path) -> None:
    doc = _run(tmp_path / "run", "tests", "-k", "nothing_matches")
    root = tmp_path / "run" / "tests"
    allow_all = _expected(
        tmp_path, '[[expected]]\noutcome = "deselected"\nwhy = "x"\n' + ALLOW_SOAK + ALLOW_REST
    )
    verdict = skips.check(doc, ["unit"], "main", allow_all, root)
    assert not verdict.ok
    assert any("not a single test ran" in line for line in verdict.lines)


def test_the_checker_program_fails_and_partial_runs_only_report(
    tmp_path: Path,
    chosen: tuple[Path, dict],  # type: ignore[type-arg]
) -> None:
    pytest.importorskip("tomllib")
    _, doc = chosen
    path = tmp_path / "outcomes.json"
    path.write_text(json.dumps(doc))
    expected = tmp_path / "e.toml"
    expected.write_text(ALLOW_SOAK)
    base = [str(path), "--tiers", "unit", "--expected", str(expected)]
    assert skips.main(base) == 1
    assert skips.main([*base, "--partial"]) == 0
    assert skips.main([str(tmp_path / "none.json"), "--tiers", "unit"]) == 1


def test_a_run_split_in_two_parts_counts_each_test_the_part_that_ran_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``-m realtime`` then ``-m "not realtime"`` (scripts/run-tests' main unit lane): each part
    alone deselects what the other runs, the two together ran every test."""
    pytest.importorskip("tomllib")
    parts = [
        _run(tmp_path / name, "tests", "-m", marker)
        for name, marker in (("first", "realtime"), ("rest", "not realtime"))
    ]
    root = tmp_path / "rest" / "tests"
    allowed = _expected(tmp_path, ALLOW_SOAK + ALLOW_REST)
    for part in parts:
        assert not skips.check(part, ["unit"], "main", allowed, root).ok
    merged = skips.merge(parts)
    assert _outcomes(merged)["test_real_threads"] == "passed"
    assert _outcomes(merged)["test_runs"] == "passed"
    assert [s["node"] for s in merged["collect_skips"]] == ["tests/unit/test_gone.py"]
    verdict = skips.check(merged, ["unit"], "main", allowed, root)
    assert verdict.ok, verdict.lines
    # The program takes the parts as files, in either order.
    files = []
    for n, part in enumerate(parts):
        files.append(tmp_path / f"part{n}.json")
        files[-1].write_text(json.dumps(part))
    expected = tmp_path / "e.toml"
    expected.write_text(ALLOW_SOAK + ALLOW_REST)
    for order in (files, files[::-1]):
        args = [*map(str, order), "--tiers", "unit", "--expected", str(expected), "--partial"]
        assert skips.main(args) == 0
        assert "deselected" not in capsys.readouterr().out.splitlines()[0]
    skips.main([str(files[0]), "--tiers", "unit", "--expected", str(expected), "--partial"])
    assert "deselected" in capsys.readouterr().out.splitlines()[0]


@pytest.mark.parametrize(
    "entry",
    [
        'test = "x"\nreason = "y"\n',  # no why
        'test = "x"\nwhy = "y"\n',  # a skip without the reason pytest gives
        'outcome = "failed"\nwhy = "y"\n',
        'tset = "x"\nreason = "y"\nwhy = "z"\n',
    ],
)
def test_an_entry_without_its_reason_is_refused(tmp_path: Path, entry: str) -> None:
    with pytest.raises(ValueError, match="entry 1"):
        _expected(tmp_path, "[[expected]]\n" + entry)


def test_the_committed_list_is_valid_and_every_entry_says_why() -> None:
    pytest.importorskip("tomllib")
    entries = skips.load_expected()
    assert entries
    assert all(len(e.why) > 20 for e in entries)
