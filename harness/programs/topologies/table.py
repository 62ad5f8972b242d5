"""The tables of ``docs/topologies.md`` and the README, generated from
``compat/topologies.json``.

The documents' prose is written by hand; the part between :data:`BEGIN` and :data:`END`
of ``docs/topologies.md`` is :func:`render_block` of the file (every run's detail), the
part between :data:`SUMMARY_BEGIN` and :data:`SUMMARY_END` of the README is
:func:`render_summary_block` (one line per shape: can an operator rely on it), and
``tests/unit/test_topologies_table.py`` keeps them in step (``scripts/topologies
--table`` rewrites both).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harness.paths import REPO_ROOT
from harness.programs.matrix import version_key
from harness.programs.topologies.record import steps_text, stuck_text
from harness.programs.topologies.shapes import SHAPES, VERSIONS, Shape
from harness.records import DocBlock

DOC = REPO_ROOT / "docs" / "topologies.md"
BLOCK = DocBlock("topologies")
BEGIN, END = BLOCK.begin, BLOCK.end
README = REPO_ROOT / "README.md"
SUMMARY = DocBlock("topologies-summary")
SUMMARY_BEGIN, SUMMARY_END = SUMMARY.begin, SUMMARY.end

ROLE_NAMES = {"MainProcess": "main", "APIServer": "API server"}


def _names(entries: list[str]) -> str:
    """``["APIServer pid=1", "ApiServer_1 pid=3", "EngineCore_DP0 pid=2"]`` -> readable."""
    counts: dict[str, int] = {}
    for entry in entries:
        name = entry.split(" pid=")[0]
        name = ROLE_NAMES.get(name, name)
        counts[name] = counts.get(name, 0) + 1
    return ", ".join(f"{n} × {k}" if n > 1 else k for k, n in sorted(counts.items())) or "none"


def _statuses(case: dict[str, Any] | None) -> str:
    if not case:
        return "–"
    if not case.get("started"):
        return "no start"
    text = steps_text(case.get("statuses") or [])
    if case.get("hung"):
        spin = (case.get("engines_after") or {}).get("spinning")
        text += ", EngineCore spinning" if spin else ", EngineCore not spinning"
    return text


def _health(run: dict[str, Any]) -> str:
    withp = run.get("with_plugin") or {}
    health = withp.get("health") or {}
    if "statuses" not in health:
        return "none (offline)" if "check" in health else "–"
    statuses = health.get("statuses") or {}
    ok = statuses.get("200", 0)
    other = {k: v for k, v in statuses.items() if k != "200"}
    text = f"{ok}/{health.get('polls', 0)} × 200"
    if other:
        text += f" ({', '.join(f'{v} × {k}' for k, v in other.items())})"
    stuck = run.get("stuck_engine")
    if stuck:
        text += f"; stuck engine: {stuck_text(stuck)}"
    return text


def _metrics(case: dict[str, Any] | None, shape: Shape) -> str:
    m = (case or {}).get("metrics")
    if not m:
        return "–"
    if m.get("status") != 200:
        return f"/metrics {m.get('status')}"

    def num(value: Any) -> str:
        return "missing" if value is None else f"{value:g}"

    return (
        f"protected API servers {num(m.get('protected_api_server'))}/{shape.api_servers}, "
        f"EngineCores {num(m.get('protected_engine_core'))}/{shape.engines}; "
        f"rollbacks {num(m.get('rollbacks'))}"
    )


def _memory(case: dict[str, Any] | None) -> str:
    case = case or {}
    pool = case.get("pooling_memory")
    if pool:
        return (
            f"API server {pool['api_server_rss_mb'][0]:.0f} → {pool['api_server_rss_mb'][-1]:.0f}"
            f" MiB over {pool['requests']} requests"
        )
    if case.get("rss_mb_before") is None:
        return "–"
    return f"{case['rss_mb_before']:.0f} → {case.get('rss_mb_after', 0):.0f} MiB"


def render_table(data: dict[str, Any]) -> str:
    rows = [
        "| shape | vLLM | processes with the plugin active (stall sentinel in) | without the "
        "plugin | with the plugin | /health with the plugin | /metrics with the plugin "
        "| memory with the plugin, before → after | runs passed | result |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    recorded = data.get("rows", {})
    for shape in SHAPES:
        versions = recorded.get(shape.name, {})
        for version in sorted(set(VERSIONS) | set(versions), key=version_key):
            row = versions.get(version)
            if not row or not row.get("runs"):
                rows.append(
                    f"| {shape.title} | {version} | – | – | – | – | – | – | 0 | not run yet |"
                )
                continue
            last = row["runs"][-1]
            withp = last.get("with_plugin") or {}
            active = _names(withp.get("active_in") or [])
            sentinel = _names(withp.get("sentinel_in") or [])
            result = row["status"]
            if row.get("reasons"):
                result += ": " + "; ".join(row["reasons"])
            result = result.replace("|", "/").replace("\n", " ")[:400]
            rows.append(
                f"| {shape.title} | {version} | {active} ({sentinel}) "
                f"| {_statuses(last.get('without_plugin'))} | {_statuses(withp)} "
                f"| {_health(last)} | {_metrics(withp, shape)} | {_memory(withp)} "
                f"| {row.get('runs_passed', 0)}/{row.get('runs_total', 0)} | {result} |"
            )
    return "\n".join(rows)


def _verdict(row: dict[str, Any] | None) -> str:
    """One cell of the README's summary: what an operator can take from the runs."""
    if not row or not row.get("runs"):
        return "not run yet"
    passed, total = row.get("runs_passed", 0), row.get("runs_total", 0)
    status = row.get("status")
    if status == "pass":
        no_start = sum(1 for r in row["runs"] if r.get("status") == "unverified")
        extra = f"; {no_start} did not start, with or without the plugin" if no_start else ""
        return f"**protected** ({passed}/{total} runs{extra})"
    if status == "unverified":
        cause = "; ".join(row.get("reasons") or [])
        cause = cause.split(": ", 1)[-1] if "does not start here" in cause else cause
        return f"unverified: vLLM does not start it here ({cause[:140]})".replace("|", "/")
    return f"**failed** ({passed}/{total} runs passed; see docs/topologies.md)"


