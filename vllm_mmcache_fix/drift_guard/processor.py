"""Wrappers of the request path: where a request's journal opens, and where it resolves.

- ``BaseMultiModalProcessor.apply``: keeps the inputs, so a drifted request can
  be processed again with its data (recovery);
- ``BaseMultiModalProcessor._merge_mm_kwargs``: the sender-cache updates of one
  request happen inside it, so its journal is open exactly then;
- ``BaseMultiModalProcessor._get_cache_missing_items`` (0.11.0+): the cache lookup; an item
  a client sent by its UUID only, without data, keeps vLLM's answer there (the guard cannot
  have its data sent);
- ``process_inputs``: the commit point. A request that becomes an
  ``EngineCoreRequest`` commits its journal (or, where vLLM's admission control may
  still refuse it, stages it for the hand-off: :mod:`.handoff`); one that raises is
  rolled back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..core.signatures import reader
from . import pending
from .context import scope
from .handoff import REFUSED, Handoff, staging
from .journal import Journal
from .sender import shadow_of
from .state import GuardState


class Replay:
    """Runs the multimodal processor again on the same inputs."""

    __slots__ = ("func", "processor", "args", "kwargs")

    def __init__(self, func: Callable[..., Any], processor: Any, args: tuple, kwargs: dict) -> None:
        self.func = func
        self.processor = processor
        self.args = args
        self.kwargs = kwargs

    def __call__(self) -> Any:
        return self.func(self.processor, *self.args, **self.kwargs)


def _around(
    st: GuardState,
    site: Any,
    field: str,
    value: Callable[[Callable[..., Any], Any, tuple, dict], Any],
    orig: Callable[..., Any],
) -> Callable[..., Any]:
    """vLLM's ``orig``, with this thread's scope ``field`` set to ``value(wrapper, self, args,
    kwargs)`` for the call (a nested call sees its own; ``site`` guards the plugin's part)."""

    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not st.live:
            return orig(self, *args, **kwargs)
        ctx = scope()
        previous = getattr(ctx, field)
        with site:
            setattr(ctx, field, value(wrapper, self, args, kwargs))
        try:
            return orig(self, *args, **kwargs)
        finally:
            setattr(ctx, field, previous)

    return wrapper


def wrap_apply(guard: Any, orig: Callable[..., Any]) -> Callable[..., Any]:
    """The request's inputs, to run the processor (this wrapper) on them again."""
    st: GuardState = guard.state
    return _around(st, st.sites.apply, "replay", Replay, orig)


def wrap_lookup(guard: Any, orig: Callable[..., Any]) -> Callable[..., Any]:
    """The lookup's items and keys, to tell the items that came without data."""
    st: GuardState = guard.state
    items_arg = reader(orig, "mm_data_items", what="_get_cache_missing_items")
    hashes_arg = reader(orig, "mm_hashes", what="_get_cache_missing_items")

    def lookup(wrapper: Any, self: Any, args: tuple, kwargs: dict) -> tuple[Any, Any]:
        return items_arg.get(args, kwargs), hashes_arg.get(args, kwargs)

    return _around(st, st.sites.lookup, "lookup", lookup, orig)


def wrap_merge(guard: Any, orig: Callable[..., Any]) -> Callable[..., Any]:
    st: GuardState = guard.state
    s_merge_before, s_merge_after, s_merge_failed = st.sites.merge
    cache_arg = reader(orig, "cache", what="_merge_mm_kwargs")

    def _merge_mm_kwargs(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not st.installed or st.switched_off is not None:
            return orig(self, *args, **kwargs)
        ctx = scope()
        shadow = journal = None
        with s_merge_before:
            cache = cache_arg.get(args, kwargs)
            if cache is not None and ctx.journal is None:
                shadow = shadow_of(st, cache)
            if shadow is not None:
                if st.pending.has_deferred():
                    st.pending.drain_deferred()
                if st.prevent:
                    journal = Journal(shadow)
                    st.stats.bump("journals")
        if shadow is None:
            return orig(self, *args, **kwargs)
        ctx.journal = journal
        try:
            try:
                out = orig(self, *args, **kwargs)
            finally:
                # The request's journal closes as soon as vLLM's call returns or raises,
                # before a rollback or any other bookkeeping runs.
                ctx.journal = None
                ctx.bypassed.clear()
        except BaseException:
            if journal is not None:
                with s_merge_failed:
                    st.pending.rollback(journal, "multimodal processing failed")
            raise
        with s_merge_after:
            if shadow.alive:
                with shadow.lock:
                    evictions = shadow.evictions
                    if journal is not None:
                        journal.evictions_mark = evictions
                _after_merge(st, out, journal, ctx)
        return out

    return _merge_mm_kwargs


def _after_merge(st: GuardState, out: Any, journal: Journal | None, ctx: Any) -> None:
    try:
        mm_kwargs = out[0]
    except Exception:
        mm_kwargs = None
    if mm_kwargs is None:
        if journal is not None:
            st.pending.commit(journal)
        return
    replay = None
    if st.recovery:
        missing = (
            journal.sent_without_data
            if journal is not None
            else pending.has_missing_data(mm_kwargs)
        )
        if missing:
            replay = ctx.replay
    if journal is not None or replay is not None:
        st.pending.register(mm_kwargs, journal, replay)
    if ctx.collector is not None:
        ctx.collector.append(mm_kwargs)


def wrap_process_inputs(guard: Any, orig: Callable[..., Any]) -> Callable[..., Any]:
    st: GuardState = guard.state
    s_inputs_before, s_inputs_after, s_inputs_failed = st.sites.inputs
    prompt_arg = reader(orig, "prompt", what="process_inputs")

    def process_inputs(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not st.live:
            return orig(self, *args, **kwargs)
        ctx = scope()
        outer = ctx.collector
        collector: list[Any] | None = None
        prompt: Any = None
        handoff: Handoff | None = None
        with s_inputs_before:
            if st.pending.has_deferred():
                st.pending.drain_deferred()
            prompt = prompt_arg.get(args, kwargs)
            # Found now: a raw prompt's call may end (its client gone) while this thread runs.
            handoff = staging(prompt)
            collector = []
        if collector is None:
            return orig(self, *args, **kwargs)
        ctx.collector = collector
        try:
            request = orig(self, *args, **kwargs)
        except BaseException:
            ctx.collector = outer
            with s_inputs_failed:
                if st.live:
                    for record in st.pending.records_of(prompt, collector):
                        if record.journal is not None:
                            st.pending.rollback(
                                record.journal, "rejected after multimodal processing"
                            )
            raise
        ctx.collector = outer
        with s_inputs_after:
            if st.live:
                replay = None
                # Admission control may still refuse the request.
                for record in st.pending.records_of(prompt, collector):
                    if record.journal is None:
                        pass
                    elif handoff is None:
                        st.pending.commit(record.journal)
                    else:
                        admitted = handoff.stage(record.journal)  # None: staged
                        if admitted:
                            st.pending.commit(record.journal)
                        elif admitted is not None:
                            st.pending.rollback(record.journal, REFUSED)
                    replay = replay or record.replay
                if st.recovery:
                    st.attempts.note_attempt(prompt, request, replay)
        return request

    return process_inputs
