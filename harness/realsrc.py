"""The real sources of released vLLM versions, for the tests and the figures.

Pure standard library (plus ``cachetools`` for the loaded classes). Nothing here imports vLLM.

* :func:`source_root` - directory with the extracted files of one release (fetched on demand
  through :mod:`harness.sources` unless ``MMCACHE_HARNESS_OFFLINE=1``).
* :func:`load_lru_module` - a module object holding the release's real ``LRUCache`` class
  (and ``CacheInfo``, ``ALL_PINNED_SENTINEL``, ...), executed from the release's own source.
* :func:`run_snippet` - run Python code in a subprocess against a specific cachetools release.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from harness import sources
from harness.paths import REPO_ROOT

OFFLINE_ENV = "MMCACHE_HARNESS_OFFLINE"

LRU_IN_UTILS_INIT = "vllm/utils/__init__.py"
LRU_IN_UTILS_CACHE = "vllm/utils/cache.py"

# Third-party top-level modules a standalone LRU module may import.
_ALLOWED_THIRD_PARTY = frozenset({"cachetools"})


class SourcesUnavailable(RuntimeError):
    """The sources of a release are not on disk and could not be fetched."""


VERSIONS: tuple[str, ...] = tuple(sources.VLLM_VERSIONS)
CACHETOOLS_VERSIONS: tuple[str, ...] = tuple(sources.CACHETOOLS_VERSIONS)


def version_key(version: str) -> tuple[int, ...]:
    """Numeric sort key of a release number such as ``0.10.1.1``."""
    return tuple(int(part) for part in version.split("."))


def offline() -> bool:
    return os.environ.get(OFFLINE_ENV, "") not in ("", "0")


def cache_root() -> Path:
    return sources.cache_root()


def available_versions() -> list[str]:
    """Known releases whose sources are complete on disk (no fetching)."""
    return [v for v in VERSIONS if sources.vllm_complete(v)]


def _fetched(
    directory: Path,
    complete: bool,
    fetch_now: Callable[[], Path],
    *,
    fetch: bool,
    absent: str,
    failed: Callable[[RuntimeError], str],
) -> Path:
    """``directory`` when ``complete``, else what ``fetch_now`` fetches; raises
    :class:`SourcesUnavailable` with ``absent`` when fetching is off (``fetch`` or
    :func:`offline`), with ``failed(error)`` when the fetch fails."""
    if complete:
        return directory
    if not fetch or offline():
        raise SourcesUnavailable(absent)
    try:
        return fetch_now()
    except RuntimeError as exc:
        raise SourcesUnavailable(failed(exc)) from exc


def source_root(version: str, *, fetch: bool = True) -> Path:
    """Directory holding ``vllm/...`` of a release, fetching it first when needed."""
    directory = sources.vllm_source_dir(version)
    run = f"run: scripts/fetch-sources {version}"
    return _fetched(
        directory,
        sources.vllm_complete(version),
        lambda: sources.ensure_vllm_sources(version),
        fetch=fetch,
        absent=f"sources of vllm {version} are not in {directory} and fetching is disabled; {run}",
        failed=lambda exc: f"sources of vllm {version} could not be fetched ({exc}); {run}",
    )


def source_file(version: str, relpath: str) -> Path:
    """Path of one extracted file (it may not exist in that release)."""
    return source_root(version) / relpath


def has_file(version: str, relpath: str) -> bool:
    return source_file(version, relpath).is_file()


def cachetools_path(version: str, *, fetch: bool = True) -> Path:
    """A ``PYTHONPATH`` entry providing exactly cachetools ``version``."""
    directory = sources.cachetools_dir(version)
    return _fetched(
        directory,
        sources.cachetools_complete(version),
        lambda: sources.ensure_cachetools(version),
        fetch=fetch,
        absent=f"cachetools {version} is not in {directory} and fetching is disabled; "
        f"run: scripts/fetch-sources --no-vllm --cachetools {version}",
        failed=lambda exc: f"cachetools {version} could not be fetched ({exc})",
    )


# --------------------------------------------------------------------------- AST helpers


@functools.cache
def _parse_cached(path: str, mtime_ns: int) -> ast.Module:
    return ast.parse(Path(path).read_text(encoding="utf-8"), filename=path)


def parse(path: Path) -> ast.Module:
    """Parsed module (cached per path and modification time)."""
    return _parse_cached(str(path), path.stat().st_mtime_ns)


def parse_release_file(version: str, relpath: str) -> ast.Module:
    return parse(source_file(version, relpath))


def top_level_class(tree: ast.Module, name: str) -> ast.ClassDef | None:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    return None


def top_level_function(tree: ast.Module, name: str) -> ast.FunctionDef | None:
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    return None


def class_method(cls: ast.ClassDef, name: str) -> ast.FunctionDef | None:
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    return None


def decorator_names(func: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> list[str]:
    names = []
    for deco in func.decorator_list:
        target = deco.func if isinstance(deco, ast.Call) else deco
        names.append(ast.unparse(target))
    return names


def python_files(version: str, under: str) -> Iterator[tuple[str, Path]]:
    """``(relpath, path)`` of every extracted ``.py`` file below ``under`` (or that file)."""
    root = source_root(version)
    base = root / under
    if base.is_file():
        yield under, base
        return
    if base.is_dir():
        for path in sorted(base.rglob("*.py")):
            yield path.relative_to(root).as_posix(), path


def find_class_definitions(version: str, name: str, under: str = "vllm") -> list[str]:
    """Relative paths of extracted files that define top-level class ``name``."""
    return [rel for rel, path in python_files(version, under) if top_level_class(parse(path), name)]


def imported_top_level_modules(tree: ast.Module) -> set[str]:
    """Top-level package names imported at module level (relative imports as ``.``)."""
    modules: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            modules.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                modules.add(".")
            elif node.module is not None:
                modules.add(node.module.split(".")[0])
    return modules


# --------------------------------------------------------------------------- LRU loading


def lru_source_relpath(version: str) -> str:
    """Where the release defines ``LRUCache`` (``vllm/utils/cache.py`` or ``__init__.py``)."""
    if has_file(version, LRU_IN_UTILS_CACHE) and top_level_class(
        parse_release_file(version, LRU_IN_UTILS_CACHE), "LRUCache"
    ):
        return LRU_IN_UTILS_CACHE
    if top_level_class(parse_release_file(version, LRU_IN_UTILS_INIT), "LRUCache"):
        return LRU_IN_UTILS_INIT
    raise LookupError(f"vllm {version}: no top-level LRUCache in vllm/utils")


def _statement_names(node: ast.stmt) -> set[str]:
    """Names a top-level statement binds."""
    if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
        return {node.name}
    if isinstance(node, ast.Import):
        return {(a.asname or a.name).split(".")[0] for a in node.names}
    if isinstance(node, ast.ImportFrom):
        return {a.asname or a.name for a in node.names}
    targets: list[ast.expr] = []
    if isinstance(node, ast.Assign):
        targets = list(node.targets)
    elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
        targets = [node.target]
    names: set[str] = set()
    for target in targets:
        for sub in ast.walk(target):
            if isinstance(sub, ast.Name):
                names.add(sub.id)
    return names


def _used_names(node: ast.AST) -> set[str]:
    return {sub.id for sub in ast.walk(node) if isinstance(sub, ast.Name)}


def _statement_span(node: ast.stmt) -> tuple[int, int]:
    start = node.lineno
    if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
        for deco in node.decorator_list:
            start = min(start, deco.lineno)
    end = node.end_lineno if node.end_lineno is not None else node.lineno
    return start, end


def extract_definitions(path: Path, roots: Iterable[str]) -> str:
    """Source of ``roots`` plus the module-level statements they depend on.

    The result keeps the original text and line numbers: every other line of the file is
    blanked, so tracebacks and ``inspect`` point at the real file. ``__future__`` imports are
    always kept. Only unconditional module-level statements are considered.
    """
    text = path.read_text(encoding="utf-8")
    tree = parse(path)
    binders: dict[str, list[ast.stmt]] = {}
    for node in tree.body:
        for name in _statement_names(node):
            binders.setdefault(name, []).append(node)

    selected: set[int] = set()
    pending = list(roots)
    seen: set[str] = set()
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        seen.add(name)
        nodes = binders.get(name)
        if not nodes:
            continue  # builtin or local name
        for node in nodes:
            if id(node) in selected:
                continue
            selected.add(id(node))
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                pending.extend(_used_names(node))

    missing = [r for r in roots if r not in binders]
    if missing:
        raise LookupError(f"{path}: no module-level definition of {missing}")

    lines = text.splitlines()
    keep = [False] * len(lines)
    for node in tree.body:
        is_future = isinstance(node, ast.ImportFrom) and node.module == "__future__"
        if id(node) in selected or is_future:
            start, end = _statement_span(node)
            for index in range(start - 1, end):
                keep[index] = True
    return "\n".join(line if k else "" for line, k in zip(lines, keep)) + "\n"


def _stdlib_modules() -> frozenset[str]:
    """The standard library's top-level modules (``sys.stdlib_module_names`` from Python
    3.10; under 3.9 read from the standard library's folder)."""
    names = getattr(sys, "stdlib_module_names", None)
    if names is not None:
        return frozenset(names)
    import sysconfig

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    found = {p.stem if p.suffix == ".py" else p.name for p in stdlib.iterdir()}
    dynload = stdlib / "lib-dynload"
    if dynload.is_dir():
        found |= {p.name.split(".")[0] for p in dynload.iterdir()}
    return frozenset(found | set(sys.builtin_module_names))


