"""The age of the committed evidence: which plugin commit each record ran, when, and how
far the code it proves has moved since.

Every record under ``compat/`` names the plugin commit it ran (``plugin_commit``, or
``commit`` in ``pooling_memory.json``) and, where the writer kept one, its date. A record
proves some of the plugin's code (:data:`PROVES`); how far behind it is: the commits that
changed that code after the record's commit, and the days between the record and the last
of them. ``tests/unit/test_evidence_age.py`` fails when the newest record of a release is
older than the last change to the code it proves by more than :data:`MAX_AGE_DAYS`, and
``docs/evidence.md`` shows each release's newest record with its date and commit
(``python -m harness evidence --write``).
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from harness.paths import REPO_ROOT
from harness.records import DocBlock

COMPAT = REPO_ROOT / "compat"
DOC = REPO_ROOT / "docs" / "evidence.md"
BLOCK = DocBlock("evidence-age")
BEGIN, END = BLOCK.begin, BLOCK.end

PROVES: dict[str, tuple[str, ...]] = {
    "matrix.json": ("vllm_mmcache_fix/lru_eviction", "vllm_mmcache_fix/drift_guard"),
    "topologies.json": ("vllm_mmcache_fix",),
    "health-load.json": ("vllm_mmcache_fix/engine_liveness", "vllm_mmcache_fix/stall_sentinel"),
    "pooling_memory.json": ("vllm_mmcache_fix/drift_guard",),
    "false-verdicts.json": ("vllm_mmcache_fix/engine_liveness",),
}
"""The code each file's records prove: the release matrix the eviction fix and the drift
guard; the deployment shapes the whole plugin (it loads in every process); health-load
``/health`` and the stall sentinel; the pooling memory run the drift guard's records; the
false-verdict matrix the liveness check."""

MAX_AGE_DAYS = 7
"""How much older than the last change to the code it proves a release's newest record
may be, in days.

Why a week, and why days rather than commits: a full re-run is hours of servers (the
release matrix about 15 minutes a release, six hours for all; the deployment shapes about
as long), one overnight run of the machine. A week asks for that run once per week in
which the proven code changed, and never lets a record fall further behind unnoticed.
A count of commits would measure how the work was cut into commits, not how long the
code has gone unproven (one change merged as 15 small commits is one change)."""


@dataclass(frozen=True)
class Record:
    file: str
    key: str
    release: str
    commit: str | None
    date: str | None


def _date(value: Any) -> str | None:
    if not isinstance(value, str) or not value:
        return None
    return value.replace("T", " ").removesuffix("Z")[:16]


def records(compat: Path = COMPAT) -> Iterator[Record]:
    """Every record under ``compat/`` with its release, commit and date (``None``: not
    recorded by its writer at the time)."""
    matrix = json.loads((compat / "matrix.json").read_text())
    for version, rec in matrix["releases"].items():
        yield Record(
            "matrix.json", version, version, rec.get("plugin_commit"), _date(rec.get("date"))
        )
    topo = json.loads((compat / "topologies.json").read_text())
    for shape, rows in topo["rows"].items():
        for version, row in rows.items():
            for run in row.get("runs", []):
                yield Record(
                    "topologies.json",
                    f"{shape} {version}",
                    version,
                    run.get("plugin_commit"),
                    _date(run.get("date")),
                )
    health = json.loads((compat / "health-load.json").read_text())
    for key, run in health["runs"].items():
        yield Record(
            "health-load.json",
            key,
            key.split()[0],
            run.get("plugin_commit"),
            _date(run.get("date") or run.get("finished_at")),
        )
    verdicts = json.loads((compat / "false-verdicts.json").read_text())
    for key, rec in verdicts["cases"].items():
        yield Record(
            "false-verdicts.json",
            key,
            key.split("/")[0],
            rec.get("plugin_commit"),
            _date(rec.get("when")),
        )
    pooling = json.loads((compat / "pooling_memory.json").read_text())
    for key, entry in pooling.items():
        for state, run in entry.items():
            yield Record(
                "pooling_memory.json",
                f"{key} {state}",
                key.split("/")[0],
                run.get("commit"),
                _date(run.get("date")),
            )


@functools.cache
def _git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()


def full_commit(commit: str) -> str:
    return _git("rev-parse", "--verify", f"{commit}^{{commit}}")


def age(commit: str, paths: tuple[str, ...]) -> int:
    """Commits on HEAD's history after ``commit`` that changed ``paths``."""
    return int(_git("rev-list", "--count", f"{full_commit(commit)}..HEAD", "--", *paths))


