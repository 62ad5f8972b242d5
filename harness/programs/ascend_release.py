"""What a vllm-ascend release means for this plugin: ``scripts/ascend-release VERSION``.

vllm-ascend's newest releases are on the package index as source archives only (no
x86_64 wheel after 0.26.0rc1), and building one needs Ascend's toolkit. This reads the
archive without building it: ``pip download --no-deps --no-build-isolation --no-clean``
fetches and unpacks it, then stops at the metadata step (which imports the toolkit); the
unpacked tree is kept under ``<cache root>/ascend/vllm-ascend-X``. A wheel, when the index
has one for x86_64, is read instead.

From that tree it records:

* the vLLM release it builds on (its ``Dockerfile``'s ``VLLM_TAG``);
* its entry points (``setup.py``): the names the ``VLLM_PLUGINS`` rule must list;
* where its code names what this plugin touches (``vllm_layout``): ``EngineCoreProc`` and
  its busy loop, the multimodal cache modules and classes, ``AsyncLLM.check_health``;
  and which of its classes derive from ``EngineCoreProc`` and override a busy-loop method
  the ``/health`` engine check hooks.

``--record`` adds the result to ``compat/ascend.json`` (newest first).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness.paths import REPO_ROOT, cache_root
from vllm_mmcache_fix import vllm_layout

RECORD = REPO_ROOT / "compat" / "ascend.json"
KEEP = ("setup.py", "Dockerfile", "PKG-INFO")


def tree_dir(version: str) -> Path:
    return cache_root() / "ascend" / f"vllm-ascend-{version}"


def fetch(version: str) -> Path:
    """The unpacked source archive of vllm-ascend ``version`` (kept while complete)."""
    final = tree_dir(version)
    if (final / "PKG-INFO").is_file():
        return final
    with tempfile.TemporaryDirectory(prefix="mmcache-ascend-") as tmp:
        env = dict(os.environ, TMPDIR=tmp)
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--no-build-isolation",
            "--no-clean", "--no-binary=:all:", "--disable-pip-version-check", "-q",
            "-d", str(Path(tmp) / "out"), f"vllm-ascend=={version}",
        ]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
        found = [
            p.parent
            for p in Path(tmp).glob("pip-download-*/*/PKG-INFO")
            if re.search(rf"^Version: {re.escape(version)}$", p.read_text(), re.M)
        ]
        if not found:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            raise RuntimeError(f"pip did not unpack vllm-ascend {version}: {' | '.join(tail)}")
        src = found[0]
        staged = Path(tempfile.mkdtemp(prefix=".staged-", dir=_parent(final)))
        for name in KEEP:
            if (src / name).is_file():
                shutil.copy2(src / name, staged / name)
        shutil.copytree(src / "vllm_ascend", staged / "vllm_ascend", ignore=_only_python)
        shutil.move(str(staged / "PKG-INFO"), str(staged / "PKG-INFO.tmp"))
        if final.exists():
            shutil.rmtree(final)
        staged.rename(final)
        (final / "PKG-INFO.tmp").rename(final / "PKG-INFO")  # the completeness marker
    return final


def _parent(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    return path.parent


def _only_python(directory: str, names: list[str]) -> list[str]:
    return [n for n in names if not n.endswith(".py") and not (Path(directory) / n).is_dir()]


def entry_points(setup_py: Path) -> dict[str, list[str]]:
    """``entry_points=`` of the ``setup()`` call: group -> entry point names."""
    tree = ast.parse(setup_py.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "entry_points":
            value = ast.literal_eval(node.value)
            return {
                group: sorted(spec.split("=")[0].strip() for spec in specs)
                for group, specs in value.items()
            }
    raise LookupError(f"{setup_py}: no entry_points")


def vllm_pair(dockerfile: Path) -> str | None:
    match = re.search(r"^ARG VLLM_TAG=v?(\S+)", dockerfile.read_text(), re.M)
    return match.group(1) if match else None


def _names() -> dict[str, tuple[str, ...]]:
    lay = vllm_layout
    sender_classes = {c.cls for t in lay.DRIFT_TARGETS if t.name == "sender" for c in t.candidates}
    caches = {f.owner for f in lay.FACTORY_LAYOUTS} | sender_classes
    caches |= {"LRUCache", lay.MM_CACHE_FACTORY, "vllm.multimodal.cache"}
    return {
        "engine_core_proc": (lay.ENGINE_PROC_CLASS.cls,),
        "multimodal_caches": tuple(sorted(caches)),
        "health": (f"{lay.HEALTH_TARGET.cls}.{lay.HEALTH_METHOD}", '"/health"'),
    }


def hits(root: Path) -> dict[str, list[str]]:
    """``file:line`` of every line of vllm_ascend that names what the plugin touches."""
    found: dict[str, list[str]] = {k: [] for k in _names()}
    for path in sorted((root / "vllm_ascend").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            code = line.split("#", 1)[0]
            for kind, names in _names().items():
                if any(name in code for name in names):
                    found[kind].append(f"{rel}:{number}")
    return found


BUSY_LOOP = (
    "run_busy_loop",
    vllm_layout.BUSY_LOOP_INPUT,
    vllm_layout.BUSY_LOOP_STEP,
    vllm_layout.BUSY_LOOP_DISPATCH,
    vllm_layout.ENGINE_INPUT_THREAD,
)


def busy_loop_overrides(root: Path) -> dict[str, list[str]]:
    """Classes deriving from an ``*EngineCoreProc`` and the busy-loop methods they define."""
    out: dict[str, list[str]] = {}
    for path in sorted((root / "vllm_ascend").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            bases = [ast.unparse(b) for b in node.bases]
            if not any(b.endswith("EngineCoreProc") for b in bases):
                continue
            defined = {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
            key = f"{path.relative_to(root).as_posix()}:{node.name}({', '.join(bases)})"
            out[key] = sorted(defined & set(BUSY_LOOP))
    return out


def read(version: str) -> dict[str, Any]:
    root = fetch(version)
    return {
        "vllm_ascend": version,
        "vllm": vllm_pair(root / "Dockerfile"),
        "entry_points": entry_points(root / "setup.py"),
        "names_what_the_plugin_touches": hits(root),
        "engine_core_proc_subclasses": busy_loop_overrides(root),
    }


def record(facts: dict[str, Any], path: Path = RECORD) -> None:
    data = json.loads(path.read_text()) if path.is_file() else {"releases": []}
    rows = [r for r in data["releases"] if r["vllm_ascend"] != facts["vllm_ascend"]]
    data["releases"] = [facts, *rows]
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("version", help="a vllm-ascend release, e.g. 0.30.0rc2")
    parser.add_argument("--record", action="store_true", help=f"add it to {RECORD}")
    args = parser.parse_args(argv)
    try:
        facts = read(args.version)
    except (RuntimeError, LookupError) as exc:
        print(f"ascend-release: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(facts, indent=2))
    if args.record:
        record(facts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
