"""``python -m harness COMMAND [ARGS]``: one of the harness's programs, by command name.

The commands in ``scripts/`` run this from the repository root (which ``-m`` puts on
``sys.path``) after noting the caller's directory in ``$MMCACHE_HARNESS_CALLER_CWD``; the
program then runs in that directory, so relative paths in its arguments mean what the
caller meant.
"""

from __future__ import annotations

import importlib
import os
import sys

CALLER_CWD_ENV = "MMCACHE_HARNESS_CALLER_CWD"

COMMANDS: dict[str, str] = {
    "make-venv": "harness.venvs",
    "fetch-sources": "harness.sources",
    "build-tiny-model": "harness.tiny_models",
    "e2e": "harness.programs.incident",
    "demo": "harness.programs.demo",
    "drift-run": "harness.programs.drift_run",
    "soak": "harness.programs.soak",
    "concurrent": "harness.programs.concurrent",
    "bench-concurrent": "harness.programs.bench.concurrent",
    "bench-cache": "harness.programs.bench.cache",
    "bench-cache-value": "harness.programs.bench.cache_value",
    "bench-register": "harness.programs.bench.register",
    "drift-bench": "harness.programs.bench.drift",
    "race-probe": "harness.programs.bench.race_probe",
    "worst-cases": "harness.programs.bench.worst_cases",
    "make-patches": "harness.programs.make_patches",
    "new-release": "harness.programs.new_release",
    "ascend-release": "harness.programs.ascend_release",
    "apply-patch": "harness.programs.apply_patch",
    "unit-pythons": "harness.pythons",
    "health-rtt": "harness.programs.health",
    "health-load": "harness.programs.health_load",
    "false-verdicts": "harness.programs.false_verdicts",
    "sentinel-cost": "harness.programs.sentinel_cost",
    "matrix": "harness.programs.matrix",
    "e2e-versions": "harness.venvs:print_e2e_versions",
    "pooling-memory": "harness.programs.pooling_memory",
    "topologies": "harness.programs.topologies.cli",
    "skip-check": "harness.skips",
    "mutation": "harness.programs.mutation",
    "evidence": "harness.evidence",
    "cache-figures": "harness.programs.cache_figures",
}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] not in COMMANDS:
        names = "\n".join(f"  {name:<18} {COMMANDS[name]}" for name in COMMANDS)
        print(f"usage: python -m harness COMMAND [ARGS]\ncommands:\n{names}", file=sys.stderr)
        return 2
    name, rest = args[0], args[1:]
    caller = os.environ.pop(CALLER_CWD_ENV, "")
    if caller:
        os.chdir(caller)
    module_name, _, function = COMMANDS[name].partition(":")
    module = importlib.import_module(module_name)
    sys.argv = [f"scripts/{name}", *rest]
    return int(getattr(module, function or "main")(rest) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
