"""Generate ``patches/*.diff`` and ``patches/index.json`` from released vLLM sources.

Each diff changes the one file that defines vLLM's multimodal ``get_lru_cache``
(``vllm/multimodal/processing.py`` in 0.10.0, ``vllm/multimodal/cache.py`` in
0.10.1.1 - 0.30, ``vllm/multimodal/cache/base.py`` from 0.31):

* it adds ``_FixedLRUCache``, a subclass of that module's ``LRUCache`` whose ``touch``,
  ``popitem`` and ``clear`` (and their helpers) are the plugin's ``FixedLRUMixin`` methods,
  taken from ``vllm_mmcache_fix/lru_eviction/cache.py`` by
  ``inspect``/``ast`` so the two cannot drift. The plugin's repair statistics become one
  ``logger.warning`` per process, prefixed
  ``vllm-mmcache-fix:``;
* it makes ``get_lru_cache`` build ``_FixedLRUCache`` instead of ``LRUCache``.

Nothing else changes; the LoRA and rope caches keep vLLM's class.

File names: ``vllm-<first>-mm-lru-eviction.diff`` for a diff that covers one release,
``vllm-<first>_<last>-mm-lru-eviction.diff`` for a run of consecutive releases (in the
order of :mod:`harness.sources`) that the same diff patches to exactly the file
generated for each of them. ``index.json`` lists every covered release explicitly, with
the sha256 of its target file before and after patching.

Usage::

    scripts/make-patches            # (re)write patches/
    scripts/make-patches --check    # exit 1 if patches/ is not up to date
    scripts/make-patches --out DIR  # write elsewhere
"""

from __future__ import annotations

import argparse
import ast
import builtins
import difflib
import hashlib
import inspect
import json
import re
import symtable
import sys
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from harness import sources
from harness.paths import REPO_ROOT
from vllm_mmcache_fix.lru_eviction import cache as fixed_cache
from vllm_mmcache_fix.tools.source_patch import (
    INDEX_NAME,
    SCHEMA_VERSION,
    PatchError,
    apply_unified_diff,
)
from vllm_mmcache_fix.vllm_layout import FACTORY_LAYOUTS, MM_CACHE_FACTORY

FIX_ID = "mm-lru-eviction"
CLASS_NAME = "_FixedLRUCache"
SENTINEL_NAME = "_NO_VICTIM"
REPORT_METHOD = "_mmcache_fix_report"
REPORTED_ATTR = "_mmcache_fix_reported"
DEFAULT_OUT = REPO_ROOT / "patches"

# (target file, owner class) of ``get_lru_cache``; most recent layout first.
TARGETS: tuple[tuple[str, str], ...] = (*((c.file, c.owner) for c in FACTORY_LAYOUTS),)

# Module-level names of the target the generated class may use.
TARGET_GLOBALS = frozenset({"LRUCache", "logger"})

_REPORT_SOURCE = f"""
def {REPORT_METHOD}(self, kind: str, count: int) -> None:
    # One line per process is enough to show that a cache needed repairs.
    if {CLASS_NAME}.{REPORTED_ATTR}:
        return
    {CLASS_NAME}.{REPORTED_ATTR} = True
    logger.warning(
        "vllm-mmcache-fix: repaired a multimodal processor cache whose eviction "
        "order and data had diverged (%s: %d); unpatched, eviction could stall "
        "here. Later repairs in this process are not logged.",
        kind,
        count,
    )
"""


VERSIONS: tuple[str, ...] = tuple(sources.VLLM_VERSIONS)


# --------------------------------------------------------------------------- the class text


