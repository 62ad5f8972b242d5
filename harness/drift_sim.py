"""A small stand-in for the parts of vLLM that P0/P1 cache drift involves.

The classes are defined in modules registered under vLLM's real module names, so
:mod:`vllm_mmcache_fix.drift` finds and patches them exactly as it patches vLLM.
The LRU is the real ``LRUCache`` of a released vLLM (:mod:`harness.realsrc`); the sender,
receiver, processor, input processor and engine follow vLLM's own call pattern:

* P0 processor: the lookup (``_get_cache_missing_items``: ``is_cached`` for every hash),
  HF processing of the missing items,
  then ``_merge_mm_kwargs`` (touch every hash, then ``get_and_update_item`` each);
* P0 ``process_inputs``: the prompt length check after placeholder expansion;
* P1: touch every hash, then get or insert each; a hash without data that is not
  cached fails (assertion: vLLM <= 0.27, ``MultiModalCacheMissError``: >= 0.28,
  after which P0 invalidates the reported hashes).
"""

from __future__ import annotations

import gc
import sys
import textwrap
import types
import weakref
from dataclasses import dataclass
from typing import Any

from harness import realsrc

DECODED_BYTES = 4096
"""Bytes of decoded image per unit of item size that a request's processor inputs hold."""

MODULES = (
    "vllm.multimodal.cache",
    "vllm.multimodal.processing",
    "vllm.v1.engine.input_processor",
    "vllm.v1.engine.async_llm",
)

CACHE_SRC = '''
class MultiModalCacheMissError(RuntimeError):
    def __init__(self, mm_hashes):
        super().__init__(f"missing {mm_hashes}")
        self.mm_hashes = mm_hashes


class Meta:
    def __init__(self, item, prompt_updates):
        self.item_size = item.size
        self.prompt_updates = prompt_updates


def _lru(capacity):
    return LRUCache(capacity, getsizeof=lambda v: v.item_size if isinstance(v, Meta) else v.size)


class MultiModalProcessorSenderCache:
    def __init__(self, capacity):
        self._cache = _lru(capacity)

    def is_cached_item(self, mm_hash):
        return mm_hash in self._cache

    def is_cached(self, mm_hashes):
        return [self.is_cached_item(h) for h in mm_hashes]

    def get_and_update_item(self, mm_item, mm_hash):
        if (cached := self._cache.get(mm_hash)) is not None:
            return None, cached.prompt_updates
        assert mm_item is not None, f"Expected a cached item for {mm_hash=}"
        self._cache[mm_hash] = Meta(*mm_item)
        return mm_item

    def touch_sender_cache_item(self, mm_hash):
        self._cache.touch(mm_hash)

    def clear_cache(self):
        self._cache.clear()

    def invalidate(self, mm_hash):
        self._cache.pop(mm_hash, None)


class ShmObjectStoreSenderCache:
    """A different sender: never patched."""

    def __init__(self, capacity):
        self.store = {}

    def is_cached_item(self, mm_hash):
        return mm_hash in self.store

    def is_cached(self, mm_hashes):
        return [self.is_cached_item(h) for h in mm_hashes]

    def get_and_update_item(self, mm_item, mm_hash):
        if mm_hash in self.store:
            return ("addr", mm_hash), self.store[mm_hash]
        self.store[mm_hash] = mm_item[1]
        return mm_item

    def touch_sender_cache_item(self, mm_hash):
        pass


class Receiver:
    def __init__(self, capacity, new_style):
        self._cache = _lru(capacity)
        self.new_style = new_style

    def get_and_update_features(self, features):
        for f in features:
            self._cache.touch(f.mm_hash)
        missing = []
        for f in features:
            if self.new_style:
                if f.data is not None:
                    self._cache.pop(f.mm_hash, None)
                    self._cache[f.mm_hash] = f.data
                    continue
                cached = self._cache.get(f.mm_hash)
                if cached is None:
                    missing.append(f.mm_hash)
                else:
                    f.data = cached
            else:
                cached = self._cache.get(f.mm_hash)
                if cached is not None:
                    f.data = cached
                    continue
                assert f.data is not None, f"Expected a cached item for {f.mm_hash=}"
                self._cache[f.mm_hash] = f.data
        if missing:
            raise MultiModalCacheMissError(missing)
'''

