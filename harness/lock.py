"""One vLLM server at a time on this machine: a lock shared by every script and test.

The lock is ``fcntl.flock`` on one file, ``/tmp/vllm-mmcache-fix-server.lock`` unless
``$MMCACHE_HARNESS_SERVER_LOCK`` names another. Whoever holds it writes who they are into
the file (pid, command, since when, and later the server's process group), so a second
taker can say whom it waits for. A taker waits as long as the holder holds it, or at
most ``timeout`` seconds (``$MMCACHE_HARNESS_SERVER_LOCK_TIMEOUT`` when not given), and
then raises :class:`LockTimeout`.

The kernel drops a ``flock`` when its holder dies, so a crashed holder never leaves the
lock taken; the server it started may outlive it, though (it runs in its own session).
The next holder finds that server's process group in the file and stops it, if the
recorded holder is gone and the group still runs vLLM.

:class:`harness.server.Server` takes the lock before it starts a server and releases
it once the server's process group is gone: callers do not take it themselves.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

LOCK_ENV = "MMCACHE_HARNESS_SERVER_LOCK"
TIMEOUT_ENV = "MMCACHE_HARNESS_SERVER_LOCK_TIMEOUT"
DEFAULT_PATH = "/tmp/vllm-mmcache-fix-server.lock"
POLL_SECONDS = 0.5

# Held by this process (a second Server in the same process would wait for itself).
_held: dict[str, ServerLock] = {}
_held_guard = threading.Lock()


class LockTimeout(TimeoutError):
    """The lock was not free within the timeout; the message names the holder."""


class LockHeldHere(RuntimeError):
    """This process already holds the lock (it would wait for itself forever)."""


def _key(path: Path) -> str:
    """The entry of ``_held`` for a lock file."""
    return str(path.resolve())


def lock_path() -> Path:
    return Path(os.environ.get(LOCK_ENV) or DEFAULT_PATH)


def default_timeout() -> float | None:
    text = os.environ.get(TIMEOUT_ENV, "").strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV}={text!r} is not a number of seconds") from None
    return value if value > 0 else None


def _command() -> str:
    return " ".join(sys.argv) or sys.executable


def describe(info: dict[str, Any] | None) -> str:
    """The holder as a phrase: ``pid 42 (pytest tests/e2e), since 10:02:03``."""
    if not info:
        return "an unknown holder"
    text = f"pid {info.get('pid', '?')}"
    if info.get("command"):
        text += f" ({str(info['command'])[:160]})"
    if info.get("since"):
        text += f", since {info['since']}"
    if info.get("server_pgid"):
        text += f", server process group {info['server_pgid']}"
    return text


def _pid_alive(pid: object) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class ServerLock:
    """The machine-wide server lock. Use :meth:`hold` or :meth:`acquire`/:meth:`release`."""

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        self.path = Path(path) if path is not None else lock_path()
        self._fd: int | None = None
        self.info: dict[str, Any] = {}
        self.waited = 0.0

    @property
    def held(self) -> bool:
        return self._fd is not None

    def read_holder(self) -> dict[str, Any] | None:
        """What the current (or last) holder wrote into the file; None if nothing."""
        try:
            text = self.path.read_text(encoding="utf-8")
        except OSError:
            return None
        try:
            data = json.loads(text)
        except ValueError:
            return None
        return data if isinstance(data, dict) else None

    def _open(self) -> int:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        with contextlib.suppress(OSError):
            os.fchmod(fd, 0o666)  # other users' jobs share the lock
        return fd

    def acquire(
        self,
        timeout: float | None = None,
        *,
        purpose: str = "",
        say: Callable[[str], None] | None = None,
    ) -> ServerLock:
        """Block until the lock is ours (at most ``timeout`` seconds; None: no limit).

        Prints one line (to stderr, or through ``say``) when it has to wait, naming the
        holder. Raises :class:`LockTimeout` when the time is up.
        """
        if self.held:
            raise LockHeldHere(f"{self.path} is already held by this object")
        key = _key(self.path)
        with _held_guard:
            other = _held.get(key)
        if other is not None:
            raise LockHeldHere(
                f"this process already holds the server lock {self.path} "
                f"({describe(other.info)}): one vLLM server at a time"
            )
        say = say or (lambda line: print(line, file=sys.stderr, flush=True))
        fd = self._open()
        start = time.monotonic()
        announced = False
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError as exc:
                    if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                        raise
                holder = self.read_holder()
                waited = time.monotonic() - start
                if timeout is not None and waited >= timeout:
                    raise LockTimeout(
                        f"the vLLM server lock {self.path} is still held by "
                        f"{describe(holder)} after {waited:.0f} s of waiting "
                        f"(timeout {timeout:g} s; {TIMEOUT_ENV} sets it)"
                    )
                if not announced:
                    limit = "no time limit" if timeout is None else f"at most {timeout:g} s"
                    say(
                        f"[server lock] waiting for {self.path}, held by {describe(holder)} "
                        f"({limit})"
                    )
                    announced = True
                pause = POLL_SECONDS
                if timeout is not None:
                    pause = max(0.01, min(pause, timeout - waited))
                time.sleep(pause)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self.waited = time.monotonic() - start
        previous = self.read_holder()
        self.info = {
            "pid": os.getpid(),
            "command": _command(),
            "since": time.strftime("%Y-%m-%d %H:%M:%S"),
            "purpose": purpose,
        }
        self._write()
        with _held_guard:
            _held[key] = self
        self._stop_orphan(previous, say)
        if announced:
            say(f"[server lock] {self.path} is ours after {self.waited:.0f} s")
        return self

    def update(self, **fields: Any) -> None:
        """Add fields (such as ``server_pgid``) to what the holder wrote."""
        if not self.held:
            raise RuntimeError("the lock is not held")
        self.info.update(fields)
        self._write()

    def _write(self) -> None:
        assert self._fd is not None
        data = (json.dumps(self.info, sort_keys=True) + "\n").encode()
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, data, 0)

    def release(self) -> None:
        """Give the lock up (a no-op when not held)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        key = _key(self.path)
        with _held_guard:
            if _held.get(key) is self:
                del _held[key]
        try:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def hold(self, timeout: float | None = None, *, purpose: str = "") -> Iterator[ServerLock]:
        self.acquire(timeout, purpose=purpose)
        try:
            yield self
        finally:
            self.release()

    def _stop_orphan(self, previous: dict[str, Any] | None, say: Callable[[str], None]) -> None:
        """Stop a server whose holder died without stopping it (see the module doc)."""
        if not previous:
            return
        pgid = previous.get("server_pgid")
        if not isinstance(pgid, int) or pgid <= 1 or _pid_alive(previous.get("pid")):
            return
        from harness import procs  # here: procs imports nothing from this module

        members = [p for p in procs.group_members(pgid) if "vllm" in procs.process_name(p)]
        if not members:
            return
        say(
            f"[server lock] the last holder ({describe(previous)}) is gone but its vLLM "
            f"server still runs: stopping process group {pgid}"
        )
        procs.kill_group(pgid)


def held_here(path: str | os.PathLike[str] | None = None) -> bool:
    """Whether this process holds the server lock (``path``: the default lock file)."""
    key = _key(Path(path) if path is not None else lock_path())
    with _held_guard:
        return key in _held


def hold(timeout: float | None = None, *, purpose: str = "") -> contextlib.AbstractContextManager:
    """``with lock.hold(): ...`` on the default lock file."""
    return ServerLock().hold(timeout, purpose=purpose)
