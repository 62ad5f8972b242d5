"""Apply the multimodal LRU fix to vLLM's source files, for images that cannot use plugins.

``patches/`` holds one unified diff per run of vLLM releases whose file patches the same
way, and ``patches/index.json`` says which releases each diff covers, which file it
changes, and the sha256 of that file before and after the patch for every release. This
module finds a vLLM tree without importing vLLM, reads its version, checks that the target
file is exactly the released one, and applies or reverts the diff with ``patch -p1``
(dry run first). Where no ``patch`` program exists the same diff is applied in Python;
either way the result must hash to the recorded patched file, or the original bytes are
put back.

Computing is kept apart from printing: :func:`inspect_tree`, :func:`apply` and
:func:`revert` return an :class:`Outcome`; only ``main`` prints.
"""

from __future__ import annotations

import argparse
import enum
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
INDEX_NAME = "index.json"
PATCHES_ENV = "MMCACHE_FIX_PATCHES_DIR"

# Exit codes of the command line tool.
EXIT_OK = 0
"""Applied, reverted, already in the requested state, or (``--check``) already applied."""
EXIT_ERROR = 1
"""Unexpected failure: no patches directory, unreadable file, ``patch`` crashed."""
EXIT_USAGE = 2
"""Bad command line (argparse)."""
EXIT_NOT_APPLIED = 3
"""``--check`` only: the tree is unpatched and the patch would apply."""
EXIT_NO_VLLM = 4
"""No vLLM tree at the given root, or its version cannot be read."""
EXIT_UNSUPPORTED = 5
"""The vLLM version has no patch and its target file matches no known release."""
EXIT_MISMATCH = 6
"""The target file is neither the released original nor the patched file."""
EXIT_PATCH_FAILED = 7
"""The dry run or the patch itself failed; the tree was left (or put back) unchanged."""


class State(enum.Enum):
    UNPATCHED = "unpatched"
    APPLIED = "applied"


class PatchError(RuntimeError):
    """A diff does not apply to the given text."""


# --------------------------------------------------------------------------- patches dir


def default_patches_dir() -> Path:
    """Where ``index.json`` and the diffs are.

    ``$MMCACHE_FIX_PATCHES_DIR``, else ``vllm_mmcache_fix/patches`` (installed wheel), else
    ``patches/`` next to the package (a checkout or an editable install).
    """
    env = os.environ.get(PATCHES_ENV)
    if env:
        return Path(env).expanduser()
    here = Path(__file__).resolve().parent
    for candidate in (here / "patches", here.parent / "patches"):
        if (candidate / INDEX_NAME).is_file():
            return candidate
    return here.parent / "patches"


@dataclass(frozen=True)
class PatchEntry:
    file: str
    target: str
    versions: tuple[str, ...]
    originals: dict[str, str]
    patched: dict[str, str]
    sha256: str


@dataclass(frozen=True)
class PatchIndex:
    directory: Path
    entries: tuple[PatchEntry, ...]

    def for_version(self, version: str) -> PatchEntry | None:
        for entry in self.entries:
            if version in entry.versions:
                return entry
        return None

    def versions(self) -> list[str]:
        return [v for entry in self.entries for v in entry.versions]

    def diff_path(self, entry: PatchEntry) -> Path:
        return self.directory / entry.file

    def find_by_hash(self, target: str, digest: str) -> tuple[PatchEntry, str, State] | None:
        """The entry and release whose original or patched ``target`` hashes to ``digest``."""
        for entry in self.entries:
            if entry.target != target:
                continue
            for version in entry.versions:
                if entry.originals[version] == digest:
                    return entry, version, State.UNPATCHED
                if entry.patched[version] == digest:
                    return entry, version, State.APPLIED
        return None

    def targets(self) -> list[str]:
        return sorted({entry.target for entry in self.entries})


