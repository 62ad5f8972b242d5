"""Recovery: a request EngineCore could not serve is re-sent once, with its data.

When the first output of a request that sent items as ``data=None`` is an
error with no tokens (EngineCore lacked an item: ``MultiModalCacheMissError``
from 0.28, a failed request on older releases), all of its items become
doubtful (sent with their data by every request processed from now on; left in
the cache for a request being processed that found them cached), its multimodal
items are processed again (they now carry data) and the request is submitted
again, before anything reaches the client.
Skipped (the error passes through) when the inputs cannot be rebuilt.

The first stream is left to end by itself (its last output has come), so vLLM
neither aborts that request again nor logs it as aborted; a client that goes
away still closes the stream, and vLLM logs that abort as always.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from ..core import log
from ..core.messages import DRIFT_EVENT
from ..core.process import process_label
from ..core.signatures import reader
from . import pending
from .attempts import Attempt
from .state import GuardState


def _may_need_recovery(st: GuardState, prompt: Any) -> bool:
    if not isinstance(prompt, dict):
        return False
    mm_kwargs = prompt.get("mm_kwargs")
    if mm_kwargs is not None:
        record = st.pending.lookup(mm_kwargs)
        if record is not None:
            # Processed here: a replay was kept exactly when an item went without data.
            return record.replay is not None
        return pending.has_missing_data(mm_kwargs)
    # A raw prompt: its items are processed inside add_request.
    return prompt.get("multi_modal_data") is not None


def is_error_without_tokens(out: Any) -> bool:
    if not getattr(out, "finished", False):
        return False
    outputs = getattr(out, "outputs", None)
    if not outputs:
        return False
    for completion in outputs:
        if str(getattr(completion, "finish_reason", None)) != "error":
            return False
        if getattr(completion, "token_ids", None):
            return False
    return True


def _executor_of(engine: Any) -> Any:
    renderer = getattr(engine, "renderer", None)
    if renderer is None:
        renderer = getattr(getattr(engine, "input_processor", None), "renderer", None)
    for name in ("_mm_executor", "_executor"):
        executor = getattr(renderer, name, None)
        if executor is not None and callable(getattr(executor, "submit", None)):
            return executor
    return None


async def _prepare_retry(st: GuardState, engine: Any, prompt: Any, attempt: Attempt) -> Any:
    """The prompt to submit again, with its multimodal data, or None when impossible."""
    for shadow in st.live_shadows():
        shadow.invalidate(attempt.hashes)
    if not (isinstance(prompt, dict) and "mm_kwargs" in prompt):
        return prompt  # processed again inside add_request
    if attempt.replay is None:
        return None
    executor = _executor_of(engine)
    try:
        if executor is not None:
            result = await asyncio.get_running_loop().run_in_executor(executor, attempt.replay)
        else:
            result = attempt.replay()
    except Exception as exc:
        # vLLM's processor failed on the same inputs: nothing to re-send, and
        # the client gets the error vLLM gave.
        st.fix.note(f"could not process a drifted request again: {exc!r}")
        return None
    if not isinstance(result, Mapping) or "mm_kwargs" not in result:
        return None
    if result.get("mm_hashes") != prompt.get("mm_hashes"):
        return None
    if list(result.get("prompt_token_ids") or ()) != list(prompt.get("prompt_token_ids") or ()):
        return None
    retry = dict(prompt)
    retry["mm_kwargs"] = result["mm_kwargs"]
    return retry


def wrap_generate(guard: Any, orig: Callable[..., Any]) -> Callable[..., Any]:
    st: GuardState = guard.state
    s_start = st.sites.generate_start
    prompt_arg = reader(orig, "prompt", what="AsyncLLM.generate")
    request_id_arg = reader(orig, "request_id", what="AsyncLLM.generate")

    def generate(self: Any, *args: Any, **kwargs: Any) -> Any:
        wanted = False
        with s_start:
            wanted = st.live and _may_need_recovery(st, prompt_arg.get(args, kwargs))
        if not wanted:
            return orig(self, *args, **kwargs)
        return _recovering(st, orig, self, args, kwargs, prompt_arg, request_id_arg)

    return generate


def _with_prompt(args: tuple, kwargs: dict, prompt_arg: Any, prompt: Any) -> tuple[tuple, dict]:
    if prompt_arg.name in kwargs or prompt_arg.position is None:
        return args, {**kwargs, prompt_arg.name: prompt}
    args = list(args)  # type: ignore[assignment]
    args[prompt_arg.position] = prompt  # type: ignore[index]
    return tuple(args), kwargs


async def _recovering(
    st: GuardState,
    orig: Callable[..., Any],
    engine: Any,
    args: tuple,
    kwargs: dict,
    prompt_arg: Any,
    request_id_arg: Any,
) -> AsyncIterator[Any]:
    s_first = st.sites.generate_first
    s_result = st.sites.generate_result
    s_retry = st.sites.generate_retry
    s_start = st.sites.generate_start
    request_id = request_id_arg.get(args, kwargs)
    attempt: Attempt | None = None
    slot = None
    retry_wanted = False
    with s_start:
        slot = st.attempts.open_slot(prompt_arg.get(args, kwargs))
    stream = orig(engine, *args, **kwargs)
    try:
        try:
            first = await stream.__anext__()
        except StopAsyncIteration:
            return
        finally:
            with s_first:
                if slot is not None:
                    attempt = st.attempts.close_slot(slot)
        with s_first:
            retry_wanted = st.live and attempt is not None and is_error_without_tokens(first)
        if not retry_wanted:
            if attempt is not None:
                attempt.release()
            yield first
            async for out in stream:
                yield out
            return
        # The error was the request's last output: let its stream end by itself.
        async for _ in stream:
            pass
    finally:
        if attempt is not None and not retry_wanted:
            attempt.release()
        await stream.aclose()

    assert attempt is not None
    retry = None
    try:
        with s_retry:
            st.stats.add("drift_events")
            retry = await _prepare_retry(st, engine, prompt_arg.get(args, kwargs), attempt)
            if retry is None:
                st.stats.add("recovery_unavailable")
                _log_drift(st, request_id, attempt, "it could not be re-sent (inputs unavailable)")
    finally:
        attempt.release()
    if retry is None:
        yield first
        return
    retry_args, retry_kwargs = _with_prompt(args, kwargs, prompt_arg, retry)
    stream = orig(engine, *retry_args, **retry_kwargs)
    try:
        again = await _next_output(stream)
        if again is _ENDED:
            return
        with s_result:
            if is_error_without_tokens(again):
                st.stats.add("recovery_failures")
                _log_drift(st, request_id, attempt, "it failed again after re-sending the data")
            else:
                st.stats.add("recoveries")
                _log_drift(st, request_id, attempt, "recovered by re-sending the data")
        yield again
        async for out in stream:
            yield out
    finally:
        await stream.aclose()


_ENDED = object()


async def _next_output(stream: AsyncIterator[Any]) -> Any:
    """The stream's next output, or :data:`_ENDED` when it has none (what ``anext(stream,
    _ENDED)`` does from Python 3.10)."""
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return _ENDED


def _log_drift(st: GuardState, request_id: Any, attempt: Attempt, outcome: str) -> None:
    may_log, held = st.drift_limiter.ready()
    if not may_log:
        return
    totals = st.stats.as_dict()
    log.warning(
        "%s in %s: EngineCore had no data for request %s (%d item(s) were sent as already "
        "cached); %s. Totals: drift_events=%d recoveries=%d recovery_failures=%d "
        "rollbacks=%d%s",
        DRIFT_EVENT,
        process_label(),
        request_id,
        len(attempt.hashes),
        outcome,
        totals["drift_events"],
        totals["recoveries"],
        totals["recovery_failures"],
        totals["rollbacks"],
        f"; {held} more drift events since the last line" if held else "",
    )
