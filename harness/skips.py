"""Skip accounting: no tier can vanish as skips.

``scripts/run-tests`` runs each tier with ``$MMCACHE_HARNESS_OUTCOMES`` set (the pytest plugin
:mod:`harness.outcomes` writes every test's outcome there) and then::

    python -m harness skip-check --lane main --tiers unit OUTCOMES.json [MORE.json ...]

which fails when a test of those tiers was skipped or deselected and no entry of
``tests/expected-skips.toml`` allows it, when a test module of a tier ran nothing, or when
a tier ran no test at all. A skip is any of pytest's: ``pytest.skip``, ``skipif``,
``importorskip``, an empty parameter set ("got empty parameter set"), a module skipped
whole. An entry of the list::

    [[expected]]
    test = "tests/soak/test_soak*.py::*"   # a glob over node ids (default: every test)
    reason = "the other soak's turn"        # text pytest's skip reason must contain
    outcome = "skipped"                     # or "deselected" (default: skipped)
    marker = "realtime"                     # only tests with this marker (optional)
    lanes = ["py3.9", "py3.13"]             # only in these lanes (optional)
    why = "CI runs one of the two soaks per commit"   # required: why this is acceptable

Several files are one run split in parts (``-m realtime``, then ``-m "not realtime"``): a test
one part deselected and another ran counts as run (:func:`merge`). ``--partial`` (a run with
pytest arguments, e.g. ``-k``) reports without failing.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.paths import REPO_ROOT

EXPECTED_FILE = REPO_ROOT / "tests" / "expected-skips.toml"
NOT_RUN = ("skipped", "deselected")


@dataclass(frozen=True)
class Expected:
    why: str
    test: str = "*"
    reason: str = ""
    outcome: str = "skipped"
    marker: str = ""
    lanes: tuple[str, ...] = ()

    def allows(self, node: str, outcome: str, reason: str, markers: list[str], lane: str) -> bool:
        return (
            outcome == self.outcome
            and fnmatch.fnmatchcase(node, self.test)
            and self.reason in reason
            and (not self.marker or self.marker in markers)
            and (not self.lanes or lane in self.lanes)
        )


def load_expected(path: Path = EXPECTED_FILE) -> list[Expected]:
    import tomllib

    entries = tomllib.loads(path.read_text()).get("expected", [])
    out: list[Expected] = []
    for i, raw in enumerate(entries):
        where = f"{path.name} entry {i + 1}"
        if not str(raw.get("why", "")).strip():
            raise ValueError(f"{where}: says no why")
        unknown = set(raw) - {"why", "test", "reason", "outcome", "marker", "lanes"}
        if unknown:
            raise ValueError(f"{where}: unknown keys {sorted(unknown)}")
        if raw.get("outcome", "skipped") not in NOT_RUN:
            raise ValueError(f"{where}: outcome must be one of {NOT_RUN}")
        if raw.get("outcome", "skipped") == "skipped" and not raw.get("reason"):
            raise ValueError(f"{where}: a skip names the reason pytest reports")
        out.append(Expected(**{**raw, "lanes": tuple(raw.get("lanes", ()))}))
    return out


@dataclass
class Verdict:
    ok: bool
    lines: list[str]


def check(
    doc: dict[str, Any],
    tiers: list[str],
    lane: str,
    expected: list[Expected],
    tests_root: Path = REPO_ROOT / "tests",
    modules: list[str] | None = None,
) -> Verdict:
    """Whether the run of ``tiers`` recorded in ``doc`` ran every test it must: every
    module of the tiers (``modules``: these only, a chosen subset) and every test of
    those it collected."""
    items: list[dict[str, Any]] = [
        i for i in doc.get("items", []) if any(i["node"].startswith(f"tests/{t}/") for t in tiers)
    ]
    for skip in doc.get("collect_skips", []):
        if any(skip["node"].startswith(f"tests/{t}/") for t in tiers):
            items.append({"node": skip["node"], "outcome": "skipped", "reason": skip["reason"]})
    problems: list[str] = []
    used: Counter[int] = Counter()
    for item in items:
        if item["outcome"] not in NOT_RUN:
            continue
        reason = str(item.get("reason", ""))
        markers = list(item.get("markers", []))
        hits = [
            n
            for n, e in enumerate(expected)
            if e.allows(item["node"], item["outcome"], reason, markers, lane)
        ]
        if hits:
            used[hits[0]] += 1
        else:
            why = f": {reason}" if reason else ""
            problems.append(f"{item['outcome']} but required: {item['node']}{why}")
    counts = Counter(i["outcome"] for i in items)
    for tier in tiers:
        tier_modules = sorted(
            p.relative_to(tests_root.parent).as_posix()
            for p in (tests_root / tier).glob("test_*.py")
        )
        if not tier_modules:
            problems.append(f"tier {tier}: no test modules under tests/{tier}")
        for module in tier_modules:
            if modules is not None and module not in modules:
                continue
            if not any(i["node"].split("::")[0] == module for i in items):
                problems.append(f"collected nothing: {module}")
        if not any(
            i["node"].startswith(f"tests/{tier}/") and i["outcome"] not in NOT_RUN for i in items
        ):
            problems.append(f"tier {tier}: not a single test ran")
    summary = ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
    lines = [f"skip accounting, {lane} lane, tiers {' '.join(tiers)}: {summary or 'nothing'}"]
    for n, k in sorted(used.items()):
        e = expected[n]
        lines.append(f"  expected: {k} {e.outcome} {e.test} ({e.why})")
    lines += [f"  {p}" for p in problems]
    return Verdict(not problems, lines)


def merge(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """One run's outcomes from its parts: per test, the outcome of the part that ran it (a
    part that deselected it does not count against another that ran it); skips at
    collection once each."""
    items: dict[str, dict[str, Any]] = {}
    for doc in docs:
        for item in doc.get("items", []):
            seen = items.get(item["node"])
            if seen is None or (seen["outcome"] == "deselected" != item["outcome"]):
                items[item["node"]] = item
    skips: dict[str, dict[str, Any]] = {}
    for doc in docs:
        for skip in doc.get("collect_skips", []):
            skips.setdefault(skip["node"], skip)
    return {"items": [items[n] for n in sorted(items)], "collect_skips": list(skips.values())}


def compact(lines: list[str]) -> list[str]:
    """A chosen subset's report: what the choice left out as counts, every skip in full."""
    chosen = ("  deselected but required", "  collected nothing")
    left_out = [line for line in lines if line.startswith(chosen)]
    kept = [line for line in lines if not line.startswith(chosen)]
    return kept + (
        [f"  {len(left_out)} tests or modules left out by the choice"] if left_out else []
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "outcomes", type=Path, nargs="+", help="the file(s) $MMCACHE_HARNESS_OUTCOMES named"
    )
    ap.add_argument("--tiers", nargs="+", required=True)
    ap.add_argument("--lane", default="main", help="main, or pyX.Y for the other Pythons")
    ap.add_argument("--expected", type=Path, default=EXPECTED_FILE)
    ap.add_argument("--partial", action="store_true", help="report only (a chosen subset ran)")
    args = ap.parse_args(argv)
    try:
        doc = merge([json.loads(path.read_text()) for path in args.outcomes])
    except (OSError, ValueError) as exc:
        print(f"skip accounting: no outcomes from the run ({exc}): the tier did not run")
        return 0 if args.partial else 1
    verdict = check(doc, args.tiers, args.lane, load_expected(args.expected))
    print("\n".join(compact(verdict.lines) if args.partial else verdict.lines))
    if verdict.ok:
        return 0
    if args.partial:
        print("  (a chosen subset ran: reported, not failed)")
        return 0
    print(
        "  a required test did not run: fix its cause, or add it to tests/expected-skips.toml "
        "with why"
    )
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
