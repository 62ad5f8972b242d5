"""The plugin's version wherever an operator looks: ``--version``, ``check``, the
``active in`` line, ``mmcache_fix_build_info`` on ``/metrics``, the wheel's metadata and
the CHANGELOG."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

import vllm_mmcache_fix
from harness.paths import REPO_ROOT
from vllm_mmcache_fix import _version
from vllm_mmcache_fix.lru_eviction.probe import Exposure
from vllm_mmcache_fix.lru_eviction.report import active_line
from vllm_mmcache_fix.metrics import names as n

VERSION = vllm_mmcache_fix.__version__


def test_the_version_names_the_next_release_and_the_commit() -> None:
    """Between releases every build says which commit it is (``0.3.0.dev0+g<commit>``); the
    release it leads to is the CHANGELOG's first heading."""
    base = _version.BASE
    release = re.fullmatch(r"(\d+\.\d+\.\d+)(\.dev\d+)?", base)
    assert release, base
    text = (REPO_ROOT / "CHANGELOG.md").read_text()
    headings = re.findall(r"^## (\S+)", text, re.M)
    assert headings and headings[0] == release.group(1), headings
    head = subprocess.run(
        ["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    if release.group(2) and head:
        assert VERSION == f"{base}+g{head[:9]}"
        assert _version.commit(str(REPO_ROOT)) == head
    else:
        assert VERSION == base


def test_a_tree_without_git_is_the_base_version(tmp_path) -> None:
    (tmp_path / "pyproject.toml").write_text("")
    assert _version.commit(str(tmp_path)) is None
    assert _version.of_checkout(str(tmp_path)) == _version.BASE


def test_a_checkout_with_packed_refs(tmp_path) -> None:
    sha = "0123456789abcdef0123456789abcdef01234567"
    (tmp_path / "pyproject.toml").write_text("")
    git = tmp_path / ".git"
    git.mkdir()
    (git / "HEAD").write_text("ref: refs/heads/main\n")
    (git / "packed-refs").write_text(f"# pack-refs with: peeled\n{sha} refs/heads/main\n")
    assert _version.commit(str(tmp_path)) == sha
    (git / "HEAD").write_text(sha + "\n")  # detached
    assert _version.commit(str(tmp_path)) == sha


def test_the_active_line_names_the_plugin_version() -> None:
    line = active_line("M.get_lru_cache", "m.py (0.31+)", Exposure(True, True))
    assert line.startswith("active in ")
    assert f"vllm-mmcache-fix {VERSION}:" in line


def test_build_info_on_metrics() -> None:
    prom = pytest.importorskip("prometheus_client")
    from vllm_mmcache_fix.metrics.exporter import Exporter

    exporter = Exporter(lambda: {"protected": 1}, lambda: None, lambda exc: None)
    try:
        exporter.start()
        text = prom.generate_latest(prom.REGISTRY).decode()
    finally:
        exporter.unregister()
    # vLLM is not imported here: its version reads "unknown".
    assert f'{n.BUILD_INFO}{{version="{VERSION}",vllm_version="unknown"}} 1.0' in text


MULTIPROCESS = r"""
from vllm_mmcache_fix.metrics.exporter import Exporter
exporter = Exporter(lambda: {"protected": 1}, lambda: None, print)
exporter.start()
exporter.stop()
"""

READ = r"""
import prometheus_client as prom
from prometheus_client import multiprocess
registry = prom.CollectorRegistry()
multiprocess.MultiProcessCollector(registry)
print(prom.generate_latest(registry).decode())
"""


def test_build_info_with_two_api_servers_is_one(tmp_path) -> None:
    pytest.importorskip("prometheus_client")
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "PYTHONPATH": str(REPO_ROOT)}
    for _ in range(2):
        subprocess.run([sys.executable, "-c", MULTIPROCESS], env=env, check=True, timeout=60)
    text = subprocess.run(
        [sys.executable, "-c", READ],
        env=env,
        check=True,
        timeout=60,
        capture_output=True,
        text=True,
    ).stdout
    assert f'{n.BUILD_INFO}{{version="{VERSION}",vllm_version="unknown"}} 1.0' in text, text


def test_check_prints_the_version() -> None:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("MMCACHE_FIX_", "MMCACHE_HARNESS_"))
    }
    env["PYTHONPATH"] = str(REPO_ROOT)
    done = subprocess.run(
        [sys.executable, "-m", "vllm_mmcache_fix", "check", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd="/",
        check=False,
    )
    assert json.loads(done.stdout)["tool_version"] == VERSION
