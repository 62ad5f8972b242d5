"""The machine-wide server lock, and the server lifecycle that holds it.

No vLLM here: the lock is exercised by plain child processes, and the lifecycle by a
stand-in "venv" whose ``bin/python`` is a shell script that starts a child and sleeps.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from harness import procs
from harness.children import read_line
from harness.lock import LOCK_ENV, LockHeldHere, LockTimeout, ServerLock
from harness.paths import REPO_ROOT
from harness.server import Server

# Takes the lock, says so, and gives it back when told to on stdin.
HOLDER = """
import sys
from harness.lock import ServerLock
lock = ServerLock().acquire(float(sys.argv[1]) if len(sys.argv) > 1 else None)
print("held", flush=True)
sys.stdin.readline()
lock.release()
print("released", flush=True)
"""

# Waits for the lock, then reports when it got it.
TAKER = """
import sys, time
from harness.lock import ServerLock
lock = ServerLock().acquire(float(sys.argv[1]))
print("acquired", time.time(), flush=True)
lock.release()
"""


@pytest.fixture
def lock_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "server.lock"
    monkeypatch.setenv(LOCK_ENV, str(path))
    return path


def _python(code: str, *args: str) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _finish(proc: subprocess.Popen[str]) -> tuple[str, str]:
    try:
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return out, err


def test_second_taker_waits_until_the_first_releases(lock_file: Path) -> None:
    holder = _python(HOLDER)
    taker = None
    try:
        assert read_line(holder) == "held"
        info = json.loads(lock_file.read_text())
        assert info["pid"] == holder.pid
        taker = _python(TAKER, "60")
        # The taker says it waits (a condition, bounded), and has not taken the lock.
        assert taker.stderr is not None
        ready, _, _ = select.select([taker.stderr], [], [], 30)
        assert ready, "the second taker said nothing within 30 s"
        said = taker.stderr.readline()
        assert "waiting for" in said, said
        assert taker.poll() is None, "the second taker did not wait"
        released_at = time.time()
        assert holder.stdin is not None
        holder.stdin.write("go\n")
        holder.stdin.flush()
        assert read_line(holder) == "released"
        out, err = _finish(taker)
        assert taker.returncode == 0, err
        word, when = out.split()
        assert word == "acquired" and float(when) >= released_at - 0.5
        waiting = [line for line in err.splitlines() if "waiting for" in line]
        assert not waiting, err  # said once (read above), not once per poll
        assert f"pid {holder.pid}" in said and str(lock_file) in said
        assert "harness.lock" in said or "-c" in said  # the holder's command
    finally:
        for proc in (holder, taker):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


def test_timeout_names_the_holder(lock_file: Path) -> None:
    holder = _python(HOLDER)
    try:
        assert read_line(holder) == "held"
        start = time.monotonic()
        with pytest.raises(LockTimeout) as caught:
            ServerLock().acquire(0.5, say=lambda line: None)
        waited = time.monotonic() - start
        assert 0.4 <= waited < 5.0, waited
        message = str(caught.value)
        assert str(lock_file) in message
        assert f"pid {holder.pid}" in message
        assert "timeout 0.5 s" in message
    finally:
        holder.kill()
        holder.wait()
    # A dead holder's lock is free at once: the kernel dropped it.
    ServerLock().acquire(0).release()


def test_the_same_process_cannot_take_it_twice(lock_file: Path) -> None:
    with ServerLock().hold() as held:
        assert held.held
        with pytest.raises(LockHeldHere, match="already holds the server lock"):
            ServerLock().acquire(0)
    ServerLock().acquire(0).release()


def test_server_of_a_dead_holder_is_stopped(lock_file: Path) -> None:
    orphan = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(120)", "vllm-stand-in"],
        start_new_session=True,
    )
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    try:
        lock_file.write_text(json.dumps({"pid": dead.pid, "server_pgid": orphan.pid}))
        lines: list[str] = []
        lock = ServerLock().acquire(5, say=lines.append)
        try:
            assert orphan.wait(timeout=15) is not None
            assert any(f"stopping process group {orphan.pid}" in line for line in lines), lines
        finally:
            lock.release()
    finally:
        if orphan.poll() is None:
            orphan.kill()
            orphan.wait()


def _stand_in_venv(tmp_path: Path) -> Path:
    """A "venv" whose python starts a child in its process group and sleeps."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text("#!/bin/sh\nsleep 300 &\nexec sleep 300\n")
    python.chmod(0o755)
    return venv


def test_server_holds_the_lock_until_its_group_is_gone(lock_file: Path, tmp_path: Path) -> None:
    server = Server(_stand_in_venv(tmp_path), tmp_path, tmp_path / "server.log", lock_timeout=5)
    server.start()
    try:
        assert server.pid is not None
        pgid = server.pid
        info = json.loads(lock_file.read_text())
        assert info["pid"] == os.getpid() and info["server_pgid"] == pgid
        deadline = time.monotonic() + 10
        while len(procs.group_members(pgid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(procs.group_members(pgid)) >= 2
        other = _python(TAKER, "0.3")
        _, err = _finish(other)
        assert other.returncode != 0 and "LockTimeout" in err, err
        assert f"server process group {pgid}" in err, err
        with pytest.raises(TimeoutError, match="not healthy"):
            server.wait_ready(timeout=1.0)
    finally:
        server.stop(grace=2.0)
    assert procs.group_members(pgid) == []
    assert not server.lock.held
    ServerLock().acquire(0).release()


def test_failed_start_gives_the_lock_back(lock_file: Path, tmp_path: Path) -> None:
    server = Server(tmp_path / "no-venv", tmp_path, tmp_path / "server.log", lock_timeout=5)
    with pytest.raises(FileNotFoundError):
        server.start()
    assert not server.lock.held
    ServerLock().acquire(0).release()


def test_a_held_lock_is_kept_across_servers(lock_file: Path, tmp_path: Path) -> None:
    venv = _stand_in_venv(tmp_path)
    with ServerLock().hold(1) as lock:
        for name in ("a", "b"):
            with Server(venv, tmp_path, tmp_path / f"{name}.log", lock=lock) as server:
                assert json.loads(lock_file.read_text())["server_pgid"] == server.pid
            assert lock.held
            assert json.loads(lock_file.read_text())["server_pgid"] is None
    ServerLock().acquire(0).release()


def test_a_plugin_swap_waits_for_the_server_lock(
    lock_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Swapping the wheel under a running server would break it: the swap takes the lock."""
    from harness import lock as lock_mod
    from harness import venvs

    swaps: list[tuple[float, bool]] = []
    monkeypatch.setattr(
        venvs, "uninstall_plugin", lambda venv: swaps.append((time.time(), lock_mod.held_here()))
    )
    holder = _python(HOLDER)
    try:
        assert read_line(holder) == "held"
        released_at: list[float] = []

        def release_soon() -> None:
            time.sleep(1.0)
            released_at.append(time.time())
            assert holder.stdin is not None
            holder.stdin.write("\n")
            holder.stdin.flush()

        import threading

        t = threading.Thread(target=release_soon)
        t.start()
        venvs.set_plugin(tmp_path, None)
        t.join()
        assert swaps and swaps[0][1] is True  # it held the lock during the swap
        assert swaps[0][0] >= released_at[0] - 0.05, (swaps, released_at)
    finally:
        _finish(holder)
    # Inside a held lock the swap does not wait for itself.
    with ServerLock().hold():
        venvs.set_plugin(tmp_path, None)
    assert len(swaps) == 2 and swaps[1][1] is True
