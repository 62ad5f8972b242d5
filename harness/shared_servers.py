"""Real servers shared by tests: one per (release, settings), and the watched 0.23.0 replays.

A server start costs a minute or more on two cores, so the e2e tests whose workload
leaves the server as it found it share one (:data:`SHARED`): :class:`SharedServers`
keeps at most one running, keyed by (release, kind), under the server lock, and hands
out item indices no test has sent yet (:meth:`SharedServers.new_items`), so a test never
meets another's cache entries. ``tests/e2e/conftest.py`` makes the fixtures of it.

:func:`watched_replay` is one incident replay on 0.23.0 with ``/health`` polled all
along; several tests read the same replay.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from harness import runner
from harness.http import free_port, http_get
from harness.lock import ServerLock
from harness.paths import REPO_ROOT
from harness.payloads import mm_limits_args
from harness.programs import incident
from harness.programs.health import HealthPoller, scrape
from harness.readme import guide_blocks
from harness.venvs import complete_venv, e2e_versions, set_plugin
from vllm_mmcache_fix.core.settings import ENV_HEALTH_TIMEOUT

SHARED = ("plugin", "noplugin")
"""``plugin``: the plugin loaded with its defaults; ``noplugin``: installed, kept out."""

ITEM_BLOCK = 100_000
"""Item indices each test gets: ``[base, base + ITEM_BLOCK)``, a new base every time."""


def shared_spec(venv: Path, kind: str) -> runner.ServerSpec:
    """Up to two images and one video per prompt: every shared workload fits."""
    if kind not in SHARED:
        raise ValueError(f"unknown shared server {kind!r}; known: {SHARED}")
    return runner.ServerSpec(
        venv, args=mm_limits_args(images=2, videos=1), plugin=kind == "plugin", name="shared"
    )


class SharedServers:
    """At most one running server, keyed by (release, kind), under the server lock."""

    def __init__(self, wheel: Path) -> None:
        self.wheel = wheel
        self.key: tuple[str, str] | None = None
        self.session: runner.Session | None = None
        self.lock = ServerLock()
        self._bases = itertools.count(1)

    def __call__(self, version: str, kind: str) -> runner.Session:
        if version not in e2e_versions():
            pytest.skip(f"{version} not in MMCACHE_HARNESS_E2E_VERSIONS")
        if self.key == (version, kind) and self.session is not None and self.session.running:
            return self.session
        self.close()
        venv = complete_venv(version)
        self.lock.acquire(purpose=f"shared e2e server {version} {kind}")
        try:
            set_plugin(venv, self.wheel)
            session = runner.Session(shared_spec(venv, kind), lock=self.lock)
            self.session, self.key = session, (version, kind)
            session.start()
        except BaseException:
            self.close()
            raise
        return session

    def new_items(self) -> int:
        """The first of :data:`ITEM_BLOCK` item indices no test has sent yet."""
        return next(self._bases) * ITEM_BLOCK

    def close(self) -> None:
        """Stop the running server, if any, and give the lock back."""
        session, self.session, self.key = self.session, None, None
        try:
            if session is not None:
                session.stop()
        finally:
            self.lock.release()


def server_order(item: pytest.Item) -> tuple[int, int, int]:
    """Where an e2e test runs: the shared servers' tests first, by release and in
    :data:`SHARED` order (a test marks its kind with ``@pytest.mark.shared_server(kind)``);
    then every other test in the order it was collected, so that a module whose servers are
    its own (a module-scoped fixture) runs in one piece and starts them once."""
    marker = item.get_closest_marker("shared_server")
    if marker is None:
        return 1, 0, 0
    versions = e2e_versions()
    params = getattr(item, "callspec", None)
    version = params.params.get("version") if params is not None else None
    rank = versions.index(version) if version in versions else len(versions)
    return 0, rank, SHARED.index(marker.args[0])


# ----------------------------------------------------------------------------- 0.23.0 replays

FREEZE_VERSION = "0.23.0"
"""The release whose replay freezes EngineCore without the eviction fix (0.24+ shows a 500)."""
HEALTH_TIMEOUT_S = 5.0
"""The plugin's floor (``MIN_HEALTH_TIMEOUT``): a shorter value falls back to the default."""
STALL_SECONDS = 3.0
MARGIN_S = 5.0
MIN_POLLS = 12


