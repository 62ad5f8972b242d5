"""``vllm-mmcache-fix check`` where vLLM is not installed (the test environment itself)."""

from __future__ import annotations

import sys

from harness.paths import REPO_ROOT
from harness.venvs import check_report


def test_without_vllm_says_so_and_fails() -> None:
    rc, report, _ = check_report(sys.executable, extra_path=str(REPO_ROOT))
    assert rc == 2
    assert report["verdict"] == "no vllm"
    assert "not installed" in report["summary"]
