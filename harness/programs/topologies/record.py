"""``compat/topologies.json``: one row per (shape, vLLM release), each a list of runs.

A run is one shape started without and with the plugin (and, on the release where the
incident freezes EngineCore, once more with the eviction fix off: the stuck engine the
``/health`` record needs). :func:`evaluate_run` turns a run into ``pass``, ``fail`` or
``unverified`` with its reasons; :func:`summarise` turns a row's runs into the row's
result. The file is written atomically after every run, so a long session can stop at
any point and a rerun goes on where it stopped (:func:`runs_wanted`).
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

from harness.paths import REPO_ROOT
from harness.programs.matrix import version_key
from harness.programs.topologies.shapes import BY_NAME, POOLING, SHAPES, Shape
from harness.records import load_record, write_json

FILE = REPO_ROOT / "compat" / "topologies.json"
SCHEMA = 1
STATUSES = ("pass", "fail", "unverified")
POOLING_GROWTH_LIMIT_MB = 100.0
"""The API server may not grow by more than this much more with the plugin than without it
over the pooling run (1,000 requests reusing four 448 x 448 images)."""


# ----------------------------------------------------------------------------- the file


def load(path: Path = FILE) -> dict[str, Any]:
    return load_record(path, SCHEMA, "rows")


def save(data: dict[str, Any], path: Path = FILE) -> None:
    order = {shape.name: i for i, shape in enumerate(SHAPES)}
    rows = {
        name: dict(sorted(versions.items(), key=lambda kv: version_key(kv[0])))
        for name, versions in sorted(
            data["rows"].items(), key=lambda kv: order.get(kv[0], len(order))
        )
    }
    write_json(path, {"schema": SCHEMA, "rows": rows})


def add_run(
    data: dict[str, Any], run: dict[str, Any], *, drop_older_than: str | None = None
) -> dict[str, Any]:
    """Append ``run`` to its row (dropping runs made with a plugin older than
    ``drop_older_than``), re-summarise the row; the row."""
    row = data["rows"].setdefault(run["shape"], {}).setdefault(run["vllm"], {"runs": []})
    runs = [r for r in row["runs"] if not (drop_older_than and is_older(r, drop_older_than))]
    runs.append(run)
    for i, r in enumerate(runs, 1):
        r["run"] = i
    row["runs"] = runs
    row.update(summarise(BY_NAME[run["shape"]], runs))
    return row


def rejudge(data: dict[str, Any], start_failure: Any = None) -> None:
    """Judge every recorded run again with this checkout's rules (and, given
    ``start_failure``, read again from its log why a case did not start)."""
    for name, versions in data["rows"].items():
        for row in versions.values():
            for run in row["runs"]:
                for key in ("without_plugin", "with_plugin", "stuck_engine"):
                    case = run.get(key)
                    log = Path(str((case or {}).get("log") or ""))
                    if case and not case.get("started") and start_failure and log.is_file():
                        case["start_failure"] = start_failure(log)
                status, reasons, notes = evaluate_run(BY_NAME[name], run)
                run["status"], run["reasons"], run["notes"] = status, reasons, notes
            row.update(summarise(BY_NAME[name], row["runs"]))


# ----------------------------------------------------------------------------- what to run


def is_older(run: dict[str, Any], commit: str) -> bool:
    """Whether ``run`` was made with a plugin commit that is an ancestor of ``commit`` (and not
    ``commit`` itself); a commit git does not know counts as older."""
    made = str(run.get("plugin_commit") or "")
    if not made:
        return True
    if made.startswith(commit) or commit.startswith(made):
        return False
    res = subprocess.run(
        ["git", "merge-base", "--is-ancestor", made, commit],
        cwd=str(REPO_ROOT),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return res.returncode != 1  # 0: an ancestor; 128: unknown commit


def counted_runs(row: dict[str, Any] | None, refresh_older_than: str | None = None) -> int:
    """Full runs a row already has (quick runs and older plugins' runs do not count)."""
    if not row:
        return 0
    return sum(
        1
        for run in row.get("runs", [])
        if not run.get("quick")
        and run.get("status") in STATUSES
        and not (refresh_older_than and is_older(run, refresh_older_than))
    )


def runs_wanted(
    data: dict[str, Any],
    shapes: list[str],
    versions: list[str],
    repeat: dict[str, int],
    refresh_older_than: str | None = None,
    retry_unverified: bool = False,
) -> list[tuple[str, str]]:
    """(shape, version) pairs still to run, one entry per missing run, round-robin over the
    rows so a budget spreads over every shape before repeating any. A row that did not
    start is not run again unless ``retry_unverified`` (a start that failed once may be
    vLLM's intermittent failure)."""
    missing: dict[tuple[str, str], int] = {}
    for name in shapes:
        for version in versions:
            row = data["rows"].get(name, {}).get(version)
            have = counted_runs(row, refresh_older_than)
            # A shape that cannot start here is not run again and again.
            if row and row.get("status") == "unverified" and have and not retry_unverified:
                continue
            missing[(name, version)] = max(0, repeat.get(version, 1) - have)
    todo: list[tuple[str, str]] = []
    while any(missing.values()):
        for key in list(missing):
            if missing[key]:
                todo.append(key)
                missing[key] -= 1
    return todo


# ----------------------------------------------------------------------------- verdicts


def _started(case: dict[str, Any] | None) -> bool:
    return bool(case and case.get("started"))


def expected_statuses(n_new: int) -> list[Any]:
    return [400, 200] + [200] * n_new


def evaluate_run(shape: Shape, run: dict[str, Any]) -> tuple[str, list[str], list[str]]:
    """(status, reasons it is not a pass, notes) for one run."""
    without = run.get("without_plugin") or {}
    withp = run.get("with_plugin") or {}
    reasons: list[str] = []
    notes: list[str] = []
    if not _started(withp):
        why = withp.get("start_failure") or withp.get("error") or "?"
        if _started(without):
            return "fail", [f"starts without the plugin, not with it: {why}"], notes
        why_without = without.get("start_failure") or without.get("error") or "?"
        reason = f"does not start here, with or without the plugin: {why_without}"
        return "unverified", [reason], notes
    if withp.get("error"):
        reasons.append(f"with the plugin: {withp['error']}")
    statuses = withp.get("statuses") or []
    if withp.get("hung"):
        reasons.append(f"a request timed out with the plugin ({steps_text(statuses)})")
    elif statuses[:1] != [400] or any(s != 200 for s in statuses[1:]) or len(statuses) < 3:
        reasons.append(f"with the plugin: {steps_text(statuses)} (expected 400, then 200s)")
    task = "embed" if shape.entry == POOLING else "generate"
    tasks = withp.get("supported_tasks")
    if shape.is_http and tasks is not None and task not in tasks:
        reasons.append(f"served as {tasks}, not {task}")
    if not withp.get("active_in"):
        reasons.append("no process logged the plugin active")
    if without.get("active_in"):
        reasons.append(f"the plugin was not kept out of the run without it: {without['active_in']}")
    health = withp.get("health") or {}
    bad = {k: v for k, v in (health.get("statuses") or {}).items() if k != "200"}
    if bad:
        reasons.append(f"/health during the replay with the plugin: {bad}")
    if withp.get("failed_pings"):
        reasons.append(
            f"EngineCore logged {withp['failed_pings']} failed liveness calls (no answer method)"
        )
    metrics = withp.get("metrics")
    if metrics is not None:
        reasons += _metric_problems(shape, metrics, statuses)
    memory = (withp.get("pooling_memory") or {}).get("api_server_growth_mb")
    memory_without = (without.get("pooling_memory") or {}).get("api_server_growth_mb")
    if memory is not None and memory_without is not None:
        if memory - memory_without > POOLING_GROWTH_LIMIT_MB:
            reasons.append(
                f"API server RSS grew {memory:.0f} MiB with the plugin, {memory_without:.0f} "
                "MiB without, over the pooling run"
            )
    stuck = run.get("stuck_engine")
    if stuck:
        notes.append(f"stuck engine: {stuck_text(stuck)}")
    return ("fail" if reasons else "pass"), reasons, notes


def _metric_problems(shape: Shape, m: dict[str, Any], statuses: list[Any]) -> list[str]:
    out = []
    if m.get("status") != 200:
        return [f"/metrics answered {m.get('status')}"]
    if m.get("protected_api_server") != shape.api_servers:
        out.append(
            f"/metrics: protected API servers {m.get('protected_api_server')}, "
            f"{shape.api_servers} running"
        )
    if m.get("protected_engine_core") != shape.engines:
        out.append(
            f"/metrics: protected EngineCores {m.get('protected_engine_core')}, "
            f"{shape.engines} running"
        )
    rejected = sum(1 for s in statuses if s == 400)
    if m.get("rollbacks") is not None and m["rollbacks"] > rejected:
        out.append(f"/metrics: {m['rollbacks']:g} rollbacks for {rejected} rejected requests")
    return out


def stuck_text(case: dict[str, Any]) -> str:
    """What ``/health`` did while EngineCore spun (``MMCACHE_FIX_MODE=warn``)."""
    if not _started(case):
        return "did not start"
    if not case.get("hung"):
        return f"no freeze ({steps_text(case.get('statuses') or [])})"
    health = case.get("health") or {}
    after = health.get("after_hang") or {}
    first = health.get("first_non_200_after_hang_s")
    if first is None:
        return f"froze; /health after the freeze {after or 'not polled'}"
    return f"froze; /health first non-200 {first:g} s after the stuck request, then {after}"


def steps_text(statuses: list[Any]) -> str:
    """``400, 500, 7 × 200, timeout``."""
    parts: list[str] = []
    i = 0
    while i < len(statuses):
        j = i
        while j < len(statuses) and statuses[j] == statuses[i]:
            j += 1
        n = j - i
        parts.append(f"{n} × {statuses[i]}" if n > 2 else ", ".join([str(statuses[i])] * n))
        i = j
    return ", ".join(parts) or "no requests"


def summarise(shape: Shape, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A row's result from its runs: pass when every run passed, fail when any failed,
    unverified when none started."""
    full = [r for r in runs if r.get("status") in STATUSES]
    statuses = [r["status"] for r in full]
    reasons: list[str] = []
    if not full:
        status = "unverified"
        reasons = ["no run yet"]
    elif "fail" in statuses:
        status = "fail"
        for r in full:
            if r["status"] == "fail":
                reasons += [f"run {r['run']}: {x}" for x in r.get("reasons", [])]
    elif all(s == "unverified" for s in statuses):
        status = "unverified"
        reasons = list(full[-1].get("reasons", []))
    else:
        status = "pass"
    return {
        "status": status,
        "reasons": reasons,
        "runs_passed": statuses.count("pass"),
        "runs_total": len(full),
    }
