#!/usr/bin/env python3
"""Apply, check or revert the vllm-mmcache-fix source patch on a vLLM tree.

    python3 scripts/apply_patch.py                 # patch the installed vllm
    python3 scripts/apply_patch.py --check         # report only (exit 3: not applied yet)
    python3 scripts/apply_patch.py --revert        # undo
    python3 scripts/apply_patch.py --root /opt/venv/lib/python3.12/site-packages

The work is done by :mod:`vllm_mmcache_fix.tools.source_patch`; exit codes are its ``EXIT_*``
constants. vLLM itself is never imported.
"""

from __future__ import annotations

import sys
from pathlib import Path

try:
    from vllm_mmcache_fix.tools.cli import main
except ImportError:
    # Run from a checkout without installing the package.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from vllm_mmcache_fix.tools.cli import main

if __name__ == "__main__":
    sys.exit(main(["patch", *sys.argv[1:]]))
