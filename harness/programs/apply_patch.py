"""Apply, check or revert the vllm-mmcache-fix source patch on a vLLM tree.

    scripts/apply-patch apply           # patch the vllm that this Python imports
    scripts/apply-patch                 # report only (exit 3: not applied yet)
    scripts/apply-patch revert          # undo
    scripts/apply-patch apply --root /opt/venv/lib/python3.12/site-packages

The work is done by :mod:`vllm_mmcache_fix.tools.source_patch` of this checkout; exit codes
are its ``EXIT_*`` constants. vLLM itself is never imported. An installed plugin has
the same as ``vllm-mmcache-fix patch``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from vllm_mmcache_fix.tools import cli


def main(argv: Sequence[str] | None = None) -> int:
    return cli.main(["patch", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
