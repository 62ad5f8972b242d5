"""Apply the multimodal LRU fix to vLLM's source files, for images that cannot use plugins.

``patches/`` holds one unified diff per run of vLLM releases whose file patches the same
way, and ``patches/index.json`` says which releases each diff covers, which file it
changes, and the sha256 of that file before and after the patch for every release. This
module finds a vLLM tree without importing vLLM, reads its version, checks that the target
file is exactly the released one, and applies or reverts the diff with ``patch -p1``
into a scratch directory. Where no ``patch`` program exists the same diff is applied in
Python; either way the result must hash to the recorded file before it replaces the target
(one lock, a synced file, an atomic rename: ``operation.py``).

Computing is kept apart from printing: :func:`inspect_tree`, :func:`apply` and
:func:`revert` return an :class:`Outcome`; ``vllm-mmcache-fix patch`` (tools/cli.py)
prints it.
"""

from __future__ import annotations

from ..exits import Verdict
from .diff import apply_unified_diff, parse_unified_diff
from .index import PatchEntry, PatchIndex, default_patches_dir, load_index
from .operation import Outcome, apply, inspect_tree, revert
from .outcome import (
    EXIT_ERROR,
    EXIT_MISMATCH,
    EXIT_NO_VLLM,
    EXIT_NOT_APPLIED,
    EXIT_OK,
    EXIT_PATCH_FAILED,
    EXIT_UNSUPPORTED,
    EXIT_USAGE,
    INDEX_NAME,
    PATCHES_ENV,
    SCHEMA_VERSION,
    PatchError,
    State,
)
from .tree import find_vllm_root, is_final_release, read_vllm_version, release_of, sha256_file

__all__ = [
    "EXIT_ERROR",
    "EXIT_MISMATCH",
    "EXIT_NOT_APPLIED",
    "EXIT_NO_VLLM",
    "EXIT_OK",
    "EXIT_PATCH_FAILED",
    "EXIT_UNSUPPORTED",
    "EXIT_USAGE",
    "INDEX_NAME",
    "PATCHES_ENV",
    "SCHEMA_VERSION",
    "Outcome",
    "PatchEntry",
    "PatchError",
    "PatchIndex",
    "State",
    "Verdict",
    "apply",
    "apply_unified_diff",
    "default_patches_dir",
    "find_vllm_root",
    "inspect_tree",
    "is_final_release",
    "load_index",
    "parse_unified_diff",
    "read_vllm_version",
    "release_of",
    "revert",
    "sha256_file",
]
