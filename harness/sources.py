"""Fetch the relevant source files of released vLLM wheels (and cachetools wheels).

For every requested vLLM release the wheel is downloaded with ``pip download --no-deps``,
only the files that matter for the multimodal processor cache are extracted into::

    ${MMCACHE_HARNESS_CACHE:-~/.cache/vllm-mmcache-fix}/sources/vllm-X/vllm/...

and a ``COMPLETE`` marker (JSON: wheel filename, sha256, extracted files) is written. The
wheel itself is deleted afterwards. cachetools wheels are pure Python and are extracted
whole into ``<root>/cachetools/<version>/`` so that directory can be put on ``PYTHONPATH``.

Runs are idempotent: releases that already have a ``COMPLETE`` marker are skipped.

Usage::

    scripts/fetch-sources                 # every known vLLM release + cachetools
    scripts/fetch-sources 0.11.0 0.24.0   # just these vLLM releases
    scripts/fetch-sources --cachetools 5.5.2 --no-vllm

The tests reach these files through :mod:`harness.realsrc`, which fetches what is
missing unless ``$MMCACHE_HARNESS_OFFLINE`` is set.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.paths import cache_root
from vllm_mmcache_fix import vllm_layout as lay

LISTED_VLLM_VERSIONS: tuple[str, ...] = (
    "0.10.0", "0.10.1.1", "0.10.2",
    "0.11.0", "0.11.1", "0.11.2",
    "0.12.0", "0.13.0",
    "0.14.0", "0.14.1",
    "0.15.0", "0.15.1",
    "0.16.0",
    "0.17.0", "0.17.1",
    "0.18.0", "0.18.1",
    "0.19.0", "0.19.1",
    "0.20.0", "0.20.2",
    "0.21.0",
    "0.22.0", "0.22.1",
    "0.23.0", "0.24.0",
    "0.25.0", "0.25.1",
    "0.26.0",
    "0.27.0", "0.27.1",
    "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0",
    "0.34.0",
)  # fmt: skip

"""Every vLLM release the project knows: the one place a new release is added (its
realsrc tests, the release matrix and the newest-release checks follow from it)."""

EXTRA_RELEASES_ENV = "MMCACHE_HARNESS_EXTRA_RELEASES"
"""Comma-separated releases added after ``VLLM_VERSIONS`` for one run (``scripts/new-release``
sets it to run the realsrc tier on a release this list does not name yet)."""


def _extra_releases() -> tuple[str, ...]:
    extra = []
    for raw in os.environ.get(EXTRA_RELEASES_ENV, "").split(","):
        version = raw.strip()
        if not version or version in LISTED_VLLM_VERSIONS:
            continue
        if not re.fullmatch(r"\d+(\.\d+){1,3}", version):
            print(
                f"{EXTRA_RELEASES_ENV}: ignoring {version!r} (not a release number)",
                file=sys.stderr,
            )
            continue
        extra.append(version)
    return tuple(extra)


VLLM_VERSIONS: tuple[str, ...] = LISTED_VLLM_VERSIONS + _extra_releases()

CACHETOOLS_VERSIONS: tuple[str, ...] = ("5.5.2", "6.2.0", "7.3.3", "8.0.2")

MARKER = "COMPLETE"
MAX_JOBS = 2

# What a vLLM wheel's extraction keeps: package-relative paths (regular expressions, full
# match). The files the plugin touches come from vllm_mmcache_fix/vllm_layout.py; only the
# files no layout entry names are listed here.
_RELEASE_FILES: tuple[str, ...] = (r"vllm/version\.py", r"vllm/_version\.py")
"""Which release an extracted tree is."""
_OTHER_FILES: tuple[str, ...] = (
    r"vllm/multimodal/registry\.py",
    r"vllm/entrypoints/openai/serving_engine\.py",
    r"vllm/entrypoints/openai/engine/serving\.py",
    r"vllm/entrypoints/serve/engine/serving\.py",
    r"vllm/entrypoints/generate/base/serving\.py",
)
"""Read by the tests around the plugin's targets (the multimodal registry, the serving
layer that renders a request), named nowhere in the layout table."""
_NOT_EXTRACTED_MODULES = frozenset({lay.HEALTH_TARGET.module})
"""``vllm/v1/engine/async_llm.py`` (``AsyncLLM.generate``, ``check_health``): proven on
installed vLLM (the installed and e2e tiers), never read from released sources."""


def _module_file(module: str) -> str:
    return module.replace(".", "/") + ".py"


def layout_members() -> tuple[str, ...]:
    """The member patterns of the files ``vllm_layout`` names, in a stable order.

    Each candidate module gives its file; a module whose parent is itself a candidate (the
    module became a package: ``vllm.multimodal.cache`` -> ``vllm.multimodal.cache.lru``)
    gives that whole package instead, since its modules import each other.
    """
    modules = {c.module for t in lay.DRIFT_TARGETS for c in t.candidates}
    modules |= {f.module for f in lay.FACTORY_LAYOUTS} | {lay.ENGINE_CORE_CLASS.module}
    modules -= _NOT_EXTRACTED_MODULES
    files = {*lay.LRU_FILES, *(f.file for f in lay.FACTORY_LAYOUTS), lay.PLUGINS_MODULE_FILE}
    files |= {_module_file(m) for m in modules}
    packages = {m.rpartition(".")[0] for m in modules if m.rpartition(".")[0] in modules}
    package_dirs = {p.replace(".", "/") + "/" for p in packages}
    singles = {re.escape(f) for f in files if not f.startswith(tuple(package_dirs))}
    whole = {re.escape(d) + r"[A-Za-z0-9_]+\.py" for d in package_dirs}
    return tuple(sorted(singles | whole))


_VLLM_MEMBERS: tuple[str, ...] = (*_RELEASE_FILES, *layout_members(), *_OTHER_FILES)
_VLLM_MEMBER_RE = re.compile("|".join(f"(?:{p})" for p in _VLLM_MEMBERS))
# Identifies the extraction rules; a release extracted under other rules is fetched again.
VLLM_LAYOUT = hashlib.sha256("\n".join(sorted(_VLLM_MEMBERS)).encode()).hexdigest()[:12]
SAME_RULES: dict[str, tuple[str, ...]] = {"ab5008f6cdd1": ("bf6d0e0c2d63",)}
"""Earlier ids of the same rules (the same patterns, hashed in their former hand-written
order): a tree extracted under one of them is current and is not downloaded again."""
WHEEL_LAYOUT = "whole-wheel"

_print_lock = threading.Lock()


def vllm_source_dir(version: str, root: Path | None = None) -> Path:
    """Directory holding the extracted sources of one vLLM release."""
    return (root or cache_root()) / "sources" / f"vllm-{version}"


def cachetools_dir(version: str, root: Path | None = None) -> Path:
    """Directory holding one extracted cachetools wheel (a ``PYTHONPATH`` entry)."""
    return (root or cache_root()) / "cachetools" / version


def is_complete(directory: Path, layout: str | None = None) -> bool:
    """Whether ``directory`` holds a finished extraction (made under ``layout``, if given)."""
    marker = directory / MARKER
    if not marker.is_file():
        return False
    if layout is None:
        return True
    try:
        return read_marker(directory).get("layout") in (layout, *SAME_RULES.get(layout, ()))
    except (OSError, ValueError):
        return False


def vllm_complete(version: str, root: Path | None = None) -> bool:
    return is_complete(vllm_source_dir(version, root), VLLM_LAYOUT)


def cachetools_complete(version: str, root: Path | None = None) -> bool:
    return is_complete(cachetools_dir(version, root), WHEEL_LAYOUT)


def read_marker(directory: Path) -> dict[str, object]:
    return json.loads((directory / MARKER).read_text(encoding="utf-8"))


@dataclass
class FetchResult:
    name: str
    version: str
    directory: Path
    skipped: bool
    ok: bool
    seconds: float
    detail: str


def _log(line: str) -> None:
    with _print_lock:
        print(line, file=sys.stderr, flush=True)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _pip_download(requirement: str, dest: Path) -> Path:
    cmd = [
        sys.executable, "-m", "pip", "download",
        "--no-deps", "--only-binary=:all:", "--no-cache-dir",
        "--disable-pip-version-check", "--quiet",
        "-d", str(dest), requirement,
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"pip download {requirement} failed: {' | '.join(tail)}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"expected one wheel for {requirement}, found {wheels}")
    return wheels[0]


def _safe_member(name: str) -> bool:
    parts = Path(name).parts
    return not name.startswith("/") and ".." not in parts


def _extract(wheel: Path, target: Path, select: re.Pattern[str] | None) -> list[str]:
    """The wheel's files that ``select`` matches (every file without it), extracted under
    ``target``; none is an error."""
    extracted: list[str] = []
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            name = info.filename
            if info.is_dir() or not _safe_member(name):
                continue
            if select is not None and not select.fullmatch(name):
                continue
            out = target / name
            out.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(info) as src, out.open("wb") as dst:
                shutil.copyfileobj(src, dst)
            extracted.append(name)
    if not extracted:
        raise RuntimeError(f"no matching files in {wheel.name}")
    return sorted(extracted)


def publish(
    staged: Path,
    final_dir: Path,
    marker_name: str,
    marker: dict[str, Any],
    complete: Callable[[Path], bool],
) -> None:
    """Move a staged extraction into place, its marker written last: a directory with a
    marker is whole. When another process put a whole copy there first (``complete``), its
    copy is kept."""
    (staged / marker_name).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")
    shutil.rmtree(final_dir, ignore_errors=True)
    try:
        staged.rename(final_dir)
    except OSError:
        if not complete(final_dir):
            raise


def _fetch(
    name: str,
    version: str,
    final_dir: Path,
    select: re.Pattern[str] | None,
    layout: str,
    force: bool = False,
) -> FetchResult:
    start = time.monotonic()
    if is_complete(final_dir, layout) and not force:
        return FetchResult(name, version, final_dir, True, True, 0.0, "already complete")
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{final_dir.name}.", dir=final_dir.parent))
    try:
        wheel = _pip_download(f"{name}=={version}", work / "wheel")
        digest = file_sha256(wheel)
        size = wheel.stat().st_size
        staged = work / "tree"
        files = _extract(wheel, staged, select)
        marker = {
            "package": name,
            "version": version,
            "layout": layout,
            "wheel": wheel.name,
            "sha256": digest,
            "wheel_size": size,
            "files": files,
        }
        wheel.unlink()
        publish(staged, final_dir, MARKER, marker, lambda d: is_complete(d, layout))
        seconds = time.monotonic() - start
        detail = f"{wheel.name} ({size / 1e6:.0f} MB) -> {len(files)} files"
        return FetchResult(name, version, final_dir, False, True, seconds, detail)
    except Exception as exc:  # noqa: BLE001 - reported per version
        seconds = time.monotonic() - start
        return FetchResult(name, version, final_dir, False, False, seconds, str(exc))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def fetch_vllm(version: str, root: Path | None = None, force: bool = False) -> FetchResult:
    """Fetch the relevant files of one vLLM release (no-op when already complete)."""
    directory = vllm_source_dir(version, root)
    return _fetch("vllm", version, directory, _VLLM_MEMBER_RE, VLLM_LAYOUT, force)


def fetch_cachetools(version: str, root: Path | None = None, force: bool = False) -> FetchResult:
    """Fetch and extract a whole cachetools wheel (no-op when already complete)."""
    directory = cachetools_dir(version, root)
    return _fetch("cachetools", version, directory, None, WHEEL_LAYOUT, force)


def fetched(result: FetchResult) -> Path:
    """The directory of a fetch that succeeded (or found it complete); else RuntimeError."""
    if not result.ok:
        raise RuntimeError(f"cannot fetch {result.name} {result.version}: {result.detail}")
    return result.directory


def ensure_vllm_sources(version: str, root: Path | None = None) -> Path:
    """Return the source directory of ``version``, fetching it first if needed."""
    return fetched(fetch_vllm(version, root))


def ensure_cachetools(version: str, root: Path | None = None) -> Path:
    """Return the extracted cachetools directory of ``version``, fetching it if needed."""
    return fetched(fetch_cachetools(version, root))


def _dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def fetch_many(
    vllm_versions: Iterable[str],
    cachetools_versions: Iterable[str] = (),
    root: Path | None = None,
    jobs: int = MAX_JOBS,
    force: bool = False,
) -> list[FetchResult]:
    """Fetch several releases with at most ``jobs`` (<= 2) downloads in flight."""
    tasks = [("vllm", v) for v in vllm_versions] + [("cachetools", v) for v in cachetools_versions]
    total = len(tasks)
    counter = 0
    counter_lock = threading.Lock()

    def run(task: tuple[str, str]) -> FetchResult:
        nonlocal counter
        name, version = task
        if name == "vllm":
            result = fetch_vllm(version, root, force)
        else:
            result = fetch_cachetools(version, root, force)
        with counter_lock:
            counter += 1
            index = counter
        state = "skip" if result.skipped else ("ok" if result.ok else "FAIL")
        _log(
            f"[{index:>2}/{total}] {name} {version:<9} {state:<4} "
            f"{result.seconds:6.1f}s  {result.detail}"
        )
        return result

    workers = max(1, min(jobs, MAX_JOBS))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(run, tasks))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "versions", nargs="*", help="vLLM releases to fetch (default: all known releases)"
    )
    parser.add_argument(
        "--cachetools",
        nargs="*",
        default=None,
        metavar="VER",
        help="cachetools versions to fetch (default: all known ones when no vLLM "
        "versions are given)",
    )
    parser.add_argument("--no-vllm", action="store_true", help="fetch no vLLM release")
    parser.add_argument("--root", type=Path, default=None, help="cache root override")
    parser.add_argument("--jobs", type=int, default=MAX_JOBS, help="parallel downloads (<= 2)")
    parser.add_argument("--force", action="store_true", help="re-fetch complete releases")
    args = parser.parse_args(argv)

    vllm_versions: list[str] = [] if args.no_vllm else (args.versions or list(VLLM_VERSIONS))
    if args.cachetools is None:
        ct_versions = [] if args.versions else list(CACHETOOLS_VERSIONS)
    else:
        ct_versions = args.cachetools or list(CACHETOOLS_VERSIONS)

    root = args.root or cache_root()
    start = time.monotonic()
    results = fetch_many(vllm_versions, ct_versions, root, args.jobs, args.force)
    elapsed = time.monotonic() - start
    failed = [r for r in results if not r.ok]
    fetched = sum(1 for r in results if r.ok and not r.skipped)
    skipped = sum(1 for r in results if r.skipped)
    parts = [root / "sources", root / "cachetools"]
    disk = sum(_dir_size(p) for p in parts if p.exists())
    _log(
        f"done in {elapsed:.1f}s: {fetched} fetched, {skipped} already complete, "
        f"{len(failed)} failed; {root}/{{sources,cachetools}} hold {disk / 1e6:.1f} MB"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