class _Edits:
    """Replacements at (line, column) spans of one text, applied back to front."""

    def __init__(self, text: str) -> None:
        self.lines = text.splitlines(keepends=True)
        self._starts = [0]
        for line in self.lines:
            self._starts.append(self._starts[-1] + len(line))
        self.text = text
        self.edits: list[tuple[int, int, str]] = []

    def offset(self, lineno: int, col: int) -> int:
        # ast columns are UTF-8 byte offsets; the source here is ASCII, which is checked.
        return self._starts[lineno - 1] + col

    def replace_node(self, node: ast.AST, new: str) -> None:
        start = self.offset(node.lineno, node.col_offset)  # type: ignore[attr-defined]
        end = self.offset(node.end_lineno, node.end_col_offset)  # type: ignore[attr-defined]
        self.edits.append((start, end, new))

    def replace_span(self, start: int, end: int, new: str) -> None:
        self.edits.append((start, end, new))

    def apply(self) -> str:
        text = self.text
        last = len(text) + 1
        for start, end, new in sorted(self.edits, reverse=True):
            if end > last:
                raise ValueError("overlapping edits")
            text = text[:start] + new + text[end:]
            last = start
        return text


def _names(node: ast.AST) -> set[str]:
    return {sub.id for sub in ast.walk(node) if isinstance(sub, ast.Name)}


def _portable_annotation(node: ast.expr | None) -> bool:
    """Evaluates in any module: only builtins (the target imports no ``typing`` names)."""
    return node is None or _names(node) <= set(dir(builtins))


def _strip_annotations(func: ast.FunctionDef, edits: _Edits) -> None:
    args = func.args
    positional = [*args.posonlyargs, *args.args]
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(args.defaults)) + list(
        args.defaults
    )
    pairs: list[tuple[ast.arg, ast.expr | None]] = list(zip(positional, defaults))
    pairs += list(zip(args.kwonlyargs, args.kw_defaults))
    for extra in (args.vararg, args.kwarg):
        if extra is not None:
            pairs.append((extra, None))
    for arg, default in pairs:
        if _portable_annotation(arg.annotation):
            continue
        start = edits.offset(arg.lineno, arg.col_offset)
        if default is None:
            end = edits.offset(arg.end_lineno, arg.end_col_offset)  # type: ignore[arg-type]
            edits.replace_span(start, end, arg.arg)
        else:
            end = edits.offset(default.lineno, default.col_offset)
            edits.replace_span(start, end, f"{arg.arg}=")
    if not _portable_annotation(func.returns):
        assert func.returns is not None
        ret_start = edits.offset(func.returns.lineno, func.returns.col_offset)
        ret_end = edits.offset(func.returns.end_lineno, func.returns.end_col_offset)  # type: ignore[arg-type]
        arrow = edits.text.rindex("->", 0, ret_start)
        close = edits.text.rindex(")", 0, arrow)
        edits.replace_span(close + 1, ret_end, "")
    for node in ast.walk(func):
        if isinstance(node, ast.AnnAssign) and not _portable_annotation(node.annotation):
            if node.value is None or not isinstance(node.target, ast.Name):
                raise ValueError(f"line {node.lineno}: unsupported annotated statement")
            # "name: T = value" -> "name = value"; the value keeps its own edits.
            start = edits.offset(node.target.end_lineno, node.target.end_col_offset)  # type: ignore[arg-type]
            end = edits.offset(node.value.lineno, node.value.col_offset)
            edits.replace_span(start, end, " = ")


def _is_base_lookup(node: ast.AST) -> bool:
    """``getattr(type(self), BASE_ATTR)``."""
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "getattr"
        and len(node.args) == 2
        and ast.unparse(node.args[0]) == "type(self)"
        and isinstance(node.args[1], ast.Name)
        and node.args[1].id == "BASE_ATTR"
    )


def _docstring(mixin_doc: str) -> str:
    """The mixin's summary line and its bullet list (how the plugin builds classes is left out)."""
    paragraphs = inspect.cleandoc(mixin_doc).split("\n\n")
    kept = [paragraphs[0]] + [p for p in paragraphs[1:] if p.startswith("- ")]
    body = "\n\n".join(kept)
    return '    """' + textwrap.indent(body, "    ").lstrip() + '\n    """\n'