@dataclass
class WatchedReplay:
    """One incident replay on 0.23.0 with ``/health`` polled every 0.5 s meanwhile; the
    inspection after the load holds a slow ``/health``, ``/metrics`` and, when asked for,
    ``vllm-mmcache-fix diagnose`` of the API server."""

    result: incident.RunResult
    poller: HealthPoller

    def polls(self) -> list[tuple[float, int | None, float]]:
        """The polls from the server's first 200 to the end of the inspection."""
        inspection = self.result.inspection
        end = inspection["end"] if isinstance(inspection, dict) else float("inf")
        return [p for p in self.poller.answered() if p[0] <= end]

    def report(self) -> str:
        polls = ", ".join(f"{s}" for _, s, _ in self.polls())
        return (
            "\n"
            + incident.format_result(self.result)
            + f"\n/health polls: {polls}\n{self.result.inspection}"
        )


def diagnose(server_pid: int) -> dict[str, Any]:
    """What an on-call engineer runs: ``vllm-mmcache-fix diagnose --pid <API server>``."""
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_mmcache_fix", "diagnose", "--pid", str(server_pid), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(REPO_ROOT),
    )
    return {"rc": proc.returncode, "report": proc.stdout, "stderr": proc.stderr[-2000:]}


def status_cli(venv: Path, base: str, timeout: float) -> dict[str, Any]:
    """The README's ``status --url`` line, run from ``venv`` against the server at ``base``."""
    line = guide_blocks()["status-url"][1].strip().replace("http://localhost:8000", base)
    done = subprocess.run(
        ["bash", "-c", f"{line} --json --timeout {timeout:g}"],
        env={**os.environ, "PATH": f"{venv / 'bin'}:{os.environ['PATH']}"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    try:
        return {"rc": done.returncode, **json.loads(done.stdout)}
    except json.JSONDecodeError:
        return {"rc": done.returncode, "stdout": done.stdout, "stderr": done.stderr[-2000:]}


def watched_replay(
    servers: SharedServers,
    env: dict[str, str],
    *,
    disable_plugin: bool = False,
    with_diagnosis: bool = False,
) -> WatchedReplay:
    if FREEZE_VERSION not in e2e_versions():
        pytest.skip(f"{FREEZE_VERSION} not in MMCACHE_HARNESS_E2E_VERSIONS")
    servers.close()
    venv = complete_venv(FREEZE_VERSION)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    slow = HEALTH_TIMEOUT_S + MARGIN_S + 30

    def inspect(pid: int) -> dict[str, Any]:
        # A replay that is served fast takes a second or two: let /health be polled at
        # least MIN_POLLS times (each poll is a round trip) before looking.
        wait_until = time.monotonic() + MIN_POLLS * 0.5 + 10
        while len(poller.answered()) < MIN_POLLS and time.monotonic() < wait_until:
            time.sleep(0.2)
        t0 = time.monotonic()
        status, _, took = http_get(base + "/health", slow)
        metrics_status, metrics, _ = scrape(base)
        out: dict[str, Any] = {
            "health": status,
            "health_s": round(took, 2),
            "after_s": round(time.monotonic() - t0, 2),
            "metrics_status": metrics_status,
            "metrics": metrics,
            "status_cli": status_cli(venv, base, slow),
            "end": time.monotonic(),
        }
        if with_diagnosis:
            out.update(diagnose(pid))
        return out

    with runner.plugin_state(venv, servers.wheel, purpose="0.23.0 replay, watched") as lock:
        with HealthPoller(base, interval=0.5, timeout=slow) as poller:
            options = incident.IncidentOptions(
                env={ENV_HEALTH_TIMEOUT: str(HEALTH_TIMEOUT_S), **env},
                disable_plugin=disable_plugin,
                port=port,
                n_images=20,
            )
            result = incident.run_incident(venv, options=options, inspect=inspect, lock=lock)
    return WatchedReplay(result, poller)