def _check_standalone_imports(path: Path, tree: ast.Module) -> None:
    allowed = _stdlib_modules() | _ALLOWED_THIRD_PARTY
    foreign = sorted(m for m in imported_top_level_modules(tree) if m not in allowed)
    if foreign:
        raise ImportError(f"{path} imports {foreign}; it cannot be loaded standalone")


def _module_name(version: str) -> str:
    return "_vllm_real_" + version.replace(".", "_") + "_lru"


@functools.cache
def load_lru_module(version: str) -> ModuleType:
    """The real ``LRUCache`` (and its helpers) of a release, without importing vLLM.

    * 0.11.1+: ``vllm/utils/cache.py`` is loaded as a standalone module (it only imports the
      standard library and cachetools; this is checked).
    * <= 0.11.0: ``LRUCache`` and the module-level names it depends on are cut out of
      ``vllm/utils/__init__.py`` with ``ast`` and that original source is executed in a fresh
      module namespace.

    The returned module has ``__vllm_version__`` and ``__vllm_source__`` (relative path).
    """
    relpath = lru_source_relpath(version)
    path = source_file(version, relpath)
    name = _module_name(version)
    if relpath == LRU_IN_UTILS_CACHE:
        _check_standalone_imports(path, parse(path))
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {path}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            sys.modules.pop(name, None)
            raise
    else:
        source = extract_definitions(path, ["LRUCache"])
        _check_standalone_imports(path, ast.parse(source))
        module = ModuleType(name)
        module.__file__ = str(path)
        sys.modules[name] = module
        try:
            exec(compile(source, str(path), "exec"), module.__dict__)  # noqa: S102
        except BaseException:
            sys.modules.pop(name, None)
            raise
    module.__vllm_version__ = version  # type: ignore[attr-defined]
    module.__vllm_source__ = relpath  # type: ignore[attr-defined]
    return module


