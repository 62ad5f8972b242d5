"""What a new vLLM release changed for this plugin, in minutes: ``scripts/new-release X``.

1. Fetches the release's wheel the way ``scripts/fetch-sources`` does (``pip download
   --no-deps vllm==X``) and keeps the files the plugin touches: those of
   :mod:`harness.sources` (the realsrc tier's) and every module ``vllm_layout`` names.
2. Compares, against the newest release it knows (``--against`` for others), every
   class, method and function the plugin wraps or reads. The list is derived from
   ``vllm_layout`` (the factory, ``LRUCache``, the drift guard's targets with the methods
   its wrappers replace, EngineCore's busy loop, ``AsyncLLM.check_health``, the client's
   utility call, the plugin loader) and from the drift guard's own wrapper table, never
   written out here. Docstrings and line numbers are ignored; code is compared by its
   syntax tree.
3. Runs the realsrc tier's tests for the release (``pytest tests/realsrc -k X``; a
   release that ``harness/sources.py`` does not list yet is added for the run through
   ``$MMCACHE_HARNESS_EXTRA_RELEASES``) and the plugin's own feature detection on the
   release's code (:mod:`harness.release_code`): which factory the eviction fix wraps,
   which classes the drift guard patches.
4. Prints one verdict: ``nothing the plugin touches changed`` or the exact changes and the
   failed tests. ``--json FILE`` keeps the whole record (``compat/release-checks/``).

Exit status: 0 when nothing the plugin touches changed and every test passed, 1 otherwise,
2 when the release cannot be fetched.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from harness import commits, sources
from harness.paths import REPO_ROOT, cache_root
from vllm_mmcache_fix import vllm_layout

EXTRA_RELEASES_ENV = "MMCACHE_HARNESS_EXTRA_RELEASES"
NOTHING_CHANGED = "nothing the plugin touches changed"


# --------------------------------------------------------------------------- what is touched


@dataclass(frozen=True)
class Touched:
    feature: str
    module: str
    cls: str | None
    """None: module-level functions (``names``) or the module alone."""
    names: tuple[str, ...]
    """Methods (or functions) the plugin wraps, calls or relies on; ``*``: every method."""

    @property
    def label(self) -> str:
        return f"{self.module}.{self.cls}" if self.cls else self.module


def touched() -> list[Touched]:
    """Everything the plugin wraps or reads, from ``vllm_layout`` and the drift guard's
    wrapper table."""
    from vllm_mmcache_fix.drift_guard.fix import WRAPPERS

    lay = vllm_layout
    out: list[Touched] = []
    for f in lay.FACTORY_LAYOUTS:
        out.append(Touched("eviction fix", f.module, f.owner, (lay.MM_CACHE_FACTORY,)))
    for module in lay.LRU_MODULES:
        out.append(Touched("eviction fix", module, "LRUCache", ("*",)))
    for target in lay.DRIFT_TARGETS:
        wrapped = tuple(name for name, _ in WRAPPERS[target.name])
        names = dict.fromkeys((*target.required, *target.optional, *wrapped))
        if target.name == "sender":
            names.update(dict.fromkeys(lay.SENDER_READ_METHODS))
        for c in target.candidates:
            out.append(Touched("drift guard", c.module, c.cls, tuple(names)))
    core = lay.ENGINE_CORE_CLASS
    out.append(Touched("engine liveness", core.module, core.cls, ()))
    proc = lay.ENGINE_PROC_CLASS
    busy = (
        lay.BUSY_LOOP_INPUT,
        lay.BUSY_LOOP_STEP,
        lay.BUSY_LOOP_DISPATCH,
        lay.ENGINE_INPUT_THREAD,
        lay.ENGINE_OUTPUT_THREAD,
    )
    out.append(Touched("engine liveness", proc.module, proc.cls, busy))
    health = lay.HEALTH_TARGET
    out.append(
        Touched(
            "engine liveness", health.module, health.cls, (lay.HEALTH_METHOD, lay.CLIENT_OWNER_INIT)
        )
    )
    client = lay.ASYNC_CLIENT_CLASS
    out.append(Touched("engine liveness", client.module, client.cls, (lay.CLIENT_CALL_UTILITY,)))
    dead_module, dead_cls = lay.ENGINE_DEAD_ERROR
    out.append(Touched("engine liveness", dead_module, dead_cls, ()))
    for module in lay.METRICS_ROUTE_MODULES:
        out.append(Touched("metrics", module, None, ()))
    plugins_module = lay.PLUGINS_MODULE_FILE.removesuffix("/__init__.py").replace("/", ".")
    out.append(
        Touched(
            "plugin loading",
            plugins_module,
            None,
            ("load_general_plugins", "load_plugins_by_group"),
        )
    )
    return out


def module_files(module: str) -> tuple[str, str]:
    base = module.replace(".", "/")
    return f"{base}.py", f"{base}/__init__.py"


def _members() -> tuple[str, ...]:
    files = {re.escape(f) for t in touched() for f in module_files(t.module)}
    return tuple(sorted(files | set(sources._VLLM_MEMBERS)))


# --------------------------------------------------------------------------- fetching


def release_dir(version: str, root: Path | None = None) -> Path:
    return (root or cache_root()) / "release-check" / f"vllm-{version}"


def fetch(version: str, root: Path | None = None) -> Path:
    """The touched files of ``version`` (one wheel download, kept while complete)."""
    members = _members()
    layout = hashlib.sha256("\n".join(members).encode()).hexdigest()[:12]
    directory = release_dir(version, root)
    if sources.is_complete(directory, layout):
        return directory
    select = re.compile("|".join(f"(?:{m})" for m in members))
    return sources.fetched(sources._fetch("vllm", version, directory, select, layout))


# --------------------------------------------------------------------------- comparing


def _without_docstrings(node: ast.AST) -> ast.stmt:
    node = ast.parse(ast.unparse(node)).body[0]
    for sub in ast.walk(node):
        body = getattr(sub, "body", None)
        if (
            isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            sub.body = body[1:] or [ast.Pass()]
    return node


def _strip(node: ast.AST) -> str:
    """The node's syntax tree without docstrings or positions."""
    return ast.dump(_without_docstrings(node), include_attributes=False)


