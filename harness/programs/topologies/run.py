"""One run of one shape on one release: its cases, each under the server lock on its own.

Cases, in order: without the plugin (installed, kept out through ``VLLM_PLUGINS``), with
it, and on :data:`~harness.programs.topologies.shapes.STUCK_VERSION` with the eviction fix off
(``MMCACHE_FIX_MODE=warn``) so EngineCore freezes and ``/health`` shows what the plugin's
liveness check makes of a stuck engine (not for offline ``LLM``, which has no health
check, nor pooling). Each case takes the lock, puts this checkout's wheel into the
venv (and Ray, where the shape needs it), runs, and gives the lock back, so other
holders can interleave between cases.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import runner
from harness.lock import ServerLock, default_timeout
from harness.paths import log_path as new_log_path
from harness.programs.topologies import environment
from harness.programs.topologies.http_case import HttpCaseOptions, run_http_case
from harness.programs.topologies.program_case import run_program_case
from harness.programs.topologies.record import evaluate_run
from harness.programs.topologies.shapes import OFFLINE, POOLING, STUCK_VERSION, Shape
from harness.venvs import set_plugin, venv_dist_version


def _log(msg: str) -> None:
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%H:%M:%S")
    print(f"[topologies {stamp}] {msg}", file=sys.stderr, flush=True)


def cases(
    shape: Shape, version: str, quick: bool, plugin_only: bool = False
) -> list[tuple[str, bool, bool]]:
    """(record key, plugin loaded, stuck engine) for each case of a run; ``plugin_only``
    leaves out the case without the plugin (vLLM's own behaviour, which full runs record)."""
    out = [("with_plugin", True, False)]
    if not plugin_only:
        out.insert(0, ("without_plugin", False, False))
    if version == STUCK_VERSION and not quick and shape.entry not in (OFFLINE, POOLING):
        out.append(("stuck_engine", True, True))
    return out


@dataclass(frozen=True)
class RunOptions:
    """The options of one run of a shape on a release (:func:`run_shape`)."""

    quick: bool = False
    """No stuck-engine case, at most 200 pooling requests."""
    plugin_only: bool = False
    """Leave out the case without the plugin (see :func:`cases`)."""
    n_images: int = 20
    """New images of each case's replay."""
    request_timeout: float = 20.0
    """Per-request timeout (s)."""
    pooling_requests: int = 1000
    """Requests of the pooling memory measurement (0: none), pooling shapes only."""
    lock_timeout: float | None = None
    """Seconds to wait for the server lock in each case (None: the lock's default)."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RunOptions:
        """The options of the topologies command line."""
        return runner.options_of(cls, args, {"plugin_only": "with_plugin_only"})


def run_case(
    shape: Shape,
    version: str,
    venv: Path,
    model: Path,
    wheel: Path,
    options: RunOptions,
    *,
    plugin: bool,
    stuck: bool,
    tag: str,
) -> dict[str, Any]:
    """One case of a run; ``options.lock_timeout`` is used as it is (None: no bound)."""
    o = options
    t0 = time.monotonic()
    purpose = f"topologies {shape.name} {version} {tag}"
    with ServerLock().hold(o.lock_timeout, purpose=purpose) as lock:
        waited = time.monotonic() - t0
        t1 = time.monotonic()
        set_plugin(venv, wheel)
        extra: dict[str, Any] = {}
        for dist in shape.needs:
            extra[dist] = environment.ensure_distribution(venv, dist)
        env = environment.case_env(shape, venv, version, plugin=plugin, stuck=stuck)
        log = new_log_path(f"topo-{shape.name}-{version}-{tag}")
        _log(f"{shape.name} {version} {tag}: log {log}")
        if shape.is_http:
            http = HttpCaseOptions(
                n_images=o.n_images,
                request_timeout=o.request_timeout,
                pooling_requests=o.pooling_requests,
            )
            rec = run_http_case(shape, venv, model, log, env, http, lock=lock)
        else:
            rec = run_program_case(
                shape,
                venv,
                model,
                log,
                env,
                lock=lock,
                n_images=o.n_images,
                request_timeout=o.request_timeout,
            )
    rec.update(extra)
    rec["env"] = sorted(k for k in env if k != "VLLM_PLUGINS") + (
        [] if plugin else ["VLLM_PLUGINS (plugin kept out)"]
    )
    rec["lock_wait_s"] = round(waited, 1)
    rec["seconds"] = round(time.monotonic() - t1, 1)
    return rec


def run_shape(
    shape: Shape,
    version: str,
    options: RunOptions = RunOptions(),
    *,
    venv: Path,
    model: Path,
    wheel: Path,
    commit: str,
) -> dict[str, Any]:
    """One run: every case of :func:`cases`; the run record with its verdict."""
    quick, plugin_only = options.quick, options.plugin_only
    lock_timeout = default_timeout() if options.lock_timeout is None else options.lock_timeout
    pooling_requests = options.pooling_requests
    run: dict[str, Any] = {
        "shape": shape.name,
        "vllm": version,
        "plugin_commit": commit,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "quick": quick,
        "plugin_only": plugin_only,
        "transformers": venv_dist_version(venv, "transformers"),
        "torch": venv_dist_version(venv, "torch"),
    }
    if quick:
        pooling_requests = min(pooling_requests, 200)
    case_options = dataclasses.replace(
        options, pooling_requests=pooling_requests, lock_timeout=lock_timeout
    )
    for key, plugin, stuck in cases(shape, version, quick, plugin_only):
        if stuck and not (run.get("with_plugin") or {}).get("started"):
            continue
        _log(f"{shape.name} {version}: {key}")
        try:
            run[key] = run_case(
                shape,
                version,
                venv,
                model,
                wheel,
                case_options,
                plugin=plugin,
                stuck=stuck,
                tag=key.replace("_", "-"),
            )
        except Exception as exc:  # noqa: BLE001 - recorded
            run[key] = {"started": False, "error": f"harness: {type(exc).__name__}: {exc}"[:500]}
        case = run[key]
        _log(
            f"{shape.name} {version} {key}: started={case.get('started')} "
            f"statuses={case.get('statuses')} active={case.get('active_in')} "
            f"health={(case.get('health') or {}).get('statuses')} error={case.get('error')}"
        )
    status, reasons, notes = evaluate_run(shape, run)
    run["status"], run["reasons"], run["notes"] = status, reasons, notes
    return run
