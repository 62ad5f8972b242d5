"""``python -m harness COMMAND [ARGS]``: one of the harness's programs, by command name.

The commands in ``scripts/`` run this from the repository root (which ``-m`` puts on
``sys.path``) after noting the caller's directory in ``$MMCACHE_FIX_CALLER_CWD``; the
program then runs in that directory, so relative paths in its arguments mean what the
caller meant.
"""

from __future__ import annotations

import importlib
import os
import sys

CALLER_CWD_ENV = "MMCACHE_FIX_CALLER_CWD"

COMMANDS: dict[str, str] = {
    "make-venv": "harness.venvs",
    "fetch-sources": "harness.sources",
    "build-tiny-model": "harness.tiny_models",
    "e2e": "harness.incident",
    "demo": "harness.demo",
    "drift-run": "harness.drift_run",
    "soak": "harness.soak",
    "concurrent": "harness.concurrent",
    "bench-concurrent": "harness.bench.concurrent",
    "bench-cache": "harness.bench.cache",
    "bench-cache-value": "harness.bench.cache_value",
    "bench-register": "harness.bench.register",
    "drift-bench": "harness.bench.drift",
    "race-probe": "harness.bench.race_probe",
    "worst-cases": "harness.bench.worst_cases",
    "make-patches": "harness.make_patches",
    "new-release": "harness.new_release",
    "ascend-release": "harness.ascend_release",
    "apply-patch": "harness.apply_patch",
    "unit-pythons": "harness.pythons",
    "health-rtt": "harness.health",
    "health-load": "harness.health_load",
    "sentinel-cost": "harness.sentinel_cost",
    "matrix": "harness.matrix",
    "e2e-versions": "harness.venvs:print_e2e_versions",
    "pooling-memory": "harness.pooling_memory",
    "topologies": "harness.topologies.cli",
    "skip-check": "harness.skips",
    "mutation": "harness.mutation",
    "evidence": "harness.evidence",
    "cache-figures": "harness.cache_figures",
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