def _place(rel: str, bases: str | None, funcs: dict[str, Any]) -> Place:
    return Place(
        rel,
        bases,
        {k: _strip(v) for k, v in funcs.items()},
        {k: ast.unparse(_without_docstrings(v)).splitlines() for k, v in funcs.items()},
        True,
    )


def _functions(body: list[ast.stmt]) -> dict[str, ast.FunctionDef | ast.AsyncFunctionDef]:
    return {n.name: n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


@dataclass
class Place:
    file: str | None = None
    bases: str | None = None
    functions: dict[str, str] = field(default_factory=dict)
    """name -> stripped syntax tree."""
    text: dict[str, list[str]] = field(default_factory=dict)
    """name -> its source as ``ast.unparse`` writes it (no comments or docstrings)."""
    found: bool = False


def locate(root: Path, item: Touched) -> Place:
    for rel in module_files(item.module):
        path = root / rel
        if not path.is_file():
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        if item.cls is None:
            return _place(rel, None, _functions(tree.body))
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name == item.cls:
                bases = ", ".join(ast.unparse(b) for b in node.bases)
                return _place(rel, bases, _functions(node.body))
        return Place(rel)
    return Place()


@dataclass
class Change:
    feature: str
    where: str
    what: str
    touched: bool
    """A change to something the plugin wraps or reads (else: informational)."""
    diff: list[str] = field(default_factory=list)
    """A unified diff of a changed method the plugin touches (no docstrings)."""


def compare(old_root: Path, new_root: Path) -> list[Change]:
    changes: list[Change] = []
    seen: set[tuple[str, str | None]] = set()
    for item in touched():
        key = (item.module, item.cls)
        if key in seen:
            continue
        seen.add(key)
        old, new = locate(old_root, item), locate(new_root, item)
        if not old.found and not new.found:
            continue  # a layout of other releases
        if old.found != new.found:
            state = "appears" if new.found else "is gone"
            where = new.file or old.file or "-"
            changes.append(Change(item.feature, item.label, f"{state} ({where})", True))
            continue
        if old.file != new.file:
            changes.append(
                Change(item.feature, item.label, f"moved: {old.file} -> {new.file}", True)
            )
        if old.bases != new.bases:
            what = f"base classes: ({old.bases}) -> ({new.bases})"
            changes.append(Change(item.feature, item.label, what, True))
        names = set(old.functions) | set(new.functions)
        for name in sorted(names):
            is_touched = "*" in item.names or name in item.names
            a, b = old.functions.get(name), new.functions.get(name)
            if a == b:
                continue
            what = "added" if a is None else "removed" if b is None else "changed"
            if not is_touched and item.cls is None:
                continue  # other module-level functions of a touched module
            diff: list[str] = []
            if what == "changed" and is_touched:
                diff = list(difflib.unified_diff(old.text[name], new.text[name], lineterm="", n=1))[
                    2:
                ]
            changes.append(Change(item.feature, f"{item.label}.{name}", what, is_touched, diff))
    return changes


# --------------------------------------------------------------------------- running


def _python() -> str:
    """An interpreter with pytest and cachetools: this one, or the test environment's."""
    probe = "import pytest, cachetools, hypothesis"
    ok = subprocess.run([sys.executable, "-c", probe], capture_output=True, check=False)
    if ok.returncode == 0:
        return sys.executable
    dev = cache_root() / "venvs" / "dev" / "bin" / "python"
    if dev.is_file():
        return str(dev)
    raise RuntimeError(
        "no Python with pytest, cachetools and hypothesis: run scripts/run-tests quick once "
        "(it builds the test environment), or set PYTHON to one"
    )


def _env(version: str) -> dict[str, str]:
    env = dict(os.environ)
    if version not in sources.VLLM_VERSIONS:
        extra = [v for v in env.get(EXTRA_RELEASES_ENV, "").split(",") if v]
        env[EXTRA_RELEASES_ENV] = ",".join(dict.fromkeys([*extra, version]))
    return env


def run_realsrc(version: str, python: str) -> dict[str, Any]:
    """``pytest tests/realsrc -k VERSION``: counts and the failed tests' ids."""
    with tempfile.TemporaryDirectory(prefix="mmcache-new-release-") as tmp:
        report = Path(tmp) / "junit.xml"
        cmd = [
            python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/realsrc",
            "-k", version, f"--junitxml={report}",
        ]  # fmt: skip
        start = time.monotonic()
        proc = subprocess.run(
            cmd, cwd=REPO_ROOT, env=_env(version), capture_output=True, text=True, check=False
        )
        seconds = time.monotonic() - start
        failed: list[str] = []
        passed = skipped = 0
        if report.is_file():
            for case in ET.parse(report).getroot().iter("testcase"):
                name = f"{case.get('classname', '')}::{case.get('name', '')}"
                if case.find("failure") is not None or case.find("error") is not None:
                    failed.append(name)
                elif case.find("skipped") is not None:
                    skipped += 1
                else:
                    passed += 1
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] if proc.returncode else []
    if proc.returncode not in (0, 1) and not failed:
        failed.append(f"pytest exit {proc.returncode}: {' '.join(tail)}")
    return {
        "command": " ".join(cmd[2:-1]),
        "seconds": round(seconds, 1),
        "passed": passed,
        "skipped": skipped,
        "failed": failed,
    }