PROCESSING_SRC = '''
class Item:
    def __init__(self, mm_hash, size):
        self.mm_hash = mm_hash
        self.size = size


class Kwargs(dict):
    """Stands in for MultiModalKwargsItems (a UserDict): weakly referenceable."""


class ProcessorInputs:
    def __init__(self, images, text_len):
        self.images = images          # list of (mm_hash, size)
        self.text_len = text_len
        self.decoded = [bytearray(DECODED_BYTES * size) for _, size in images]


class BaseMultiModalProcessor:
    def __init__(self, cache):
        self.cache = cache
        self.hf_runs = 0

    def apply(self, inputs):
        cache = self.cache
        hashes = {"image": [h for h, _ in inputs.images]}
        is_cached, _ = self._get_cache_missing_items(
            cache, mm_data_items={"image": [s for _, s in inputs.images]}, mm_hashes=hashes
        )
        missing = [(h, s) for (h, s), c in zip(inputs.images, is_cached["image"]) if not c]
        self.hf_runs += len(missing)
        missing_kwargs = {"image": [Item(h, s) for h, s in missing]}
        missing_updates = {"image": [[("upd", h)] for h, _ in missing]}
        mm_kwargs, _ = self._merge_mm_kwargs(
            cache,
            mm_hashes=hashes,
            mm_is_cached=is_cached,
            mm_missing_kwargs=missing_kwargs,
            mm_missing_prompt_updates=missing_updates,
        )
        n_tokens = inputs.text_len + 4 * len(inputs.images)
        return {
            "type": "multimodal",
            "prompt_token_ids": list(range(n_tokens)),
            "mm_kwargs": mm_kwargs,
            "mm_hashes": hashes,
        }

    def _get_cache_missing_items(self, cache, mm_data_items, mm_hashes):
        """The lookup: which items are cached, and the data of the others (an item without
        data that is not cached fails the request, as in vLLM 0.11+)."""
        mm_is_cached = {m: cache.is_cached(hashes) for m, hashes in mm_hashes.items()}
        missing = {}
        for modality, flags in mm_is_cached.items():
            for idx, cached in enumerate(flags):
                if not cached:
                    data = mm_data_items[modality][idx]
                    if data is None:
                        raise ValueError(
                            f"Cache miss for {modality} at index {idx} but data is not provided."
                        )
                    missing.setdefault(modality, []).append(data)
        return mm_is_cached, missing

    def _merge_mm_kwargs(
        self, cache, mm_hashes, mm_is_cached, mm_missing_kwargs, mm_missing_prompt_updates
    ):
        for hashes in mm_hashes.values():
            for h in hashes:
                cache.touch_sender_cache_item(h)
        merged = {}
        updates = {}
        for modality, hashes in mm_hashes.items():
            nxt = 0
            for idx, h in enumerate(hashes):
                if not mm_is_cached[modality][idx]:
                    item = (
                        mm_missing_kwargs[modality][nxt],
                        mm_missing_prompt_updates[modality][nxt],
                    )
                    nxt += 1
                else:
                    item = None
                kwargs, upd = cache.get_and_update_item(item, h)
                merged.setdefault(modality, []).append(kwargs)
                updates.setdefault(modality, []).append(upd)
        return Kwargs(merged), updates
'''

INPUT_PROCESSOR_SRC = """
class Feature:
    def __init__(self, mm_hash, data):
        self.mm_hash = mm_hash
        self.identifier = mm_hash
        self.data = data


class EngineCoreRequest:
    def __init__(self, request_id, prompt_token_ids, mm_features):
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.mm_features = mm_features


class InputProcessor:
    def __init__(self, max_model_len):
        self.max_model_len = max_model_len

    def process_inputs(self, request_id, prompt, params, supported_tasks=(), **kwargs):
        n = len(prompt["prompt_token_ids"])
        if n > self.max_model_len:
            raise ValueError(f"Input length ({n}) exceeds {self.max_model_len}")
        features = []
        for modality, hashes in prompt["mm_hashes"].items():
            for h, item in zip(hashes, prompt["mm_kwargs"][modality]):
                features.append(Feature(h, item))
        return EngineCoreRequest(request_id, prompt["prompt_token_ids"], features)
"""

ASYNC_LLM_SRC = """
import asyncio


class Completion:
    def __init__(self, token_ids, finish_reason):
        self.token_ids = token_ids
        self.finish_reason = finish_reason


class RequestOutput:
    def __init__(self, request_id, token_ids, finish_reason):
        self.request_id = request_id
        self.outputs = [Completion(token_ids, finish_reason)]
        self.finished = finish_reason is not None


class AsyncLLM:
    def __init__(self, input_processor, receiver, sender):
        self.input_processor = input_processor
        self.receiver = receiver
        self.sender = sender
        self.sent = []
        self.gate = None  # an asyncio.Event the first outputs wait for, when set

    async def _add(self, request_id, prompt, params):
        request = self.input_processor.process_inputs(request_id, prompt, params)
        self.sent.append(request)
        await asyncio.sleep(0)  # sending to EngineCore lets other requests in
        if self.gate is not None:
            await self.gate.wait()
        try:
            self.receiver.get_and_update_features(request.mm_features)
        except Exception as exc:
            for h in getattr(exc, "mm_hashes", None) or ():
                self.sender.invalidate(h)
            return False
        return True

    async def generate(self, prompt, sampling_params, request_id, **kwargs):
        if not isinstance(prompt, dict):
            # A streaming-input session: every chunk is a request of its own.
            async for chunk in prompt:
                ok = await self._add(request_id, chunk, sampling_params)
                yield RequestOutput(request_id, [1] if ok else [], None if ok else "error")
            yield RequestOutput(request_id, [2], "stop")
            return
        if not await self._add(request_id, prompt, sampling_params):
            yield RequestOutput(request_id, [], "error")
            return
        yield RequestOutput(request_id, [1], None)
        yield RequestOutput(request_id, [2], "length")

    async def encode(self, prompt, pooling_params, request_id, **kwargs):
        if not await self._add(request_id, prompt, pooling_params):
            raise RuntimeError(f"request {request_id} failed in EngineCore")
        yield RequestOutput(request_id, [], "stop")
"""