def load_index(directory: Path | None = None) -> PatchIndex:
    directory = directory or default_patches_dir()
    path = directory / INDEX_NAME
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"no {INDEX_NAME} in {directory}") from None
    if data.get("schema_version") != SCHEMA_VERSION:
        raise ValueError(
            f"{path}: schema_version {data.get('schema_version')!r}, "
            f"this tool reads {SCHEMA_VERSION}"
        )
    entries = tuple(
        PatchEntry(
            file=item["file"],
            target=item["target"],
            versions=tuple(item["versions"]),
            originals=dict(item["original_sha256"]),
            patched=dict(item["patched_sha256"]),
            sha256=item["sha256"],
        )
        for item in data["patches"]
    )
    return PatchIndex(directory, entries)


# --------------------------------------------------------------------------- vLLM tree


def find_vllm_root() -> Path | None:
    """The directory that contains the importable ``vllm`` package, without importing it."""
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        spec = None
    if spec is not None:
        if spec.origin and spec.origin not in ("namespace", "built-in"):
            return Path(spec.origin).resolve().parent.parent
        for location in spec.submodule_search_locations or ():
            return Path(location).resolve().parent
    try:
        located = importlib.metadata.distribution("vllm").locate_file("vllm")
    except importlib.metadata.PackageNotFoundError:
        return None
    path = Path(str(located))
    return path.parent if path.is_dir() else None


_VERSION_ASSIGN = re.compile(
    r"""^(?:__version__|version)\s*(?::\s*str\s*)?=\s*(?:\w+\s*=\s*)*['"]([^'"]+)['"]""",
    re.MULTILINE,
)


def read_vllm_version(root: Path) -> str | None:
    """vLLM's version string as written in the tree, or its distribution metadata."""
    for name in ("_version.py", "version.py"):
        path = root / "vllm" / name
        if path.is_file():
            match = _VERSION_ASSIGN.search(path.read_text(encoding="utf-8", errors="replace"))
            if match:
                return match.group(1)
    for meta in sorted(root.glob("vllm-*.dist-info/METADATA")):
        for line in meta.read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("Version:"):
                return line.split(":", 1)[1].strip()
    return None


def release_of(version: str) -> str:
    """The release a version string builds on.

    ``0.23.0+empty`` -> ``0.23.0``, ``0.24.0.dev5+g1234`` -> ``0.24.0``, ``0.12.0rc1`` ->
    ``0.12.0``.
    """
    public = version.split("+", 1)[0]
    match = re.match(r"\d+(?:\.\d+)*", public)
    return match.group(0) if match else public


def is_final_release(version: str) -> bool:
    return re.fullmatch(r"\d+(?:\.\d+)*", version.split("+", 1)[0]) is not None


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --------------------------------------------------------------------------- diffs in Python


@dataclass
class _Hunk:
    old_start: int
    new_start: int
    old_lines: list[str] = field(default_factory=list)
    new_lines: list[str] = field(default_factory=list)


_HUNK_HEADER = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def parse_unified_diff(diff_text: str) -> tuple[str, list[_Hunk]]:
    """(path after ``b/``, hunks) of a single-file unified diff."""
    lines = diff_text.splitlines(keepends=True)
    target: str | None = None
    hunks: list[_Hunk] = []
    index = 0
    while index < len(lines):
        line = lines[index]
        if line.startswith("+++ ") and target is None:
            name = line[4:].rstrip("\n").split("\t", 1)[0]
            target = name[2:] if name.startswith("b/") else name
            index += 1
            continue
        match = _HUNK_HEADER.match(line)
        if match and target is not None:
            old_count = int(match.group(2) or "1")
            new_count = int(match.group(4) or "1")
            hunk = _Hunk(old_start=int(match.group(1)), new_start=int(match.group(3)))
            index += 1
            while (old_count > 0 or new_count > 0) and index < len(lines):
                body = lines[index]
                tag, text = body[:1], body[1:]
                if tag == " ":
                    hunk.old_lines.append(text)
                    hunk.new_lines.append(text)
                    old_count -= 1
                    new_count -= 1
                elif tag == "-":
                    hunk.old_lines.append(text)
                    old_count -= 1
                elif tag == "+":
                    hunk.new_lines.append(text)
                    new_count -= 1
                elif tag == "\\":
                    pass
                else:
                    raise PatchError(f"malformed hunk line: {body!r}")
                index += 1
            if old_count or new_count:
                raise PatchError("truncated hunk")
            hunks.append(hunk)
            continue
        index += 1
    if target is None or not hunks:
        raise PatchError("not a unified diff")
    return target, hunks