_DETECT = r"""
import json, sys
from harness import release_code
from vllm_mmcache_fix import drift_guard
from vllm_mmcache_fix.lru_eviction.fix import LruEvictionFix

code = release_code.install(sys.argv[1])
lru = LruEvictionFix()
lru.install()
lru_status = lru.status()
drift = drift_guard.install()
only = code.only_cls(code.config(1 << 20)) if code.only_cls else None
print(json.dumps({
    "eviction_fix": lru_status["target"] if lru_status["installed"] else None,
    "eviction_fix_why_not": lru.not_enabled_reason,
    "exposure": lru_status["exposure"],
    "cache_fixed": type(only._cache).__name__ if only else None,
    "drift_guard": drift["patched"],
    "merge_mm_kwargs": code.merge_source,
    "not_executed": code.skipped,
}))
"""


def feature_detection(version: str, python: str) -> dict[str, Any]:
    """The plugin's own lookups on the release's code, in a fresh interpreter."""
    env = _env(version)
    env["PYTHONPATH"] = str(REPO_ROOT)
    proc = subprocess.run(
        [python, "-c", _DETECT, version],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if proc.returncode != 0:
        return {"error": (proc.stderr or proc.stdout).strip().splitlines()[-1:]}
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


# --------------------------------------------------------------------------- the verdict


@dataclass
class Record:
    version: str
    against: list[str]
    wheel: str
    wheel_sha256: str
    changes: dict[str, list[dict[str, Any]]]
    realsrc: dict[str, Any]
    detection: dict[str, Any]
    verdict: str
    seconds: float
    checked: list[str] = field(default_factory=list)
    """Every class/module the comparison covered (derived from ``vllm_layout``)."""
    plugin_commit: str = ""
    """The last commit that changed the plugin package.

    (``harness.commits.package``)"""

    @property
    def ok(self) -> bool:
        return self.verdict == NOTHING_CHANGED


def _verdict(changes: dict[str, list[Change]], tests: dict[str, Any], det: dict[str, Any]) -> str:
    touched_changes = sorted(
        {f"{c.where} ({c.what})" for cs in changes.values() for c in cs if c.touched}
    )
    lines: list[str] = []
    if touched_changes:
        lines.append("changed: " + "; ".join(touched_changes))
    if tests["failed"]:
        lines.append("failed tests: " + "; ".join(tests["failed"]))
    if "error" in det or not det.get("eviction_fix"):
        lines.append(f"feature detection: {det.get('error') or det.get('eviction_fix_why_not')}")
    return "\n".join(lines) if lines else NOTHING_CHANGED


def _newest_known_before(version: str) -> str:
    key = sources_key(version)
    older = [v for v in sources.VLLM_VERSIONS if sources_key(v) < key]
    if not older:
        raise SystemExit(f"no known release older than {version}")
    return older[-1]


def sources_key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version.split("+")[0])[:4])


