"""Mutation score of the core: how many one-line changes of it the tests catch.

Usage::

    scripts/mutation                                   # every core file, in order
    scripts/mutation --files vllm_mmcache_fix/lru_eviction/cache.py
    scripts/mutation --summary                         # rewrite compat/mutation.json and stop
    scripts/mutation --files F --survivors-of C        # F's session from C's: run its
                                                       # survivors and pending mutants again

The tool is cosmic-ray (pyproject's ``mutation`` dependency group, in its own venv
``<cache>/venvs/mutation``). It changes files on disk, so it works in a copy of this
checkout's committed tree (``<cache>/mutation/<commit>/src``), never in the checkout; and
the tests that run the fix in child interpreters (the realsrc tier) see every mutant.
Resumable: each mutant's result goes into the session database
(``<cache>/mutation/<commit>/<file>.sqlite``) as it comes, and a rerun on the same commit
does only what is left. ``--jobs N`` runs N mutants at a time, each shard in its own session
copy and tree copy (``src-1``...), merged back when they end or at the next run. Runs at
``nice -n 10``. A mutant is killed when the file's tests fail (or time out); the score is
killed / (killed + survived - equivalent). Mutants inside type annotations are equivalent by
construction (every core module has ``from __future__ import annotations``): they are marked
so and never run. ``compat/mutation.json`` holds, per file, the commit the session ran on,
the counts, the score and every survivor; ``equivalent`` in that file lists the survivors
judged equivalent, each with why (kept across reruns by the survivor's operator, line and
occurrence).

``--survivors-of C`` starts a commit's session of a file from commit ``C``'s session of it,
when the file is the same in both (tests were added since): the mutants ``C``'s tests
killed count as killed, and its survivors run again with pending ones.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import commits
from harness.evidence import full_commit
from harness.installer import install_command
from harness.paths import REPO_ROOT, cache_root

RESULTS = REPO_ROOT / "compat" / "mutation.json"
TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Target:
    path: str
    tests: tuple[str, ...]
    """The tests of the quick and realsrc tiers that run this file's code."""
    pytest_args: tuple[str, ...] = ()


LAYOUTS_ONLY = (
    "-k",
    "not (0.10.1.1 or 0.10.2 or 0.11.1 or 0.11.2 or 0.12.0 or 0.14.0 or 0.14.1 or 0.15.0 "
    "or 0.15.1 or 0.16.0 or 0.17.0 or 0.17.1 or 0.18.0 or 0.18.1 or 0.19.0 or 0.19.1 or 0.20.0 "
    "or 0.20.2 or 0.21.0 or 0.22.0 or 0.22.1 or 0.25.0 or 0.25.1 or 0.26.0 or 0.27.0 or 0.27.1 "
    "or 0.28.0 or 0.29.0 or 0.30.0 or 0.31.0 or 0.32.0) and not plain",
)
"""The realsrc cases of one release per layout (``harness.pythons.LAYOUT_RELEASES``), less
those of vLLM's own class alone (``-plain``: they show that it hangs, and no mutant of the
fix changes it)."""

TARGETS: tuple[Target, ...] = (
    Target(
        "vllm_mmcache_fix/lru_eviction/cache.py",
        (  # quickest killers first: -x stops at the first failure
            "tests/realsrc/test_upgrade_in_place.py",
            "tests/realsrc/test_repair_waits.py",
            "tests/realsrc/test_plugin.py",
            "tests/realsrc/test_fix_on_releases.py",
            "tests/realsrc/test_races.py",
            "tests/realsrc/test_repair_count.py",
            "tests/realsrc/test_cache_model.py",
            "tests/realsrc/test_mm_cache_stats.py",  # the cache series it counts
            "tests/realsrc/test_read_before_insert.py",
            "tests/unit/test_catalogue.py",
            "tests/unit/test_plugin_version.py",
        ),
        LAYOUTS_ONLY,
    ),
    Target(
        "vllm_mmcache_fix/engine_liveness/progress.py",
        (  # the net-progress rule: the livelock and cascade verdicts, the remedy's timing
            "tests/unit/test_engine_progress.py",
            "tests/unit/test_engine_abort_stuck.py",
            "tests/unit/test_stall_snapshot.py",
        ),
    ),
    Target(
        "vllm_mmcache_fix/drift_guard/journal.py",
        (  # the algorithm on its own, the guard's state, then the drift simulations
            "tests/unit/test_drift_journal.py",
            "tests/unit/test_drift_state.py",
            "tests/realsrc/test_drift_requests.py",
            "tests/realsrc/test_drift.py",
            "tests/realsrc/test_drift_costs.py",
            "tests/realsrc/test_drift_model.py",
        ),
    ),
    Target(
        "vllm_mmcache_fix/engine_liveness/health.py",
        (  # /health's wrapper and verdicts, the snapshot at a verdict, the fix's reset
            "tests/unit/test_engine_health.py",
            "tests/unit/test_stall_snapshot.py",
            "tests/unit/test_fix_reset.py",
        ),
    ),
    Target(
        "vllm_mmcache_fix/tools/check.py",
        (  # the verdict's logic, VLLM_PLUGINS and entry points, the check in and out of process
            "tests/unit/test_check.py",
            "tests/unit/test_check_plugins.py",
            "tests/unit/test_sizing.py",
            "tests/unit/test_cli_inputs.py",
            "tests/unit/test_cli_convention.py",
        ),
        ("-k", "check or unexpected_failure"),
    ),
)
"""In this order: the eviction fix first; the others last (they change most often)."""