def apply_unified_diff(text: str, diff_text: str, *, reverse: bool = False) -> str:
    """Apply a single-file diff exactly (context must match; offsets allowed, no fuzz)."""
    _, hunks = parse_unified_diff(diff_text)
    lines = text.splitlines(keepends=True)
    out: list[str] = []
    cursor = 0
    offset = 0
    for number, hunk in enumerate(hunks, 1):
        if reverse:
            old, new, start = hunk.new_lines, hunk.old_lines, hunk.new_start
        else:
            old, new, start = hunk.old_lines, hunk.new_lines, hunk.old_start
        # A hunk without old lines inserts after line ``start``; others begin at it.
        anchor = start - 1 if old else start
        position = _find_block(lines, old, anchor + offset, cursor)
        if position is None:
            raise PatchError(f"hunk #{number} does not match")
        offset = position - anchor
        out.extend(lines[cursor:position])
        out.extend(new)
        cursor = position + len(old)
    out.extend(lines[cursor:])
    return "".join(out)


def _find_block(lines: list[str], block: list[str], expected: int, lower: int) -> int | None:
    size = len(block)
    limit = len(lines) - size
    for distance in range(0, len(lines) + 1):
        for position in (expected - distance, expected + distance):
            if lower <= position <= limit and lines[position : position + size] == block:
                return position
        if expected - distance < lower and expected + distance > limit:
            break
    return None


# --------------------------------------------------------------------------- the operation


@dataclass
class Outcome:
    exit_code: int
    message: str
    root: Path | None = None
    version: str | None = None
    release: str | None = None
    target: str | None = None
    patch_file: str | None = None
    state: str | None = None
    details: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "exit_code": self.exit_code,
            "message": self.message,
            "root": str(self.root) if self.root else None,
            "version": self.version,
            "release": self.release,
            "target": self.target,
            "patch_file": self.patch_file,
            "state": self.state,
            "details": self.details,
        }


@dataclass(frozen=True)
class _Resolved:
    root: Path
    version: str
    release: str
    entry: PatchEntry
    target_path: Path
    state: State
    note: str | None


def _resolve(
    root: Path | None, index: PatchIndex, version_override: str | None
) -> _Resolved | Outcome:
    if root is None:
        root = find_vllm_root()
        if root is None:
            return Outcome(EXIT_NO_VLLM, "no installed vllm package found; pass --root")
    root = root.resolve()
    if not (root / "vllm" / "__init__.py").is_file():
        return Outcome(EXIT_NO_VLLM, f"{root} has no vllm/__init__.py", root=root)
    version = version_override or read_vllm_version(root)
    if version is None:
        return Outcome(
            EXIT_NO_VLLM,
            f"cannot read the vLLM version under {root} (no vllm/_version.py, "
            "vllm/version.py or vllm-*.dist-info); pass --vllm-version",
            root=root,
        )
    release = release_of(version)
    base = Outcome(EXIT_OK, "", root=root, version=version, release=release)
    entry = index.for_version(release) if is_final_release(version) else None
    if entry is not None:
        base.target = entry.target
        base.patch_file = entry.file
        target_path = root / entry.target
        if not target_path.is_file():
            base.exit_code = EXIT_MISMATCH
            base.message = f"vLLM {version}: {entry.target} does not exist under {root}"
            return base
        digest = sha256_file(target_path)
        if digest == entry.originals[release]:
            return _Resolved(root, version, release, entry, target_path, State.UNPATCHED, None)
        if digest == entry.patched[release]:
            return _Resolved(root, version, release, entry, target_path, State.APPLIED, None)
        base.exit_code = EXIT_MISMATCH
        base.message = (
            f"vLLM {version}: {entry.target} has sha256 {digest}, expected "
            f"{entry.originals[release]} (as released) or {entry.patched[release]} "
            "(with this patch); the file was modified locally or comes from another build, "
            "refusing to patch it"
        )
        if _mentions_fix(target_path):
            base.details.append(
                "the file already contains vllm-mmcache-fix code, from another version "
                "of this patch or edited after patching"
            )
        return base
    # A pre-release, a local build or a version without its own entry: accept it only when
    # its file is byte-identical to a released one.
    for target in index.targets():
        target_path = root / target
        if not target_path.is_file():
            continue
        found = index.find_by_hash(target, sha256_file(target_path))
        if found is not None:
            hit, same_as, state = found
            note = f"{target} of vLLM {version} is byte-identical to the one of vLLM {same_as}"
            return _Resolved(root, version, same_as, hit, target_path, state, note)
    base.exit_code = EXIT_UNSUPPORTED
    known = index.versions()
    base.message = (
        f"vLLM {version} has no patch (patches cover {known[0]} … {known[-1]}: "
        f"{' '.join(known)}) and its multimodal cache file matches no released one"
    )
    return base


