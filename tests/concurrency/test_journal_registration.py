"""A request's journal opened on vLLM's multimodal executor thread while the event loop's
commit walks the pending journals: the interleaving that switched the drift guard off,
forced instead of waited for.

The walk over ``Shadow.pending`` is paused after its first journal until the other thread
has had its chance to open one. With the registration under the shadow's lock (as it is)
the other thread waits for the commit, and nothing goes wrong; with the registration put
back as it was (``pending`` changed without the lock) the same interleaving raises
vLLM's-process-killing ``RuntimeError: dictionary changed size during iteration``, which
the guard's fail-open turned into "switched off for good". The long run under contention
(test_drift_threads.py) shows the invariants hold on vLLM's real classes; this one shows,
every time, that the tier would see the defect.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import cachetools
import pytest
from drift_threads_mutants import unlocked_registration  # (this folder, on sys.path)

from vllm_mmcache_fix.drift_guard import journal as jr


class PausingPending(dict):  # type: ignore[type-arg]
    """``Shadow.pending`` whose first walk pauses after one journal until another thread
    registered one (or ``wait`` seconds passed)."""

    def __init__(self, wait: float) -> None:
        super().__init__()
        self.wait = wait
        self.walking = threading.Event()
        self.registered = threading.Event()
        self.paused = False

    def __iter__(self) -> Iterator[Any]:
        for key in dict.__iter__(self):
            yield key
            if not self.paused:
                self.paused = True
                self.walking.set()
                self.registered.wait(self.wait)


def _interleave(wait: float) -> tuple[BaseException | None, bool]:
    """Commit one journal while another thread opens a new one mid-walk; returns what the
    commit raised and whether the new journal was registered during the walk."""
    lru: cachetools.LRUCache[str, int] = cachetools.LRUCache(maxsize=8)
    for key in "abc":
        lru[key] = 1
    shadow = jr.Shadow(lru)
    pending = PausingPending(wait)
    shadow.pending = pending
    committing = jr.Journal(shadow)
    committing.my_seq["a"] = jr.PENDING_LEVEL
    jr.Journal(shadow)  # another request still pending: the commit walks ``pending``
    during_walk = []

    def executor_thread() -> None:
        pending.walking.wait(10)
        jr.Journal(shadow)
        during_walk.append(pending.walking.is_set() and not pending.registered.is_set())
        pending.registered.set()

    thread = threading.Thread(target=executor_thread)
    thread.start()
    raised: BaseException | None = None
    try:
        shadow.commit(committing)
    except BaseException as exc:  # noqa: BLE001 - what the commit raises is the result
        raised = exc
    pending.registered.set()
    thread.join(10)
    assert not thread.is_alive()
    return raised, bool(during_walk and during_walk[0])


def test_a_journal_opened_during_a_commit_waits_for_it() -> None:
    raised, during_walk = _interleave(wait=0.5)
    assert raised is None
    # The executor thread could not register while the commit walked: it waited for the lock.
    assert not during_walk


def test_the_unlocked_registration_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jr.Journal, "__init__", unlocked_registration)
    raised, during_walk = _interleave(wait=10)
    assert during_walk
    assert isinstance(raised, RuntimeError) and "changed size during iteration" in str(raised)
