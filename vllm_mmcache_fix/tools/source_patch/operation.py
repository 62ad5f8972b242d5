"""Check, apply and revert the patch on a vLLM tree; returns an ``Outcome``, prints nothing.

A change runs as one sequence under an exclusive lock on the target's directory (``flock``,
so a second run, in this process or another, waits for the first): read the file, make the
new content in memory or in a scratch directory, check its sha256 against the index, then
write it next to the target, ``fsync`` it, rename it over the target and ``fsync`` the
directory. Nothing is written before the result is known to be right, so a failure never
has anything to put back, and a run that lost a race finds the winner's file and has
nothing to do.

A target reached through a symlink (Nix, Bazel, ``pip --target`` layouts) is refused by
both appliers, for apply and revert alike, unless ``follow_symlinks``: then the file the
link points to is changed and the link stays.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import exits
from ..exits import Verdict
from .diff import apply_unified_diff
from .index import PatchEntry, PatchIndex, load_index
from .outcome import INDEX_NAME, PatchError, State
from .tree import (
    find_vllm_root,
    is_final_release,
    read_vllm_version,
    reinstall_advice,
    release_of,
    sha256_file,
)

if TYPE_CHECKING:
    from typing_extensions import TypedDict, Unpack

    class PatchOptions(TypedDict, total=False):
        """The keyword options of :func:`apply` that :func:`revert` takes too."""

        patches_dir: Path | None
        version: str | None
        tool: str
        follow_symlinks: bool


LOCK_TIMEOUT_S = 120.0
"""How long a run waits for another run on the same tree before giving up."""

PLUGIN_NOTE = (
    "the vllm-mmcache-fix plugin needs no file to match: install it instead (README: Install)"
)

# --------------------------------------------------------------------------- the operation


@dataclass
class Outcome:
    verdict: Verdict
    message: str
    root: Path | None = None
    version: str | None = None
    """The installed vLLM's version, as read (or given by ``--vllm-version``)."""
    release: str | None = None
    """The release the version builds on (``0.23.0+cpu`` and ``0.23.0rc1``: ``0.23.0``)."""
    target: str | None = None
    """The file the patch changes, relative to ``root``."""
    patch_file: str | None = None
    state: str | None = None
    """``unpatched`` or ``applied``: what the file was found to be."""
    symlink_to: str | None = None
    """Where the target's symlink points, when it is reached through one."""
    details: list[str] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        return self.verdict.code.code

    def as_dict(self) -> dict[str, Any]:
        return exits.record_envelope("patch", self, root=str(self.root) if self.root else None)


@dataclass(frozen=True)
class _Resolved:
    root: Path
    version: str
    release: str
    entry: PatchEntry
    target_path: Path
    """``root / entry.target`` as the tree names it (may be a symlink)."""
    real_path: Path
    """The file itself, every symlink resolved."""
    state: State
    note: str | None

    @property
    def via_symlink(self) -> bool:
        return self.real_path != self.target_path


def _real(path: Path) -> Path:
    return Path(os.path.realpath(path))


