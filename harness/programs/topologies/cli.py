"""``scripts/topologies``: every way operators run vLLM, on real servers, recorded.

Usage::

    scripts/topologies                          every shape, 0.23.0 once, 0.32.0 three times
    scripts/topologies --only tp2 --repeat 5    five runs of one shape (repeatable --only)
    scripts/topologies --versions 0.32.0        one release
    scripts/topologies --budget-minutes 60      start no run that does not fit
    scripts/topologies --refresh-older-than C   redo runs made with a plugin older than C
    scripts/topologies --only tp2 --repeat 3 --retry-unverified   try a shape that did not start
    scripts/topologies --table                  rewrite docs/topologies.md from the file
    scripts/topologies --rotate 1 --quick --with-plugin-only --no-record --json out.json
                                                CI: one shape by commit, with the plugin

A run (one shape, one release: without the plugin, with it, and on 0.23.0 a stuck
engine) is written to ``compat/topologies.json`` as soon as it ends, and the table with
it. Runs already recorded count towards ``--repeat`` whatever plugin commit made them,
unless ``--refresh-older-than`` says otherwise; quick runs never count.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from harness import budget
from harness.programs.topologies import record, table
from harness.programs.topologies.shapes import (
    CI_FORK_SHAPE,
    REPEAT_VERSION,
    REPEATS,
    SHAPES,
    VERSIONS,
    shape,
)


def rotating(n: int, commit: str, data: dict[str, Any], version: str) -> list[str]:
    """``n`` shapes chosen by the commit among those passing on ``version`` that need no
    extra distribution and are not :data:`CI_FORK_SHAPE` (which CI runs every time)."""
    rows = data.get("rows", {})
    pool = [
        s.name
        for s in SHAPES
        if not s.needs
        and s.name != CI_FORK_SHAPE
        and rows.get(s.name, {}).get(version, {}).get("status") == "pass"
    ]
    if not pool:
        return []
    seed = int(hashlib.sha256(commit.encode()).hexdigest(), 16)
    chosen: list[str] = []
    while len(chosen) < min(n, len(pool)):
        pick = pool[seed % len(pool)]
        seed //= len(pool)
        if pick in chosen:
            seed += 1
        else:
            chosen.append(pick)
    return chosen


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", action="append", default=None, metavar="SHAPE")
    ap.add_argument("--versions", nargs="+", default=None, metavar="VERSION")
    ap.add_argument(
        "--repeat",
        type=int,
        default=None,
        help=f"runs wanted per shape and release (default {REPEATS} on {REPEAT_VERSION}, "
        "1 elsewhere)",
    )
    budget.add_options(
        ap,
        "--run-minutes",
        8.0,
        "expected minutes of one run (no run starts unless this fits the budget)",
    )
    ap.add_argument("--refresh-older-than", default=None, metavar="COMMIT")
    ap.add_argument(
        "--retry-unverified",
        action="store_true",
        help="run shapes that did not start again, up to --repeat runs",
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="no stuck-engine case, 200 pooling "
        "requests; quick runs are kept apart and never count as done",
    )
    ap.add_argument(
        "--with-plugin-only",
        action="store_true",
        help="with --quick: only the case with the plugin (the case without it is vLLM's own "
        "behaviour, which the recorded runs show)",
    )
    ap.add_argument("--rotate", type=int, default=0, help="N shapes chosen by the commit")
    ap.add_argument("--no-record", action="store_true", help="leave compat/topologies.json alone")
    ap.add_argument("--json", type=Path, default=None, help="also write this invocation's runs")
    ap.add_argument("--file", type=Path, default=record.FILE)
    ap.add_argument("--table", action="store_true", help="rewrite docs/topologies.md and stop")
    ap.add_argument("--images", type=int, default=20, help="new images after the reused one")
    ap.add_argument("--timeout", type=float, default=20.0, help="per-request timeout (s)")
    ap.add_argument("--pooling-requests", type=int, default=1000)
    ap.add_argument("--lock-timeout", type=float, default=None)
    ap.add_argument("--list", action="store_true", help="print the shapes and stop")
    ap.add_argument(
        "--rejudge",
        action="store_true",
        help="judge the recorded runs again with this checkout's rules, rewrite the table, stop",
    )
    args = ap.parse_args(argv)
    if args.with_plugin_only and not args.quick:
        ap.error("--with-plugin-only needs --quick (a recorded run has both cases)")

    if args.list:
        for s in SHAPES:
            print(f"{s.name:<20} {s.title}")
        return 0
    data = record.load(args.file)
    if args.rejudge:
        from harness.programs.topologies.http_case import start_failure

        record.rejudge(data, start_failure)
        record.save(data, args.file)
    if args.table or args.rejudge:
        changed = table.rewrite_doc(data)
        print("docs/topologies.md table " + ("rewritten" if changed else "unchanged"))
        return 0

    from harness import commits, lock, tiny_models

    # Many short cases, each taking the lock anew, compete with holders that give it back
    # and take it again within milliseconds: look more often than every half second.
    lock.POLL_SECONDS = 0.01
    from harness.programs.topologies.run import RunOptions, _log, run_shape
    from harness.venvs import build_wheel, complete_venv

    commit = commits.package()
    if commits.package_dirty():
        _log("vllm_mmcache_fix has uncommitted changes: records name the last commit")
    versions = list(args.versions or VERSIONS)
    if args.rotate:
        names = rotating(args.rotate, commit, data, versions[-1])
        todo = [(name, versions[-1]) for name in names]
    else:
        names = [shape(n).name for n in (args.only or [s.name for s in SHAPES])]
        repeat = {v: args.repeat or (REPEATS if v == REPEAT_VERSION else 1) for v in versions}
        if args.quick:
            todo = [(n, v) for n in names for v in versions]
        else:
            todo = record.runs_wanted(
                data,
                names,
                versions,
                repeat,
                args.refresh_older_than,
                retry_unverified=args.retry_unverified,
            )
    _log(f"plugin commit {commit[:12]}; runs to do: {len(todo)}: {todo}")
    options = RunOptions.from_args(args)
    time_left = budget.Budget(args.budget_minutes)
    done: list[dict[str, Any]] = []
    failures = 0
    with tempfile.TemporaryDirectory(prefix="topologies-wheel-") as tmp:
        wheel = build_wheel(Path(tmp))
        for name, version in todo:
            if not time_left.fits(args.run_minutes):
                _log(f"time budget spent: stopping before {name} {version}")
                break
            venv = complete_venv(version)
            model = tiny_models.ensure_model(venv)
            run = run_shape(
                shape(name), version, options, venv=venv, model=model, wheel=wheel, commit=commit
            )
            done.append(run)
            failures += run["status"] == "fail"
            _log(f"{name} {version}: {run['status']} {'; '.join(run['reasons'])}")
            print(json.dumps({k: run[k] for k in ("shape", "vllm", "status", "reasons")}))
            if not args.no_record and not args.quick:
                data = record.load(args.file)
                record.add_run(data, run, drop_older_than=args.refresh_older_than)
                record.save(data, args.file)
                table.rewrite_doc(data)
            if args.json:
                args.json.write_text(json.dumps(done, indent=1) + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