def _is_record_call(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and (node.func.id == "_record")
    )


def _rewrite_method(func: ast.FunctionDef, edits: _Edits) -> None:
    _strip_annotations(func, edits)
    for node in ast.walk(func):
        if _is_record_call(node):
            assert isinstance(node, ast.Call)
            # _record(kind, count, self) -> self._mmcache_fix_report(kind, count)
            if len(node.args) != 3 or ast.unparse(node.args[2]) != "self":
                raise ValueError(f"line {node.lineno}: unexpected _record call")
            kind = ast.get_source_segment(edits.text, node.args[0])
            count = ast.get_source_segment(edits.text, node.args[1])
            edits.replace_node(node, f"self.{REPORT_METHOD}({kind}, {count})")
        elif isinstance(node, ast.AugAssign) and ast.unparse(node.target).startswith("STATS."):
            # Counters without a repair (ignored touches) have no log line.
            edits.replace_node(node, "pass")
        elif _is_base_lookup(node):
            # The plugin copies these methods into a subclass of vLLM's class and reaches
            # that class through BASE_ATTR; here the class is a plain subclass of LRUCache.
            edits.replace_node(node, "LRUCache")
        elif isinstance(node, ast.Name) and node.id == "_NO_VICTIM":
            edits.replace_node(node, SENTINEL_NAME)


METRICS_ONLY = "# metrics-only"
"""Marks a line of ``FixedLRUMixin`` that only counts for the cache series."""
PLUGIN_ONLY = frozenset({"get"})
"""Methods of ``FixedLRUMixin`` a patched vLLM does without: ``get`` reads a hit's modality
for the cache series (and saves vLLM's nested lookups); vLLM's own ``get`` is right."""


def render_fixed_class() -> str:
    """Module-level text of ``_FixedLRUCache`` (and its sentinel) built from the plugin."""
    source = textwrap.dedent(inspect.getsource(fixed_cache.FixedLRUMixin))
    # The cache series (lines marked METRICS_ONLY) need the plugin's statistics; a patched
    # vLLM carries the eviction fix alone.
    source = "".join(line for line in source.splitlines(True) if METRICS_ONLY not in line)
    if not source.isascii():
        raise ValueError("FixedLRUMixin source must be ASCII")
    tree = ast.parse(source)
    cls = tree.body[0]
    assert isinstance(cls, ast.ClassDef) and cls.name == "FixedLRUMixin"
    edits = _Edits(source)
    body = list(cls.body)
    docstring = body.pop(0)
    if not (isinstance(docstring, ast.Expr) and isinstance(docstring.value, ast.Constant)):
        raise ValueError("FixedLRUMixin must start with a docstring")
    edits.replace_span(
        0,
        edits.offset(docstring.end_lineno + 1, 0),  # type: ignore[operator]
        f"class {CLASS_NAME}(LRUCache):\n" + _docstring(str(docstring.value.value)),
    )
    # Only methods are carried over. Type declarations for checkers (``_Cache__data: ...``)
    # and ``__slots__`` (which matters only for switching instances' class in place) are
    # dropped with their comments; in their place go the marker the plugin recognises and
    # the report flag. Any other class attribute stops the generator.
    # A plugin-only method goes with the class attributes' span below: it must come first.
    for dropped in [n for n in body if isinstance(n, ast.FunctionDef) and n.name in PLUGIN_ONLY]:
        body.remove(dropped)
        if any(isinstance(n, ast.FunctionDef) and n.lineno < dropped.lineno for n in body):
            raise ValueError(f"FixedLRUMixin.{dropped.name} must come before the methods carried")
    methods = [node for node in body if isinstance(node, ast.FunctionDef)]
    for node in body:
        if isinstance(node, ast.FunctionDef) or (
            isinstance(node, ast.AnnAssign) and node.value is None
        ):
            continue
        if isinstance(node, ast.Assign) and _names(node) == {"__slots__"}:
            continue
        raise ValueError(f"FixedLRUMixin line {node.lineno}: cannot carry {ast.unparse(node)}")
    if body.index(methods[0]) != len(body) - len(methods):
        raise ValueError("FixedLRUMixin: class attributes must come before the methods")
    attrs = (
        "\n    # Tells the vllm-mmcache-fix plugin, if also installed, that this class is fixed.\n"
        f"    {fixed_cache.MARKER} = True\n"
        f"    {REPORTED_ATTR} = False\n\n"
    )
    first_method_line = min(
        [m.lineno for m in methods] + [d.lineno for m in methods for d in m.decorator_list]
    )
    edits.replace_span(
        edits.offset(docstring.end_lineno + 1, 0),  # type: ignore[operator]
        edits.offset(first_method_line, 0),
        attrs,
    )
    for method in methods:
        _rewrite_method(method, edits)
    class_text = edits.apply().rstrip("\n") + "\n"
    # The mixin's "type: ignore" comments are about mixing in; a subclass needs none.
    class_text = re.sub(r"  # type: ignore\[[a-z-]+\]$", "", class_text, flags=re.MULTILINE)
    class_text += "\n" + textwrap.indent(_REPORT_SOURCE.strip("\n"), "    ") + "\n"
    text = f"{SENTINEL_NAME} = object()\n\n\n{class_text}"
    _check_free_names(text)
    return text