def _log(msg: str) -> None:
    print(f"[mutation] {msg}", file=sys.stderr, flush=True)


def requirements() -> list[str]:
    import tomllib

    groups = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["dependency-groups"]
    return [*groups["test"], *groups["mutation"]]


def venv() -> Path:
    """``<cache>/venvs/mutation``: the test group plus cosmic-ray, installed again when they
    change."""
    path = cache_root() / "venvs" / "mutation"
    marker = path / ".mmcache-fix-requirements"
    want = " ".join(requirements())
    if (path / "bin" / "python").exists() and marker.exists() and marker.read_text() == want:
        return path
    if not (path / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    argv, env = install_command(path / "bin" / "python", "--quiet", *requirements())
    subprocess.run(argv, env=env, check=True)
    marker.write_text(want)
    return path


def copy_tree(commit: str, dest: Path) -> Path:
    """The committed tree of ``commit`` in ``dest/src`` (made once)."""
    src = dest / "src"
    if (src / "pyproject.toml").exists():
        return src
    tmp = Path(tempfile.mkdtemp(dir=dest))
    archive = subprocess.run(
        ["git", "archive", "--format=tar", commit], cwd=REPO_ROOT, capture_output=True, check=True
    ).stdout
    with tempfile.TemporaryFile() as f:
        f.write(archive)
        f.seek(0)
        with tarfile.open(fileobj=f) as tar:
            tar.extractall(tmp)  # noqa: S202 - our own commit's tree
    tmp.rename(src)
    return src


def config(target: Target, python: Path) -> str:
    command = " ".join(
        [str(python), "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider"]
        + list(target.tests)
        + [f"'{a}'" if " " in a else a for a in target.pytest_args]
    )
    return (
        "[cosmic-ray]\n"
        f'module-path = "{target.path}"\n'
        f"timeout = {TIMEOUT_S}\n"
        "excluded-modules = []\n"
        f"test-command = {json.dumps(command)}\n\n"
        '[cosmic-ray.distributor]\nname = "local"\n'
    )


def session_file(work: Path, target: Target) -> Path:
    return work / (target.path.replace("/", "__") + ".sqlite")


def restore(commit: str, src: Path, path: str) -> None:
    """The file as committed (a run stopped mid-mutant leaves the mutant on disk)."""
    data = subprocess.run(
        ["git", "show", f"{commit}:{path}"], cwd=REPO_ROOT, capture_output=True, check=True
    ).stdout
    if (src / path).read_bytes() != data:
        _log(f"{path}: a mutant was left on disk by a stopped run; restored")
        (src / path).write_bytes(data)


ANNOTATION = (
    "a type annotation: never evaluated (the module has from __future__ import annotations)"
)

FILTER = """
import ast, sys
from cosmic_ray.work_db import WorkDB, use_db
from cosmic_ray.work_item import WorkResult, WorkerOutcome

session, path, why = sys.argv[1:4]
tree = ast.parse(open(path).read())
assert any(isinstance(n, ast.ImportFrom) and n.module == "__future__"
           and any(a.name == "annotations" for a in n.names) for n in tree.body), path
spans = []
for node in ast.walk(tree):
    found = []
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        a = node.args
        found += [node.returns] + [x.annotation for x in a.posonlyargs + a.args + a.kwonlyargs]
        found += [x.annotation for x in (a.vararg, a.kwarg) if x is not None]
    elif isinstance(node, ast.AnnAssign):
        found.append(node.annotation)
    spans += [((n.lineno, n.col_offset), (n.end_lineno, n.end_col_offset)) for n in found if n]
marked = 0
with use_db(session, WorkDB.Mode.open) as db:
    for item in list(db.pending_work_items):
        pos = tuple(item.mutations[0].start_pos)
        if any(a <= pos < b for a, b in spans):
            db.set_result(item.job_id, WorkResult(WorkerOutcome.SKIPPED, output=why))
            marked += 1
print(marked)
"""
"""Marks the mutants inside annotations as done, equivalent, before any runs."""


def seed(target: Target, work: Path, commit: str, previous: str) -> None:
    """This commit's session of ``target`` starts as ``previous``'s without its survivors'
    results (they run again); ``target`` must be the same file in both commits."""
    session = session_file(work, target)
    if session.exists():
        return
    old = session_file(cache_root() / "mutation" / previous[:12], target)
    if not old.exists():
        raise SystemExit(f"{target.path}: no session of {previous[:12]} ({old})")
    same = subprocess.run(
        ["git", "diff", "--quiet", previous, commit, "--", target.path], cwd=REPO_ROOT
    )
    if same.returncode != 0:
        raise SystemExit(f"{target.path} changed since {previous[:12]}: run its session whole")
    shutil.copyfile(old, session)
    with sqlite3.connect(session) as db:
        again = db.execute("DELETE FROM work_results WHERE test_outcome = 'SURVIVED'").rowcount
    _log(f"{target.path}: session of {previous[:12]} taken over; {again} survivors run again")


OTHER_SHARD = "left to another shard of this run"


def _shard_file(session: Path, index: int) -> Path:
    return session.with_name(f"{session.stem}.shard-{index}.sqlite")


def merge_shards(session: Path) -> int:
    """Move the results of a sharded run (finished or stopped) into ``session``; the shard
    sessions go. Returns how many came."""
    merged = 0
    for shard in sorted(session.parent.glob(f"{session.stem}.shard-*.sqlite")):
        with sqlite3.connect(session) as db:
            db.execute("ATTACH DATABASE ? AS shard", (str(shard),))
            merged += db.execute(
                "INSERT INTO work_results SELECT * FROM shard.work_results "
                "WHERE output IS NOT ? AND job_id NOT IN (SELECT job_id FROM work_results)",
                (OTHER_SHARD,),
            ).rowcount
            db.commit()
            db.execute("DETACH DATABASE shard")
        shard.unlink()
    return merged


def make_shards(session: Path, src: Path, jobs: int) -> list[tuple[Path, Path]]:
    """``jobs`` sessions and trees: the pending mutants dealt out in turn, each session
    holding the others' as done (:data:`OTHER_SHARD`); the first tree is ``src``."""
    with sqlite3.connect(session) as db:
        pending = [
            row[0]
            for row in db.execute(
                "SELECT job_id FROM work_items WHERE job_id NOT IN "
                "(SELECT job_id FROM work_results) ORDER BY job_id"
            )
        ]
    shards = []
    for index in range(jobs):
        tree = src if index == 0 else src.with_name(f"src-{index}")
        if index and not (tree / "pyproject.toml").exists():
            shutil.rmtree(tree, ignore_errors=True)
            shutil.copytree(src, tree)
        shard = _shard_file(session, index)
        shutil.copyfile(session, shard)
        others = [(OTHER_SHARD, job) for n, job in enumerate(pending) if n % jobs != index]
        with sqlite3.connect(shard) as db:
            db.executemany(
                "INSERT INTO work_results (worker_outcome, output, job_id) "
                "VALUES ('SKIPPED', ?, ?)",
                others,
            )
        shards.append((tree, shard))
    return shards


def run(target: Target, work: Path, src: Path, tool: Path, commit: str, jobs: int = 1) -> None:
    restore(commit, src, target.path)
    cfg = work / (target.path.replace("/", "__") + ".toml")
    cfg.write_text(config(target, tool / "bin" / "python"))
    session = session_file(work, target)
    env = {**os.environ, "MMCACHE_HARNESS_OFFLINE": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    cr = str(tool / "bin" / "cosmic-ray")
    if not session.exists():
        subprocess.run([cr, "init", str(cfg), str(session)], cwd=src, env=env, check=True)
    skipped = subprocess.run(
        [str(tool / "bin" / "python"), "-c", FILTER, str(session), target.path, ANNOTATION],
        cwd=src,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    _log(f"{target.path}: {skipped} more mutants inside annotations marked equivalent")
    came = merge_shards(session)
    if came:
        _log(f"{target.path}: {came} results of a stopped sharded run taken over")
    _log(f"{target.path}: mutants left are run now, {jobs} at a time (session {session})")
    shards = make_shards(session, src, jobs) if jobs > 1 else [(src, session)]
    procs = []
    try:
        for tree, db in shards:
            restore(commit, tree, target.path)
            argv = ["nice", "-n", "10", cr, "exec", str(cfg), str(db)]
            procs.append(subprocess.Popen(argv, cwd=tree, env=env))
        for proc in procs:
            proc.wait()
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
                proc.wait()
        for tree, _ in shards:
            restore(commit, tree, target.path)
        if jobs > 1:
            merge_shards(session)


def dump(session: Path, tool: Path) -> list[list[Any]]:
    """``[work item, result or None]`` per mutant of a session."""
    out = subprocess.run(
        [str(tool / "bin" / "cosmic-ray"), "dump", str(session)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def _key(mutation: dict[str, Any]) -> str:
    return (
        f"{mutation['operator_name']}@{mutation['start_pos'][0]}:{mutation['start_pos'][1]}"
        f"#{mutation['occurrence']}"
    )


def summarize(
    path: str, commit: str, rows: list[list[Any]], equivalent: dict[str, str]
) -> dict[str, Any]:
    """Counts, score and survivors of one file's session (done items only)."""
    counts = {"killed": 0, "survived": 0, "incompetent": 0, "annotation": 0, "pending": 0}
    survivors = []
    for work_item, result in rows:
        (mutation,) = work_item["mutations"]
        if result is None:
            counts["pending"] += 1
            continue
        outcome = result.get("test_outcome")
        if result.get("worker_outcome") == "skipped" and result.get("output") == ANNOTATION:
            counts["annotation"] += 1  # equivalent by construction, never run
        elif outcome == "incompetent":
            counts["incompetent"] += 1  # the mutant could not be run (e.g. not importable)
        elif outcome == "killed":
            counts["killed"] += 1
        else:
            counts["survived"] += 1
            key = _key(mutation)
            survivors.append(
                {
                    "mutant": key,
                    "line": mutation["start_pos"][0],
                    "diff": "".join(
                        line
                        for line in (result.get("diff") or "").splitlines(True)
                        if line[:1] in "+-" and not line.startswith(("+++", "---"))
                    ).strip(),
                    "equivalent": equivalent.get(key),
                }
            )
    judged = counts["killed"] + counts["survived"]
    equiv = sum(1 for s in survivors if s["equivalent"])
    score = counts["killed"] / (judged - equiv) if judged - equiv > 0 else None
    return {
        "commit": commit,
        **counts,
        "equivalent": equiv,
        "score": round(score, 4) if score is not None else None,
        "survivors": survivors,
    }


def load_results(path: Path = RESULTS) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        data = {}
    data.setdefault("files", {})
    data.setdefault("equivalent", {})
    return data


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", nargs="*", default=[t.path for t in TARGETS])
    ap.add_argument("--commit", default=None, help="default: HEAD")
    ap.add_argument("--summary", action="store_true", help="write compat/mutation.json only")
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument(
        "--survivors-of",
        metavar="COMMIT",
        default=None,
        help="start from COMMIT's sessions (files unchanged since): run only survivors and pending",
    )
    ap.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="mutants run at a time, each in its own copy of the tree (a core each)",
    )
    args = ap.parse_args(argv)
    if args.jobs < 1:
        ap.error("--jobs must be at least 1")
    # Stopped by a signal, the run still stops its mutants and merges its shards.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    commit = args.commit or commits.head()
    previous = full_commit(args.survivors_of) if args.survivors_of else None
    targets = [t for t in TARGETS if t.path in args.files]
    unknown = set(args.files) - {t.path for t in targets}
    if unknown:
        ap.error(f"not a core file: {', '.join(sorted(unknown))}")
    work = cache_root() / "mutation" / commit[:12]
    work.mkdir(parents=True, exist_ok=True)
    tool = venv()
    if not args.summary:
        src = copy_tree(commit, work)
        for target in targets:
            if previous is not None:
                seed(target, work, commit, previous)
            run(target, work, src, tool, commit, args.jobs)
    data = load_results(args.results)
    for target in targets:
        session = session_file(work, target)
        if session.exists():
            equivalent = data["equivalent"].get(target.path, {})
            data["files"][target.path] = summarize(
                target.path, commit, dump(session, tool), equivalent
            )
            got = data["files"][target.path]
            _log(
                f"{target.path}: {got['killed']} killed, {got['survived']} survived "
                f"({got['equivalent']} equivalent), {got['annotation']} in annotations, "
                f"{got['pending']} pending: score {got['score']}"
            )
    args.results.write_text(json.dumps(data, indent=1) + "\n")
    shutil.rmtree(work / "tmp", ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