def _mentions_fix(path: Path) -> bool:
    try:
        return "vllm-mmcache-fix" in path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False


def _outcome(resolved: _Resolved, exit_code: int, message: str) -> Outcome:
    out = Outcome(
        exit_code,
        message,
        root=resolved.root,
        version=resolved.version,
        release=resolved.release,
        target=resolved.entry.target,
        patch_file=resolved.entry.file,
        state=resolved.state.value,
    )
    if resolved.note:
        out.details.append(resolved.note)
    return out


def inspect_tree(
    root: Path | None = None,
    *,
    patches_dir: Path | None = None,
    version: str | None = None,
) -> Outcome:
    """Report whether the tree is patched, patchable, or neither. Changes nothing."""
    index = load_index(patches_dir)
    resolved = _resolve(root, index, version)
    if isinstance(resolved, Outcome):
        return resolved
    if resolved.state is State.APPLIED:
        return _outcome(
            resolved, EXIT_OK, f"vLLM {resolved.version}: the fix is applied to {_where(resolved)}"
        )
    return _outcome(
        resolved,
        EXIT_NOT_APPLIED,
        f"vLLM {resolved.version}: {_where(resolved)} is unpatched; "
        f"{resolved.entry.file} applies to it",
    )


def apply(
    root: Path | None = None,
    *,
    patches_dir: Path | None = None,
    version: str | None = None,
    tool: str = "auto",
) -> Outcome:
    """Patch the tree (no-op when already patched)."""
    return _change(root, patches_dir, version, tool, reverse=False)


def revert(
    root: Path | None = None,
    *,
    patches_dir: Path | None = None,
    version: str | None = None,
    tool: str = "auto",
) -> Outcome:
    """Undo the patch (no-op when the tree is unpatched)."""
    return _change(root, patches_dir, version, tool, reverse=True)


def _where(resolved: _Resolved) -> str:
    return str(resolved.root / resolved.entry.target)


def _change(
    root: Path | None, patches_dir: Path | None, version: str | None, tool: str, *, reverse: bool
) -> Outcome:
    index = load_index(patches_dir)
    resolved = _resolve(root, index, version)
    if isinstance(resolved, Outcome):
        return resolved
    wanted = State.UNPATCHED if reverse else State.APPLIED
    if resolved.state is wanted:
        what = "not applied, nothing to revert" if reverse else "already applied, nothing to do"
        return _outcome(resolved, EXIT_OK, f"vLLM {resolved.version}: {_where(resolved)}: {what}")
    diff_path = index.diff_path(resolved.entry)
    if sha256_file(diff_path) != resolved.entry.sha256:
        return _outcome(
            resolved, EXIT_ERROR, f"{diff_path} does not match the sha256 in {INDEX_NAME}"
        )
    expected = resolved.entry.originals if reverse else resolved.entry.patched
    expected_digest = expected[resolved.release]
    original_bytes = resolved.target_path.read_bytes()
    use_patch = tool == "patch" or (tool == "auto" and shutil.which("patch") is not None)
    try:
        if use_patch:
            _run_patch(resolved.root, diff_path, reverse=reverse)
        else:
            _apply_in_python(resolved.target_path, diff_path, reverse=reverse)
    except PatchError as exc:
        _restore(resolved.target_path, original_bytes)
        verb = "revert" if reverse else "apply"
        return _outcome(
            resolved, EXIT_PATCH_FAILED, f"could not {verb} {resolved.entry.file}: {exc}"
        )
    digest = sha256_file(resolved.target_path)
    if digest != expected_digest:
        _restore(resolved.target_path, original_bytes)
        return _outcome(
            resolved,
            EXIT_PATCH_FAILED,
            f"{resolved.entry.target} hashed to {digest} after patching, expected "
            f"{expected_digest}; the original file was put back",
        )
    resolved = _Resolved(
        resolved.root,
        resolved.version,
        resolved.release,
        resolved.entry,
        resolved.target_path,
        wanted,
        resolved.note,
    )
    verb = "reverted" if reverse else "applied"
    how = "patch -p1" if use_patch else "the built-in applier"
    return _outcome(
        resolved,
        EXIT_OK,
        f"vLLM {resolved.version}: {verb} {resolved.entry.file} "
        f"({'from' if reverse else 'to'} {_where(resolved)}) with {how}",
    )