def _check_free_names(text: str) -> None:
    """The class may only use builtins, its own names and ``TARGET_GLOBALS``."""
    allowed = set(dir(builtins)) | TARGET_GLOBALS | {SENTINEL_NAME, CLASS_NAME}
    unknown: set[str] = set()

    def visit(table: symtable.SymbolTable) -> None:
        if table.get_type() == "function":
            for symbol in table.get_symbols():
                if symbol.is_global() and symbol.get_name() not in allowed:
                    unknown.add(symbol.get_name())
        for child in table.get_children():
            visit(child)

    visit(symtable.symtable(text, "<fixed class>", "exec"))
    if unknown:
        raise ValueError(
            f"FixedLRUMixin uses module-level names the patch cannot carry: {sorted(unknown)}"
        )


# --------------------------------------------------------------------------- one release


@dataclass(frozen=True)
class Release:
    version: str
    target: str
    original: str
    patched: str

    @property
    def original_sha256(self) -> str:
        return _sha256(self.original.encode("utf-8"))

    @property
    def patched_sha256(self) -> str:
        return _sha256(self.patched.encode("utf-8"))


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def find_target(source_root: Path) -> tuple[str, str]:
    """(relative path, owner class) of the file defining the multimodal ``get_lru_cache``."""
    for relpath, owner in TARGETS:
        path = source_root / relpath
        if path.is_file() and _factory(ast.parse(path.read_text(encoding="utf-8")), owner):
            return relpath, owner
    raise LookupError(f"{source_root}: no multimodal get_lru_cache found")


def _factory(tree: ast.Module, owner: str) -> ast.FunctionDef | None:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == owner:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == MM_CACHE_FACTORY:
                    return item
    return None