def install_modules(version: str = "0.23.0") -> dict[str, types.ModuleType]:
    lru_module = realsrc.load_lru_module(version)
    sources = {
        "vllm.multimodal.cache": CACHE_SRC,
        "vllm.multimodal.processing": PROCESSING_SRC,
        "vllm.v1.engine.input_processor": INPUT_PROCESSOR_SRC,
        "vllm.v1.engine.async_llm": ASYNC_LLM_SRC,
    }
    modules = {}
    for name, src in sources.items():
        module = types.ModuleType(name)
        module.__dict__["LRUCache"] = lru_module.LRUCache
        module.__dict__["DECODED_BYTES"] = DECODED_BYTES
        exec(compile(textwrap.dedent(src), f"<{name}>", "exec"), module.__dict__)
        sys.modules[name] = module
        modules[name] = module
    return modules


def remove_modules() -> None:
    for name in MODULES:
        sys.modules.pop(name, None)


@dataclass
class World:
    """P0 and P1 of one server, with a request loop like the OpenAI server's."""

    modules: dict[str, types.ModuleType]
    capacity: int = 4
    max_model_len: int = 40
    new_style: bool = False

    def __post_init__(self) -> None:
        cache = self.modules["vllm.multimodal.cache"]
        processing = self.modules["vllm.multimodal.processing"]
        ip = self.modules["vllm.v1.engine.input_processor"]
        llm = self.modules["vllm.v1.engine.async_llm"]
        self.sender = cache.MultiModalProcessorSenderCache(self.capacity)
        self.receiver = cache.Receiver(self.capacity, self.new_style)
        self.processor = processing.BaseMultiModalProcessor(self.sender)
        self.input_processor = ip.InputProcessor(self.max_model_len)
        self.engine = llm.AsyncLLM(self.input_processor, self.receiver, self.sender)
        self._counter = 0
        self.inputs: list[weakref.ref[Any]] = []
        """Every request's processor inputs (with its decoded images), weakly."""

    def render(self, images: list[str], text_len: int = 4) -> dict[str, Any]:
        processing = self.modules["vllm.multimodal.processing"]
        inputs = processing.ProcessorInputs([(h, 1) for h in images], text_len)
        self.inputs.append(weakref.ref(inputs))
        return self.processor.apply(inputs)

    def inputs_alive(self) -> int:
        """Processor inputs of past requests that something still holds."""
        gc.collect()
        return sum(ref() is not None for ref in self.inputs)

    def _next_prompt(self, images: list[str], long: bool) -> dict[str, Any] | None:
        """The next request's rendered prompt; None when rendering fails (a 500)."""
        self._counter += 1
        try:
            return self.render(images, text_len=100 if long else 4)
        except AssertionError:
            return None

    async def request(self, images: list[str], long: bool = False) -> int:
        """HTTP-like status of one chat request."""
        prompt = self._next_prompt(images, long)
        if prompt is None:
            return 500
        try:
            outputs = [
                out async for out in self.engine.generate(prompt, None, f"req-{self._counter}")
            ]
        except ValueError:
            return 400
        if outputs and outputs[0].outputs[0].finish_reason == "error":
            return 500
        return 200

    async def embed(self, images: list[str], long: bool = False) -> int:
        """HTTP-like status of one pooling request (``AsyncLLM.encode``)."""
        prompt = self._next_prompt(images, long)
        if prompt is None:
            return 500
        try:
            async for _ in self.engine.encode(prompt, None, f"embed-{self._counter}"):
                pass
        except ValueError:
            return 400
        except RuntimeError:
            return 500
        return 200

    def p0_order(self) -> list[str]:
        return list(self.sender._cache._LRUCache__order)

    def p1_order(self) -> list[str]:
        return list(self.receiver._cache._LRUCache__order)

    def p0_keys(self) -> set[str]:
        return set(self.sender._cache._Cache__data)

    def p1_keys(self) -> set[str]:
        return set(self.receiver._cache._Cache__data)
