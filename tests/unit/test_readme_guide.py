"""The README's deployment guide has every step the installed tier runs."""

from __future__ import annotations

from harness.readme import guide_blocks


def test_guide_has_every_step() -> None:
    assert set(guide_blocks()) == {
        "build-wheel",
        "install-offline",
        "gate",
        "dockerfile",
        "plugins-filter",
        "confirm-logs",
        "source-patch",
    }