def last_change(commit: str, paths: tuple[str, ...]) -> datetime | None:
    """When the last commit after ``commit`` that changed ``paths`` was made (None: none)."""
    stamp = _git("log", "-1", "--format=%cI", f"{full_commit(commit)}..HEAD", "--", *paths)
    return datetime.fromisoformat(stamp) if stamp else None


def ran_at(rec: Record) -> datetime:
    """When ``rec`` ran: its own date (UTC), else the date of its plugin commit."""
    if rec.date:
        return datetime.strptime(rec.date, "%Y-%m-%d %H:%M").replace(tzinfo=timezone.utc)
    return datetime.fromisoformat(_git("show", "-s", "--format=%cI", full_commit(str(rec.commit))))


def days_behind(rec: Record) -> float:
    """Days between ``rec`` and the last later change to the code it proves (0: none)."""
    changed = last_change(str(rec.commit), PROVES[rec.file])
    if changed is None:
        return 0.0
    return max(0.0, (changed - ran_at(rec)).total_seconds() / 86400)


def newest(recs: list[Record]) -> dict[tuple[str, str], Record]:
    """The newest record of each (file, release): the one with the fewest commits behind."""
    out: dict[tuple[str, str], Record] = {}
    for rec in recs:
        if rec.commit is None:
            continue
        k = (rec.file, rec.release)
        best = out.get(k)
        paths = PROVES[rec.file]
        if best is None or age(rec.commit, paths) < age(str(best.commit), paths):
            out[k] = rec
    return out


def stale(recs: list[Record], bound: float = MAX_AGE_DAYS) -> list[str]:
    """One line per (file, release) whose newest record is more than ``bound`` days older
    than the last change to the code it proves."""
    return [
        f"{file} {release}: newest record ran {rec.commit and rec.commit[:10]}, "
        f"{days_behind(rec):.1f} days before the last of the "
        f"{age(str(rec.commit), PROVES[file])} later commits of {', '.join(PROVES[file])} "
        f"(at most {bound:g} days)"
        for (file, release), rec in sorted(newest(recs).items())
        if days_behind(rec) > bound
    ]


def render(recs: list[Record]) -> str:
    """The docs block: per evidence file and release, the newest record's date and commit."""
    return BLOCK.wrap(render_body(recs))


def render_body(recs: list[Record]) -> str:
    lines = [
        "<!-- generated by `python -m harness evidence --write` from compat/*.json -->",
        "| evidence | vLLM | records | newest record's date | its plugin commit |",
        "|---|---|---|---|---|",
    ]
    best = newest(recs)
    counts: dict[tuple[str, str], int] = {}
    for rec in recs:
        counts[(rec.file, rec.release)] = counts.get((rec.file, rec.release), 0) + 1
    for file, release in sorted(counts, key=lambda k: (k[0], _vkey(k[1]))):
        found: Record | None = best.get((file, release))
        date = (found.date if found else None) or "not recorded"
        commit = f"`{found.commit[:10]}`" if found and found.commit else "not recorded"
        lines.append(
            f"| `compat/{file}` | {release} | {counts[(file, release)]} | {date} | {commit} |"
        )
    return "\n".join(lines)


def _vkey(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version))


doc_block = BLOCK.find


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="rewrite the table in docs/evidence.md")
    args = ap.parse_args(argv)
    recs = list(records())
    if args.write:
        BLOCK.rewrite(DOC, render_body(recs))
        return 0
    for (file, release), rec in sorted(newest(recs).items()):
        print(
            f"{file:<20} {release:<9} {rec.date or '?':<17} {str(rec.commit)[:10]} "
            f"{age(str(rec.commit), PROVES[file])} commits, {days_behind(rec):.1f} days behind"
        )
    problems = stale(recs)
    print(
        "\n".join(problems)
        or f"every release's newest record within {MAX_AGE_DAYS} days of the code it proves"
    )
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
