"""Every fix resets the same way: ``Fix.uninstall`` undoes the patches (``_uninstall``), then
puts the fix's own state back (``_reset``) under the lock it holds, which stays the same.

A fix that rebuilt itself inside ``_uninstall`` (``self.__init__()``) replaced ``self.lock``
while ``uninstall`` held the old one: another thread then got "the" lock while the uninstall
was still going on. The test drives that from two threads, under a 1 µs switch interval.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from vllm_mmcache_fix.core.lifecycle import Fix
from vllm_mmcache_fix.drift_guard.fix import DriftGuard
from vllm_mmcache_fix.engine_liveness.answer import EngineLivenessAnswer
from vllm_mmcache_fix.engine_liveness.health import EngineHealth
from vllm_mmcache_fix.lru_eviction.fix import LruEvictionFix
from vllm_mmcache_fix.metrics.fix import PluginMetrics
from vllm_mmcache_fix.stall_sentinel.fix import StallSentinelFix

BUILDERS: dict[str, Callable[[], Fix]] = {
    "lru-eviction": LruEvictionFix,
    "drift-guard": DriftGuard,
    "engine-answer": lambda: EngineLivenessAnswer(lambda: {}),
    "engine-health": EngineHealth,
    "metrics": lambda: PluginMetrics(lambda: {}, lambda: None),
    "stall-sentinel": StallSentinelFix,
}
OTHER_THREAD_WAIT_S = 0.5
"""How long the uninstalling thread gives the other one to get the lock (it must not)."""
DEADLINE_S = 20.0


@pytest.fixture
def contention() -> Iterator[None]:
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


@pytest.fixture(params=sorted(BUILDERS))
def fix(request: pytest.FixtureRequest) -> Iterator[Fix]:
    built = BUILDERS[request.param]()
    try:
        yield built
    finally:
        built.uninstall()


def test_no_thread_gets_the_lock_while_another_uninstalls(fix: Fix, contention: None) -> None:
    fix.install()
    lock = fix.lock
    uninstalling = threading.Event()
    other_has_lock = threading.Event()
    inside = [False]
    seen_inside: list[bool] = []
    undo = fix._uninstall

    def _uninstall() -> None:
        undo()
        inside[0] = True
        uninstalling.set()
        other_has_lock.wait(OTHER_THREAD_WAIT_S)
        inside[0] = False

    fix._uninstall = _uninstall  # type: ignore[method-assign]

    def other() -> None:
        if not uninstalling.wait(DEADLINE_S):
            return
        if fix.lock.acquire(timeout=DEADLINE_S):
            try:
                seen_inside.append(inside[0])
                other_has_lock.set()
            finally:
                fix.lock.release()

    thread = threading.Thread(target=other, daemon=True)
    thread.start()
    fix.uninstall()
    thread.join(DEADLINE_S)
    del fix._uninstall
    assert not thread.is_alive()
    assert seen_inside == [False], "another thread held the lock while uninstall did"
    assert fix.lock is lock


def test_uninstall_puts_the_fix_back_as_built(fix: Fix) -> None:
    fresh: dict[str, Any] = type(fix).status(fix)
    fix.install()
    fix.note_problem("a problem seen while installed")
    fix.uninstall()
    assert fix.status() == fresh
    fix.install()
    assert fix.attempted
