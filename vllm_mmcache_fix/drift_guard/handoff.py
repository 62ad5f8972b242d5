"""The hand-off to EngineCore: where a request's journals commit when vLLM may still refuse it.

vLLM 0.32 added admission control to ``AsyncLLM`` (``--max-num-queued-reqs``,
``--max-num-queued-tokens``): ``AsyncLLM.add_request`` builds the engine request
(``process_inputs``), then ``check_admission`` may reject it (``QueueOverflowError``,
``MaxQueuedTokensError``) before it is sent to EngineCore. A commit at ``process_inputs``
would then record changes EngineCore never sees.

Where ``AsyncLLM`` has ``check_admission``, its ``add_request`` opens a :class:`Handoff`
(a context variable: the request's own task, whatever else the event loop runs; and by its
prompt object, for a raw prompt, whose ``process_inputs`` vLLM runs in an executor thread
without the call's context); ``process_inputs`` stages the request's journals there instead
of committing them;
``check_admission`` commits them when it admits the request and rolls them back when it
rejects it; what is left when ``add_request`` ends is committed when it returned (a path
without the check) and rolled back when it raised. The hand-off keeps how it ended: a raw
prompt's ``process_inputs`` that finishes in its thread after the call ended (the client
went away while its image was processed: vLLM cancels the call, not the thread) stages into
the hand-off it found when it began, and so rolls back what a cancelled call never sent
(committed, the next request with that image missed in EngineCore). Releases without
admission control commit at ``process_inputs`` as before. The bookkeeping is guarded by the
commit point's sites (``process_inputs:before/after/failed``): one piece of work, wherever
vLLM calls it.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable
from typing import Any

from ..core.signatures import ArgReader, SignatureMismatch, reader
from .journal import Journal
from .state import GuardState

ADMISSION_CHECK = "check_admission"
REFUSED = "rejected before reaching EngineCore"
"""Why the journals of an ``add_request`` call that raised (refused, or cancelled: the
client went away) are rolled back."""


class Handoff:
    """Journals of one ``add_request`` call waiting for the request to be admitted, and,
    once the call ended, whether it was."""

    __slots__ = ("admitted", "journals", "lock", "open")

    def __init__(self) -> None:
        self.journals: list[Journal] = []
        self.open = True
        self.admitted = False
        """Set when the call ended: True when it returned (the request went to EngineCore)."""
        self.lock = threading.Lock()
        """Staging (``process_inputs``' thread) against closing (the event loop)."""

    def stage(self, journal: Journal) -> bool | None:
        """Keeps ``journal`` while the call is open (None); once it ended, whether the
        request was admitted (the caller commits or rolls back)."""
        with self.lock:
            if self.open:
                self.journals.append(journal)
                return None
            return self.admitted

    def take(self, *, close: bool = False, admitted: bool = False) -> list[Journal]:
        """The journals staged so far; ``close``: the call ended (``admitted`` or not)."""
        with self.lock:
            journals, self.journals = self.journals, []
            if close:
                self.open, self.admitted = False, admitted
        return journals


_current: contextvars.ContextVar[Handoff | None] = contextvars.ContextVar(
    "mmcache_fix_handoff", default=None
)


_by_prompt: dict[int, tuple[Handoff, ...]] = {}
"""``id(prompt)`` -> the open hand-offs of the ``add_request`` calls given that prompt object.
Replaced whole on the event loop, read from the executor thread (a tuple: never seen
half-changed)."""


def staging(prompt: Any = None) -> Handoff | None:
    """The open hand-off of the request being added in this context, or of the one
    ``add_request`` call given ``prompt`` (none when several calls share that object).

    (A task ``add_request`` started inherits its context: once the call has ended, its
    hand-off is closed and such a task commits at ``process_inputs``.)
    """
    handoff = _current.get()
    if handoff is None and prompt is not None:
        open_with = _by_prompt.get(id(prompt), ())
        handoff = open_with[0] if len(open_with) == 1 else None
    return handoff if handoff is not None and handoff.open else None


def _open(prompt: Any, handoff: Handoff) -> int | None:
    if prompt is None:
        return None
    key = id(prompt)
    _by_prompt[key] = (*_by_prompt.get(key, ()), handoff)
    return key


def _close(key: int | None) -> None:
    """The ended call's hand-off is no longer found by its prompt."""
    if key is None:
        return
    rest = tuple(h for h in _by_prompt.get(key, ()) if h.open)
    if rest:
        _by_prompt[key] = rest
    else:
        _by_prompt.pop(key, None)


def end(key: int | None, handoff: Handoff, admitted: bool) -> list[Journal]:
    """``add_request`` ended (``admitted``: it returned): the journals left to resolve; a
    ``process_inputs`` still running learns from the hand-off how the call ended."""
    journals = handoff.take(close=True, admitted=admitted)
    _close(key)
    return journals


def _prompt_reader(orig: Callable[..., Any]) -> ArgReader | None:
    try:
        return reader(orig, "prompt", what="add_request")
    except SignatureMismatch:
        return None  # the context alone (a rendered prompt's process_inputs runs there)


def resolve(st: GuardState, journals: list[Journal], admitted: bool, why: str) -> None:
    for journal in journals:
        if admitted:
            st.pending.commit(journal)
        else:
            st.pending.rollback(journal, why)


def wrap_add_request(guard: Any, orig: Callable[..., Any]) -> Callable[..., Any]:
    st: GuardState = guard.state
    s_open, s_commit, s_rollback = st.sites.inputs
    prompt_arg = _prompt_reader(orig)

    async def add_request(self: Any, *args: Any, **kwargs: Any) -> Any:
        handoff = key = None
        with s_open:
            if st.live and callable(getattr(type(self), ADMISSION_CHECK, None)):
                handoff = Handoff()
                key = _open(prompt_arg.get(args, kwargs) if prompt_arg else None, handoff)
        if handoff is None:
            return await orig(self, *args, **kwargs)
        token = _current.set(handoff)
        try:
            result = await orig(self, *args, **kwargs)
        except BaseException:
            _current.reset(token)
            journals = end(key, handoff, admitted=False)
            with s_rollback:
                resolve(st, journals, False, REFUSED)
            raise
        _current.reset(token)
        journals = end(key, handoff, admitted=True)
        with s_commit:
            resolve(st, journals, True, "")
        return result

    return add_request


def wrap_check_admission(guard: Any, orig: Callable[..., Any]) -> Callable[..., Any]:
    st: GuardState = guard.state
    s_open, s_commit, s_rollback = st.sites.inputs

    def check_admission(self: Any, *args: Any, **kwargs: Any) -> Any:
        handoff = None
        with s_open:
            handoff = staging()
        if handoff is None or not handoff.journals:
            return orig(self, *args, **kwargs)
        try:
            result = orig(self, *args, **kwargs)
        except BaseException:
            with s_rollback:
                resolve(st, handoff.take(), False, "rejected by admission control")
            raise
        with s_commit:
            resolve(st, handoff.take(), True, "")
        return result

    return check_admission
