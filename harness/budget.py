"""A time budget for the long resumable programs (the matrix, the topologies): a unit of
work (a release, a run) starts only when its expected minutes fit in what is left."""

from __future__ import annotations

import argparse
import time


def add_options(ap: argparse.ArgumentParser, unit_option: str, default: float, help: str) -> None:
    """``--budget-minutes`` (none by default) and ``unit_option``, the expected minutes of
    one unit of work."""
    ap.add_argument("--budget-minutes", type=float, default=None)
    ap.add_argument(unit_option, type=float, default=default, help=help)


class Budget:
    """``minutes`` from now on (no limit when None)."""

    def __init__(self, minutes: float | None) -> None:
        self.deadline = None if minutes is None else time.monotonic() + minutes * 60

    def fits(self, minutes: float) -> bool:
        """Whether ``minutes`` more end before the budget does."""
        return self.deadline is None or time.monotonic() + minutes * 60 <= self.deadline