def _run_patch(root: Path, diff_path: Path, *, reverse: bool) -> None:
    base = ["patch", "-p1", "--batch", "--fuzz=0", "--no-backup-if-mismatch", "-i", str(diff_path)]
    base.append("--reverse" if reverse else "--forward")
    for extra in (["--dry-run"], []):
        try:
            proc = subprocess.run(
                [*base, *extra], cwd=root, capture_output=True, text=True, check=False
            )
        except OSError as exc:
            raise PatchError(f"cannot run patch: {exc}") from exc
        if proc.returncode != 0:
            stage = "dry run" if extra else "patch"
            output = (proc.stdout + proc.stderr).strip().replace("\n", " | ")
            raise PatchError(f"{stage} failed (exit {proc.returncode}): {output}")


def _apply_in_python(path: Path, diff_path: Path, *, reverse: bool) -> None:
    text = path.read_bytes().decode("utf-8")
    result = apply_unified_diff(text, diff_path.read_text(encoding="utf-8"), reverse=reverse)
    _write_atomic(path, result.encode("utf-8"))


def _write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        shutil.copymode(path, tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _restore(path: Path, data: bytes) -> None:
    if path.read_bytes() != data:
        _write_atomic(path, data)


# --------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="apply_patch",
        description="Apply the vllm-mmcache-fix source patch to a vLLM tree "
        "(for images that cannot load vLLM plugins).",
    )
    parser.add_argument(
        "--root",
        type=Path,
        default=None,
        help="directory containing vllm/ (a site-packages dir or a vLLM checkout); "
        "default: where the installed vllm package is",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="only report; change nothing")
    mode.add_argument("--revert", action="store_true", help="undo the patch")
    parser.add_argument(
        "--patches-dir", type=Path, default=None, help="directory with index.json and the diffs"
    )
    parser.add_argument(
        "--vllm-version", default=None, help="use this version instead of reading the tree's"
    )
    parser.add_argument(
        "--tool",
        choices=("auto", "patch", "python"),
        default="auto",
        help="apply with patch(1) or the built-in applier (auto: patch if installed)",
    )
    parser.add_argument("--json", action="store_true", help="print the outcome as JSON")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.check:
            outcome = inspect_tree(
                args.root, patches_dir=args.patches_dir, version=args.vllm_version
            )
        elif args.revert:
            outcome = revert(
                args.root, patches_dir=args.patches_dir, version=args.vllm_version, tool=args.tool
            )
        else:
            outcome = apply(
                args.root, patches_dir=args.patches_dir, version=args.vllm_version, tool=args.tool
            )
    except (OSError, ValueError, KeyError) as exc:
        outcome = Outcome(EXIT_ERROR, f"{type(exc).__name__}: {exc}")
    if args.json:
        print(json.dumps(outcome.as_dict(), indent=2))
    else:
        stream = sys.stdout if outcome.exit_code in (EXIT_OK, EXIT_NOT_APPLIED) else sys.stderr
        print(f"vllm-mmcache-fix: {outcome.message}", file=stream)
        for line in outcome.details:
            print(f"  {line}", file=stream)
    return outcome.exit_code