def check(version: str, against: Sequence[str], *, run_tests: bool = True) -> Record:
    start = time.monotonic()
    new_root = fetch(version)
    marker = sources.read_marker(new_root)
    changes: dict[str, list[Change]] = {}
    for old in against:
        changes[old] = compare(fetch(old), new_root)
    python = _python()
    if run_tests:
        sources.ensure_vllm_sources(version)
        tests = run_realsrc(version, python)
    else:
        tests = {"command": "(skipped)", "seconds": 0, "passed": 0, "skipped": 0, "failed": []}
    det = feature_detection(version, python)
    return Record(
        version=version,
        against=list(against),
        wheel=str(marker["wheel"]),
        wheel_sha256=str(marker["sha256"]),
        changes={k: [asdict(c) for c in v] for k, v in changes.items()},
        realsrc=tests,
        detection=det,
        verdict=_verdict(changes, tests, det),
        seconds=round(time.monotonic() - start, 1),
        checked=sorted({t.label for t in touched()}),
        plugin_commit=commits.package(),
    )


MAX_DIFF_LINES = 40


def render(rec: Record, *, diffs: bool = True) -> str:
    out = [f"vLLM {rec.version} ({rec.wheel}, sha256 {rec.wheel_sha256[:16]}...)"]
    if rec.plugin_commit:
        out.append(f"plugin: commit {rec.plugin_commit[:10]}")
    out.append(f"checked: {len(rec.checked)} classes/modules named by vllm_layout")
    for old, changes in rec.changes.items():
        mine = [c for c in changes if c["touched"]]
        other: dict[str, list[str]] = {}
        for c in changes:
            if not c["touched"]:
                owner, _, name = c["where"].rpartition(".")
                other.setdefault(owner.rsplit(".", 1)[-1], []).append(f"{name} {c['what']}")
        out.append(f"against {old}: {len(mine)} change(s) to what the plugin touches")
        for c in mine:
            out.append(f"  [{c['feature']}] {c['where']}: {c['what']}")
            if diffs:
                out.extend(f"    | {line}" for line in c["diff"][:MAX_DIFF_LINES])
                if len(c["diff"]) > MAX_DIFF_LINES:
                    out.append(f"    | ... {len(c['diff']) - MAX_DIFF_LINES} more lines")
        for owner, names in other.items():
            out.append(f"  not touched, in {owner}: {', '.join(names)}")
    t = rec.realsrc
    out.append(
        f"realsrc ({t['command']}): {t['passed']} passed, {t['skipped']} skipped, "
        f"{len(t['failed'])} failed in {t['seconds']} s"
    )
    for name in t["failed"]:
        out.append(f"  FAILED {name}")
    d = rec.detection
    if "error" in d:
        out.append(f"feature detection: ERROR {d['error']}")
    else:
        out.append(
            f"feature detection: eviction fix wraps {d['eviction_fix']} "
            f"(caches built as {d['cache_fixed']}); drift guard patches "
            + ", ".join(f"{k}={v}" for k, v in sorted(d["drift_guard"].items()))
        )
    out.append(f"verdict ({rec.seconds:.0f} s): {rec.verdict}")
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("version", help="the vLLM release to check, e.g. 0.35.0")
    parser.add_argument(
        "--against",
        action="append",
        metavar="VER",
        help="compare with this release (repeatable; default: the newest known older one)",
    )
    parser.add_argument("--json", type=Path, help="also write the whole record here")
    parser.add_argument("--no-tests", action="store_true", help="compare only")
    args = parser.parse_args(argv)
    against = args.against or [_newest_known_before(args.version)]
    try:
        rec = check(args.version, against, run_tests=not args.no_tests)
    except RuntimeError as exc:
        print(f"new-release: {exc}", file=sys.stderr)
        return 2
    print(render(rec))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        data = asdict(rec)
        data["text"] = render(rec).splitlines()
        args.json.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    return 0 if rec.ok else 1


if __name__ == "__main__":
    sys.exit(main())
