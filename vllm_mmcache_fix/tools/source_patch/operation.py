"""Check, apply and revert the patch on a vLLM tree; returns an ``Outcome``, prints nothing."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .diff import apply_unified_diff
from .index import PatchEntry, PatchIndex, load_index
from .outcome import (
    EXIT_ERROR,
    EXIT_MISMATCH,
    EXIT_NO_VLLM,
    EXIT_NOT_APPLIED,
    EXIT_OK,
    EXIT_PATCH_FAILED,
    EXIT_UNSUPPORTED,
    INDEX_NAME,
    SCHEMA_VERSION,
    PatchError,
    State,
)
from .tree import find_vllm_root, is_final_release, read_vllm_version, release_of, sha256_file

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