def render_summary(data: dict[str, Any]) -> str:
    recorded = data.get("rows", {})
    versions = sorted(VERSIONS, key=version_key)
    rows = [
        "| how vLLM runs | " + " | ".join(f"vLLM {v}" for v in versions) + " |",
        "|---|" + "---|" * len(versions),
    ]
    for shape in SHAPES:
        cells = [_verdict(recorded.get(shape.name, {}).get(v)) for v in versions]
        rows.append(f"| {shape.title} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def render_summary_block(data: dict[str, Any]) -> str:
    return SUMMARY.wrap(render_summary(data))


summary_block = SUMMARY.find


def render_notes() -> str:
    """Per shape, one line: what the harness does beyond its defaults, or what limits it."""
    lines = ["Shapes started beyond the harness's defaults, or limited here:", ""]
    for shape in SHAPES:
        if shape.note:
            lines.append(f"- {shape.title}: {shape.note}.")
    return "\n".join(lines)


def render_block(data: dict[str, Any]) -> str:
    return BLOCK.wrap(f"{render_table(data)}\n\n{render_notes()}")


doc_block = BLOCK.find


def rewrite_doc(data: dict[str, Any], path: Path = DOC, readme: Path = README) -> bool:
    """Rewrite both generated tables; True when either changed."""
    table = BLOCK.rewrite(path, f"{render_table(data)}\n\n{render_notes()}")
    summary = SUMMARY.rewrite(readme, render_summary(data))
    return table or summary
