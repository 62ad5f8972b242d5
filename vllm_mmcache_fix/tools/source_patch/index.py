"""``patches/index.json``: which diff covers which release, with the file hashes."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from .outcome import INDEX_NAME, PATCHES_ENV, SCHEMA_VERSION, State

# --------------------------------------------------------------------------- patches dir


def default_patches_dir() -> Path:
    """Where ``index.json`` and the diffs are.

    ``$MMCACHE_FIX_PATCHES_DIR``, else ``vllm_mmcache_fix/patches`` (installed wheel), else
    ``patches/`` next to the package (a checkout or an editable install).
    """
    env = os.environ.get(PATCHES_ENV)
    if env:
        return Path(env).expanduser()
    package = Path(__file__).resolve().parents[2]  # vllm_mmcache_fix/
    for candidate in (package / "patches", package.parent / "patches"):
        if (candidate / INDEX_NAME).is_file():
            return candidate
    return package.parent / "patches"


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
