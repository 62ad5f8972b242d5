"""Doc tables derived from the fixes' declarations (``vllm_mmcache_fix/<fix>/owns.py``).

``python -m harness.fix_tables --write`` rewrites the metrics table of ``docs/health.md``;
``tests/unit/test_health_results.py`` fails while it differs from the declarations.
"""

from __future__ import annotations

import argparse

from harness.paths import REPO_ROOT
from vllm_mmcache_fix.metrics import names

HEALTH_DOC = REPO_ROOT / "docs" / "health.md"
BEGIN = "<!-- metrics-table:begin -->"
END = "<!-- metrics-table:end -->"


def metrics_block(text: str) -> str:
    """The text between the markers of ``text`` (without them)."""
    return text[text.index(BEGIN) + len(BEGIN) : text.index(END)].strip("\n")


def with_metrics_table(text: str) -> str:
    head, tail = text[: text.index(BEGIN) + len(BEGIN)], text[text.index(END) :]
    return f"{head}\n{names.markdown_table()}\n{tail}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--write", action="store_true", help="rewrite the table in docs/health.md")
    args = ap.parse_args(argv)
    text = HEALTH_DOC.read_text()
    new = with_metrics_table(text)
    if args.write:
        HEALTH_DOC.write_text(new)
    else:
        print(names.markdown_table())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