def _resolve(
    root: Path | None, index: PatchIndex, version_override: str | None
) -> _Resolved | Outcome:
    if root is None:
        root = find_vllm_root()
        if root is None:
            return Outcome(Verdict.NO_VLLM, "no installed vllm package found; pass --root")
    root = Path(os.path.abspath(root))  # symlinks kept: see _Resolved.via_symlink
    if not (root / "vllm" / "__init__.py").is_file():
        return Outcome(Verdict.NO_VLLM, f"{root} has no vllm/__init__.py", root=root)
    version = version_override or read_vllm_version(root)
    if version is None:
        return Outcome(
            Verdict.NO_VLLM,
            f"cannot read the vLLM version under {root} (no vllm/_version.py, "
            "vllm/version.py or vllm-*.dist-info); pass --vllm-version",
            root=root,
        )
    release = release_of(version)
    base = Outcome(Verdict.APPLIED, "", root=root, version=version, release=release)
    entry = index.for_version(release) if is_final_release(version) else None
    if entry is not None:
        base.target = entry.target
        base.patch_file = entry.file
        target_path = root / entry.target
        if not target_path.is_file():
            base.verdict = Verdict.PATCH_REFUSED
            base.message = f"vLLM {version}: {entry.target} does not exist under {root}"
            base.details.append(
                f"next step: check that {root} is the vLLM {release} install that runs "
                f"(pass --root), or {PLUGIN_NOTE}"
            )
            return base
        digest = sha256_file(target_path)
        if digest == entry.originals[release]:
            return _made(root, version, release, entry, target_path, State.UNPATCHED, None)
        if digest == entry.patched[release]:
            return _made(root, version, release, entry, target_path, State.APPLIED, None)
        base.verdict = Verdict.PATCH_REFUSED
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
        base.details.append(
            f"next step: put the released file back with "
            f"{reinstall_advice(root, version, release)}, then run "
            f"`vllm-mmcache-fix patch apply` again; or {PLUGIN_NOTE}"
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
            return _made(root, version, same_as, hit, target_path, state, note)
    base.verdict = Verdict.PATCH_REFUSED
    known = index.versions()
    base.message = (
        f"vLLM {version} has no patch (patches cover {known[0]} … {known[-1]}: "
        f"{' '.join(known)}) and its multimodal cache file matches no released one"
    )
    base.details.append(f"next step: {PLUGIN_NOTE}")
    return base


def _made(
    root: Path,
    version: str,
    release: str,
    entry: PatchEntry,
    target_path: Path,
    state: State,
    note: str | None,
) -> _Resolved:
    return _Resolved(root, version, release, entry, target_path, _real(target_path), state, note)


def _mentions_fix(path: Path) -> bool:
    try:
        return "vllm-mmcache-fix" in path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False


def _outcome(resolved: _Resolved, verdict: Verdict, message: str) -> Outcome:
    out = Outcome(
        verdict,
        message,
        root=resolved.root,
        version=resolved.version,
        release=resolved.release,
        target=resolved.entry.target,
        patch_file=resolved.entry.file,
        state=resolved.state.value,
        symlink_to=str(resolved.real_path) if resolved.via_symlink else None,
    )
    if resolved.note:
        out.details.append(resolved.note)
    if resolved.via_symlink:
        out.details.append(f"{resolved.target_path} is a symlink to {resolved.real_path}")
    return out


def inspect_tree(
    root: Path | None = None,
    *,
    patches_dir: Path | None = None,
    version: str | None = None,
    plugin_protects: str | None = None,
) -> Outcome:
    """Report whether the tree is patched, patchable, or neither. Changes nothing.

    ``plugin_protects``: why the installed plugin protects this vLLM without the patch (the
    caller's finding), or None; an unpatched tree is then ``not_needed`` rather than
    ``unpatched``."""
    index = load_index(patches_dir)
    resolved = _resolve(root, index, version)
    if isinstance(resolved, Outcome):
        return resolved
    if resolved.state is State.APPLIED:
        return _outcome(
            resolved,
            Verdict.APPLIED,
            f"vLLM {resolved.version}: the fix is applied to {_where(resolved)}",
        )
    if plugin_protects:
        out = _outcome(
            resolved,
            Verdict.NOT_NEEDED,
            f"vLLM {resolved.version}: not needed: the plugin is active ({plugin_protects}); "
            f"{_where(resolved)} is unpatched",
        )
        out.details.append(
            "`vllm-mmcache-fix check` confirms it on this vLLM's layout; the source patch is "
            "for images that cannot load the plugin"
        )
        return out
    out = _outcome(
        resolved,
        Verdict.UNPATCHED,
        f"vLLM {resolved.version}: {_where(resolved)} is unpatched; "
        f"{resolved.entry.file} applies to it",
    )
    out.details.append(
        "next step: `vllm-mmcache-fix patch apply` (or install the plugin, README: Install)"
    )
    return out


def apply(
    root: Path | None = None,
    *,
    patches_dir: Path | None = None,
    version: str | None = None,
    tool: str = "auto",
    follow_symlinks: bool = False,
    reverse: bool = False,
) -> Outcome:
    """Patch the tree (no-op when already patched); with ``reverse``, undo the patch (no-op
    when the tree is unpatched), as :func:`revert` does."""
    return _change(root, patches_dir, version, tool, follow_symlinks, reverse=reverse)


def revert(root: Path | None = None, **options: Unpack[PatchOptions]) -> Outcome:
    """Undo the patch (no-op when the tree is unpatched): :func:`apply` with ``reverse``.
    The options are :func:`apply`'s (a misspelt one fails type checking)."""
    return apply(root, reverse=True, **options)


def _where(resolved: _Resolved) -> str:
    return str(resolved.root / resolved.entry.target)


def _change(
    root: Path | None,
    patches_dir: Path | None,
    version: str | None,
    tool: str,
    follow_symlinks: bool,
    *,
    reverse: bool,
) -> Outcome:
    index = load_index(patches_dir)
    first = _resolve(root, index, version)
    if isinstance(first, Outcome):
        return first
    try:
        with _exclusive(first.real_path.parent):
            # Again under the lock: another run may have changed the file meanwhile.
            resolved = _resolve(root, index, version)
            if isinstance(resolved, Outcome):
                return resolved
            return _change_locked(index, resolved, tool, follow_symlinks, reverse=reverse)
    except _LockTimeout as exc:
        return _outcome(first, Verdict.ERROR, str(exc))


def _change_locked(
    index: PatchIndex, resolved: _Resolved, tool: str, follow_symlinks: bool, *, reverse: bool
) -> Outcome:
    verb = "revert" if reverse else "apply"
    done = Verdict.REVERTED if reverse else Verdict.APPLIED
    wanted = State.UNPATCHED if reverse else State.APPLIED
    if resolved.state is wanted:
        what = "not applied, nothing to revert" if reverse else "already applied, nothing to do"
        return _outcome(resolved, done, f"vLLM {resolved.version}: {_where(resolved)}: {what}")
    if resolved.via_symlink and not follow_symlinks:
        out = _outcome(
            resolved,
            Verdict.PATCH_REFUSED,
            f"vLLM {resolved.version}: {_where(resolved)} is a symlink to "
            f"{resolved.real_path}; refusing to {verb} through it (the link would be "
            "replaced by a regular file)",
        )
        out.details.append(
            f"next step: pass --follow-symlinks to {verb} the patch to {resolved.real_path} "
            "itself (the link stays; every tree that links to that file sees the change), or "
            f"{PLUGIN_NOTE}"
        )
        return out
    diff_path = index.diff_path(resolved.entry)
    if sha256_file(diff_path) != resolved.entry.sha256:
        return _outcome(
            resolved, Verdict.ERROR, f"{diff_path} does not match the sha256 in {INDEX_NAME}"
        )
    expected = (resolved.entry.originals if reverse else resolved.entry.patched)[resolved.release]
    use_patch = tool == "patch" or (tool == "auto" and shutil.which("patch") is not None)
    try:
        if use_patch:
            new = _patched_with_patch(resolved.real_path, diff_path, reverse=reverse)
        else:
            new = _patched_in_python(resolved.real_path, diff_path, reverse=reverse)
    except PatchError as exc:
        return _outcome(
            resolved,
            Verdict.PATCH_FAILED,
            f"could not {verb} {resolved.entry.file}: {exc}; {resolved.entry.target} is unchanged",
        )
    import hashlib

    digest = hashlib.sha256(new).hexdigest()
    if digest != expected:
        return _outcome(
            resolved,
            Verdict.PATCH_FAILED,
            f"{verb} of {resolved.entry.file} gave sha256 {digest}, expected {expected}; "
            f"{resolved.entry.target} is unchanged",
        )
    try:
        _write_durably(resolved.real_path, new)
    except OSError as exc:
        return _outcome(
            resolved,
            Verdict.ERROR,
            f"cannot write {resolved.real_path}: {exc.strerror or exc}; it is unchanged",
        )
    now = _Resolved(
        resolved.root,
        resolved.version,
        resolved.release,
        resolved.entry,
        resolved.target_path,
        resolved.real_path,
        wanted,
        resolved.note,
    )
    how = "patch(1)" if use_patch else "the built-in applier"
    return _outcome(
        now,
        done,
        f"vLLM {now.version}: {'reverted' if reverse else 'applied'} {now.entry.file} "
        f"({'from' if reverse else 'to'} {_where(now)}) with {how}",
    )


# --------------------------------------------------------------------------- appliers


def _patched_with_patch(path: Path, diff_path: Path, *, reverse: bool) -> bytes:
    """The new content, made by ``patch`` into a scratch directory (the target is only read)."""
    with tempfile.TemporaryDirectory(prefix="mmcache-fix-patch-") as scratch:
        out = Path(scratch) / path.name
        cmd = [
            "patch",
            "--batch",
            "--fuzz=0",
            "--no-backup-if-mismatch",
            "--reverse" if reverse else "--forward",
            "-o",
            str(out),
            "-i",
            str(diff_path),
            str(path),
        ]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=scratch)
        except OSError as exc:
            raise PatchError(f"cannot run patch: {exc}") from exc
        if proc.returncode != 0:
            output = (proc.stdout + proc.stderr).strip().replace("\n", " | ")
            raise PatchError(f"patch failed (exit {proc.returncode}): {output}")
        return out.read_bytes()


