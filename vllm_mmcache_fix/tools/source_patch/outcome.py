"""Verdicts, exit codes and states of a source-patch operation."""

from __future__ import annotations

import enum

from ...core.settings import ENV_PATCHES_DIR
from .. import exits

SCHEMA_VERSION = 1
"""Version of ``patches/index.json`` (the ``--json`` output's is ``exits.JSON_SCHEMA_VERSION``)."""
INDEX_NAME = "index.json"
PATCHES_ENV = ENV_PATCHES_DIR

# Exit codes of ``vllm-mmcache-fix patch``: the command line's one table (tools/exits.py).
EXIT_OK = exits.OK.code
"""Applied, reverted, already in the requested state, or not needed."""
EXIT_ERROR = exits.ERROR.code
"""Unexpected failure: no patches directory, unreadable file, ``patch`` crashed."""
EXIT_USAGE = exits.USAGE.code
"""Bad command line (argparse)."""
EXIT_NOT_APPLIED = exits.UNPROTECTED.code
"""``patch check``: the tree is unpatched and the plugin does not protect it."""
EXIT_NO_VLLM = exits.NO_VLLM.code
"""No vLLM tree at the given root, or its version cannot be read."""
EXIT_UNSUPPORTED = exits.PATCH_REFUSED.code
"""The vLLM version has no patch and its target file matches no known release."""
EXIT_MISMATCH = exits.PATCH_REFUSED.code
"""The target file is neither the released original nor the patched file (or a symlink)."""
EXIT_PATCH_FAILED = exits.PATCH_FAILED.code
"""The patch itself failed; the tree was left unchanged."""


class State(enum.Enum):
    UNPATCHED = "unpatched"
    APPLIED = "applied"


class PatchError(RuntimeError):
    """A diff does not apply to the given text."""
