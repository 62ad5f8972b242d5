"""Find a vLLM tree without importing vLLM and read its version."""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import re
from pathlib import Path

# --------------------------------------------------------------------------- vLLM tree


def find_vllm_root() -> Path | None:
    """The directory that contains the importable ``vllm`` package, without importing it.

    The path as Python imports it, symlinks kept: in a tree of symlinks (Bazel runfiles, a
    Nix profile) the tree is the root, and a target file that is a link into a store is
    then seen as one (and refused unless followed on purpose)."""
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        spec = None
    if spec is not None:
        if spec.origin and spec.origin not in ("namespace", "built-in"):
            return Path(os.path.abspath(spec.origin)).parent.parent
        for location in spec.submodule_search_locations or ():
            return Path(os.path.abspath(location)).parent
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