def _patched_in_python(path: Path, diff_path: Path, *, reverse: bool) -> bytes:
    text = path.read_bytes().decode("utf-8")
    return apply_unified_diff(text, diff_path.read_text(encoding="utf-8"), reverse=reverse).encode(
        "utf-8"
    )


def _write_durably(path: Path, data: bytes) -> None:
    """Replace ``path`` (a regular file) with ``data``: a synced file renamed over it, then the
    directory synced, so a crash leaves the old file or the new one, never an empty one."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            shutil.copymode(path, tmp)
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    directory = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


# --------------------------------------------------------------------------- the lock


class _LockTimeout(RuntimeError):
    pass


@contextlib.contextmanager
def _exclusive(directory: Path, timeout: float = LOCK_TIMEOUT_S) -> Iterator[None]:
    """``flock`` on the target's directory: one run at a time per tree, whatever the process.

    The directory, not the file: the file is replaced by a rename, and a lock on the old
    file would not exclude a run that opened the new one."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
            if time.monotonic() >= deadline:
                raise _LockTimeout(
                    f"another `vllm-mmcache-fix patch` has been changing {directory} for "
                    f"{timeout:g} s; nothing was changed, try again when it is done"
                )
            time.sleep(0.05)
        yield
    finally:
        os.close(fd)  # releases the lock
