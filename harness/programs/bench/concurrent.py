"""Cost of the plugin under concurrent load: ``scripts/bench-concurrent``.

:mod:`harness.programs.concurrent` with ``--bench``: on one venv, the server without and with
the plugin alternated ``--rounds`` times (same seed, same settings) on the clean plan
(new and reused images, nothing rejected), then on the mixed plan; prints the median
ratios (with / without) of throughput and of p50/p99 latency. A benchmark, not a test.

Usage::

    scripts/bench-concurrent --version 0.32.0 --rounds 3 --requests 300 --jsonl bench.jsonl
"""

from __future__ import annotations

import sys

from harness.programs import concurrent


def main(argv: list[str] | None = None) -> int:
    return concurrent.main(argv, bench=True)


if __name__ == "__main__":
    sys.exit(main())