# --------------------------------------------------------------------------- subprocesses


@dataclass
class SnippetResult:
    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool
    seconds: float

    def check(self) -> SnippetResult:
        """Raise with the captured output unless the snippet exited 0."""
        if self.timed_out or self.returncode != 0:
            state = "timed out" if self.timed_out else f"exit {self.returncode}"
            raise AssertionError(
                f"snippet {state}\n--- stdout\n{self.stdout}\n--- stderr\n{self.stderr}"
            )
        return self


_PREAMBLE = """\
import cachetools as _ct
if _ct.__version__ != {version!r}:
    raise SystemExit(f"want cachetools {version}, got {{_ct.__version__}} ({{_ct.__file__}})")
del _ct
"""


def snippet_command(
    code: str,
    cachetools_version: str | None = None,
    *,
    extra_path: Sequence[Path | str] = (),
    env: Mapping[str, str] | None = None,
    args: Sequence[str] = (),
) -> tuple[list[str], dict[str, str]]:
    """``(argv, environment)`` running ``code`` in a fresh interpreter (see :func:`run_snippet`).

    Useful with :class:`subprocess.Popen` when a test needs to watch a child that never ends.
    """
    paths: list[str] = []
    if cachetools_version is not None:
        paths.append(str(cachetools_path(cachetools_version)))
    paths.extend(str(p) for p in extra_path)
    paths.append(str(REPO_ROOT))
    child_env = dict(os.environ)
    if env:
        child_env.update(env)
    child_env["PYTHONPATH"] = os.pathsep.join(paths)
    child_env.setdefault("PYTHONDONTWRITEBYTECODE", "1")
    body = textwrap.dedent(code)
    if cachetools_version is not None:
        body = _PREAMBLE.format(version=cachetools_version) + body
    return [sys.executable, "-s", "-c", body, *args], child_env


def run_snippet(
    code: str,
    cachetools_version: str | None = None,
    *,
    timeout: float = 60.0,
    extra_path: Sequence[Path | str] = (),
    env: Mapping[str, str] | None = None,
    args: Sequence[str] = (),
) -> SnippetResult:
    """Run ``code`` in a fresh interpreter, optionally pinned to a cachetools release.

    ``PYTHONPATH`` is the extracted cachetools wheel (if a version is given), then
    ``extra_path``, then the repository root (so the snippet can ``from harness import
    realsrc`` and import the package). When a cachetools version is given, the snippet
    first checks that it imports exactly that version. A snippet that runs past
    ``timeout`` is killed and reported with ``timed_out=True``.
    """
    cmd, child_env = snippet_command(
        code, cachetools_version, extra_path=extra_path, env=env, args=args
    )
    start = time.monotonic()
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, env=child_env, check=False
        )
    except subprocess.TimeoutExpired as exc:
        return SnippetResult(
            returncode=None,
            stdout=_text(exc.stdout),
            stderr=_text(exc.stderr),
            timed_out=True,
            seconds=time.monotonic() - start,
        )
    return SnippetResult(proc.returncode, proc.stdout, proc.stderr, False, time.monotonic() - start)


def _text(data: str | bytes | None) -> str:
    if data is None:
        return ""
    if isinstance(data, bytes):
        return data.decode("utf-8", "replace")
    return data