def patch_source(original: str, owner: str, class_text: str) -> str:
    """``original`` with the fixed class added before ``owner`` and the factory using it."""
    tree = ast.parse(original)
    bound = {
        (alias.asname or alias.name)
        for node in tree.body
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    }
    assigned = {
        target.id
        for node in tree.body
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    defined = {node.name for node in tree.body if isinstance(node, (ast.ClassDef, ast.FunctionDef))}
    if "LRUCache" not in bound or "logger" not in assigned:
        raise LookupError("target module does not import LRUCache or define logger")
    clash = {CLASS_NAME, SENTINEL_NAME} & (bound | assigned | defined)
    if clash:
        raise LookupError(f"target module already defines {sorted(clash)}")

    owner_node = next(
        node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == owner
    )
    factory = _factory(tree, owner)
    assert factory is not None
    calls = [
        node
        for node in ast.walk(factory)
        if isinstance(node, ast.Return)
        and isinstance(node.value, ast.Call)
        and isinstance(node.value.func, ast.Name)
        and node.value.func.id == "LRUCache"
    ]
    if len(calls) != 1:
        raise LookupError(f"expected one 'return LRUCache(...)' in get_lru_cache, got {len(calls)}")
    name = calls[0].value.func  # type: ignore[union-attr]

    edits = _Edits(original)
    start = edits.offset(name.lineno, name.col_offset)
    edits.replace_span(start, start + len("LRUCache"), CLASS_NAME)
    insert_line = min([owner_node.lineno] + [d.lineno for d in owner_node.decorator_list])
    insert_at = edits.offset(insert_line, 0)
    edits.replace_span(insert_at, insert_at, class_text + "\n\n")
    patched = edits.apply()
    ast.parse(patched)
    return patched


def load_release(version: str, source_root: Path, class_text: str) -> Release:
    target, owner = find_target(source_root)
    original = (source_root / target).read_bytes().decode("utf-8")
    return Release(version, target, original, patch_source(original, owner, class_text))


# --------------------------------------------------------------------------- diffs and index


def unified_diff(target: str, old: str, new: str) -> str:
    if not (old.endswith("\n") and new.endswith("\n")):
        raise ValueError(f"{target}: file does not end with a newline")
    lines = difflib.unified_diff(
        old.splitlines(keepends=True),
        new.splitlines(keepends=True),
        fromfile=f"a/{target}",
        tofile=f"b/{target}",
        n=3,
    )
    return "".join(lines)


def _range_name(versions: Sequence[str]) -> str:
    span = versions[0] if len(versions) == 1 else f"{versions[0]}_{versions[-1]}"
    return f"vllm-{span}-{FIX_ID}.diff"


def _preamble(versions: Sequence[str], target: str) -> str:
    span = versions[0] if len(versions) == 1 else f"{versions[0]} - {versions[-1]}"
    wrapped = textwrap.wrap(" ".join(versions), 88, initial_indent="  ", subsequent_indent="  ")
    return (
        f"vllm-mmcache-fix {FIX_ID}: vLLM {span}, {target}\n"
        "Multimodal processor caches are built as _FixedLRUCache, whose eviction always\n"
        "removes an item or raises, so a key left in the LRU order without data can no\n"
        "longer freeze the engine.\n"
        "Apply from the directory containing vllm/ (site-packages or a vLLM checkout):\n"
        "  patch -p1 --forward --no-backup-if-mismatch < THIS_FILE\n"
        "  or: git apply THIS_FILE\n"
        "Releases (the target file's sha256 for each is in index.json):\n"
        + "\n".join(wrapped)
        + "\n\n"
    )


@dataclass
class _Group:
    releases: list[Release]
    diff: str

    @property
    def versions(self) -> list[str]:
        return [r.version for r in self.releases]


def group_releases(releases: Sequence[Release]) -> list[_Group]:
    """Consecutive releases that one diff patches to exactly their own expected file."""
    groups: list[_Group] = []
    for release in releases:
        current = groups[-1] if groups else None
        if current is not None and current.releases[0].target == release.target:
            try:
                result = apply_unified_diff(release.original, current.diff)
            except PatchError:
                result = None
            if result == release.patched:
                current.releases.append(release)
                continue
        diff = unified_diff(release.target, release.original, release.patched)
        if apply_unified_diff(release.original, diff) != release.patched:
            raise AssertionError(f"{release.version}: generated diff does not round-trip")
        groups.append(_Group([release], diff))
    return groups


def build(versions: Sequence[str], roots: dict[str, Path]) -> dict[str, bytes]:
    """File name -> content of everything that belongs in ``patches/``."""
    class_text = render_fixed_class()
    releases = [load_release(v, roots[v], class_text) for v in versions]
    files: dict[str, bytes] = {}
    entries = []
    for group in group_releases(releases):
        name = _range_name(group.versions)
        content = (_preamble(group.versions, group.releases[0].target) + group.diff).encode()
        files[name] = content
        entries.append(
            {
                "file": name,
                "first": group.versions[0],
                "last": group.versions[-1],
                "versions": group.versions,
                "target": group.releases[0].target,
                "sha256": _sha256(content),
                "original_sha256": {r.version: r.original_sha256 for r in group.releases},
                "patched_sha256": {r.version: r.patched_sha256 for r in group.releases},
            }
        )
    index = {
        "schema_version": SCHEMA_VERSION,
        "fix": FIX_ID,
        "generated_by": "scripts/make-patches",
        "class_source": "vllm_mmcache_fix/lru_eviction/cache.py:FixedLRUMixin",
        "naming": (
            f"vllm-<first>-{FIX_ID}.diff covers one release; "
            f"vllm-<first>_<last>-{FIX_ID}.diff covers the consecutive releases listed in "
            "'versions', each patched by it to exactly its own expected file"
        ),
        "apply": (
            "in the directory holding vllm/: "
            "patch -p1 --forward --no-backup-if-mismatch -i FILE, or git apply FILE"
        ),
        "patches": entries,
    }
    files[INDEX_NAME] = (json.dumps(index, indent=2) + "\n").encode()
    return files


def source_roots(versions: Sequence[str], fetch: bool) -> dict[str, Path]:
    roots: dict[str, Path] = {}
    for version in versions:
        if fetch:
            roots[version] = sources.ensure_vllm_sources(version)
        else:
            directory = sources.vllm_source_dir(version)
            if not (directory / "vllm").is_dir():
                raise FileNotFoundError(f"no sources of vllm {version} in {directory}")
            roots[version] = directory
    return roots


def _managed(directory: Path) -> list[Path]:
    return sorted(directory.glob(f"vllm-*-{FIX_ID}.diff")) + [
        p for p in [directory / INDEX_NAME] if p.exists()
    ]


def write(files: dict[str, bytes], directory: Path) -> list[str]:
    """Write ``files`` into ``directory``, removing stale diffs; returns what changed."""
    directory.mkdir(parents=True, exist_ok=True)
    changed = []
    for path in _managed(directory):
        if path.name not in files:
            path.unlink()
            changed.append(f"removed {path.name}")
    for name, content in sorted(files.items()):
        path = directory / name
        if not path.exists() or path.read_bytes() != content:
            path.write_bytes(content)
            changed.append(f"wrote {name}")
    return changed


def compare(files: dict[str, bytes], directory: Path) -> list[str]:
    problems = [f"stale {p.name}" for p in _managed(directory) if p.name not in files]
    for name, content in sorted(files.items()):
        path = directory / name
        if not path.exists():
            problems.append(f"missing {name}")
        elif path.read_bytes() != content:
            problems.append(f"differs {name}")
    return problems


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory")
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    parser.add_argument(
        "--no-fetch", action="store_true", help="fail instead of fetching missing sources"
    )
    args = parser.parse_args(argv)
    files = build(VERSIONS, source_roots(VERSIONS, fetch=not args.no_fetch))
    if args.check:
        problems = compare(files, args.out)
        for line in problems:
            print(line, file=sys.stderr)
        if problems:
            print(f"{args.out} is out of date: run scripts/make-patches", file=sys.stderr)
            return 1
        print(f"{args.out} is up to date ({len(files) - 1} diffs)")
        return 0
    for line in write(files, args.out):
        print(line)
    index = json.loads(files[INDEX_NAME])
    for entry in index["patches"]:
        print(f"{entry['file']}: {' '.join(entry['versions'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
