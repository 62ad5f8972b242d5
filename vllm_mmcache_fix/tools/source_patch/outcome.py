"""Exit codes and states of a source-patch operation."""

from __future__ import annotations

import enum

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
