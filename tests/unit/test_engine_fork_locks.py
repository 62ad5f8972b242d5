"""A real ``os.fork`` while the parent's threads hold the plugin's locks: the child's first
ping answer (adoption of the engine, then the answer with the process's counters) must not
block. Run in a subprocess with a deadline (a regression fails, never hangs), under CPU
contention (a competing thread, a switch interval of 1 µs)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

CHILD_DEADLINE_S = 10.0

WAIT_FOR_CHILD = textwrap.dedent(
    """
    import os, sys, time

    def wait_for_child(pid, seconds, done):
        # Exit with the child's status; 3 ("child blocked") when it has not ended in time.
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            got, status = os.waitpid(pid, os.WNOHANG)
            if got:
                done.set()
                print("child exit", os.waitstatus_to_exitcode(status))
                sys.exit(os.waitstatus_to_exitcode(status))
            time.sleep(0.05)
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        done.set()
        print("child blocked")
        sys.exit(3)
    """
)

PROGRAM = WAIT_FOR_CHILD + textwrap.dedent(
    """
    import os, queue, sys, threading, time
    sys.setswitchinterval(1e-6)
    from vllm_mmcache_fix import plugin
    from vllm_mmcache_fix.core import counters, registry, signals
    from vllm_mmcache_fix.engine_liveness import fork
    from vllm_mmcache_fix.drift_guard import GUARD

    fix = plugin.ENGINE_ANSWER
    if sys.argv[1] == "renew":
        fix.install()  # registers the renewal, as register() does in every vLLM process
        assert fork._registered

    class Engine:
        def __init__(self):
            self.input_queue = queue.Queue()

    held, done = threading.Event(), threading.Event()

    def hold():
        # What the parent's threads may be doing at the fork: counting a stall, sending a
        # signal, patching, bumping a drift counter, logging an internal error.
        with counters._lock, registry._lock, signals.ENGINE_CORE_RUNNING._lock, \\
                GUARD.state.stats._lock, fix.errors._lock:
            held.set()
            done.wait(60)

    def burn():
        while not done.is_set():
            sum(range(1000))

    threading.Thread(target=hold, daemon=True).start()
    threading.Thread(target=burn, daemon=True).start()
    held.wait(10)
    pid = os.fork()
    if pid == 0:
        engine = Engine()
        fix.adopt(engine)
        signals.ENGINE_CORE_RUNNING.connect(lambda: None)
        reply = fix.answer(engine)
        counters.count_stall(counters.STALL_BUSY)
        os._exit(0 if reply.get("counts") is not None else 4)
    wait_for_child(pid, float(sys.argv[2]), done)
    """
)


def _run(mode: str, deadline: float = CHILD_DEADLINE_S) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", PROGRAM, mode, str(deadline)],
        capture_output=True,
        text=True,
        timeout=deadline + 60,
    )


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs os.fork")
def test_a_fork_while_plugin_threads_hold_locks_never_blocks_the_first_answer() -> None:
    result = _run("renew")
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs os.fork")
def test_without_the_renewal_the_child_blocks() -> None:
    """The test above would catch the defect: without renewal the child blocks."""
    result = _run("keep", deadline=3.0)
    assert result.returncode == 3 and "child blocked" in result.stdout, (
        result.stdout + result.stderr
    )


def test_renewing_the_locks_builds_no_fix() -> None:
    # The after-fork hook runs in every forked child: it must not import the fixes that
    # process never needed (plugin.FIXES would build every one of them).
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from vllm_mmcache_fix import plugin\n"
        "from vllm_mmcache_fix.engine_liveness import fork\n"
        "before = set(sys.modules)\n"
        "fork.renew_locks_in_child()\n"
        "new = sorted(m for m in set(sys.modules) - before if m.startswith('vllm_mmcache_fix'))\n"
        "print(new)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    ).stdout.strip()
    assert out == "[]", out


CACHES_PROGRAM = WAIT_FOR_CHILD + textwrap.dedent(
    """
    import os, queue, sys, threading, time
    sys.setswitchinterval(1e-6)
    from cachetools import LRUCache
    from vllm_mmcache_fix import plugin
    from vllm_mmcache_fix.lru_eviction import stats

    plugin.declarations()  # every fix's counts readable, as in a serving process
    fix = plugin.ENGINE_ANSWER
    fix.install()

    class MultiModalProcessorCacheItemMetadata:  # the sender cache's value type
        pass

    sender = LRUCache(8)
    stats.track(sender, MultiModalProcessorCacheItemMetadata)
    assert any("|sender|" in key for key in plugin.counts())

    class Engine:
        def __init__(self):
            self.input_queue = queue.Queue()

    held, done = threading.Event(), threading.Event()

    def hold():
        with stats._lock:  # the metrics thread reading the cache counts at the fork
            held.set()
            done.wait(60)

    threading.Thread(target=hold, daemon=True).start()
    held.wait(10)
    pid = os.fork()
    if pid == 0:
        engine = Engine()
        fix.adopt(engine)
        counts = fix.answer(engine).get("counts")
        os._exit(0 if counts is not None and not any("|sender|" in k for k in counts) else 4)
    wait_for_child(pid, float(sys.argv[1]), done)
    """
)


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs os.fork")
def test_a_forked_child_answers_without_the_parents_caches_or_their_held_lock() -> None:
    # EngineCore forked by the API server (GPU images): the parent's sender cache is the
    # parent's to report, and its counters' lock may be held by the metrics thread then.
    result = subprocess.run(
        [sys.executable, "-c", CACHES_PROGRAM, str(CHILD_DEADLINE_S)],
        capture_output=True,
        text=True,
        timeout=CHILD_DEADLINE_S + 60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
