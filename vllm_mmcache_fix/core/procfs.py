"""Small ``/proc`` parsers shared by the stall sentinel and ``diagnose``.

Pure text parsing plus one reader for this process's own threads (which keeps the GIL
while it reads, see :func:`_gil_holding_reader`); nothing here imports vLLM or the
operator tools. Parsers raise ``ValueError`` on text they do not recognise.
"""

from __future__ import annotations

import os

from .records import frozen

TYPE_CHECKING = False  # as typing's, without importing typing in every vLLM process
if TYPE_CHECKING:
    from collections.abc import Callable


@frozen
class StatFields:
    """The fields of ``/proc/<pid>[/task/<tid>]/stat`` the project uses."""

    comm: str
    state: str
    ppid: int
    ticks: int
    """utime + stime, in clock ticks."""
    starttime: int


def parse_stat(text: str) -> StatFields:
    # The name is in parentheses and may itself contain spaces and parentheses.
    open_paren = text.find("(")
    close_paren = text.rfind(")")
    rest = text[close_paren + 2 :].split()
    if open_paren < 0 or close_paren < open_paren or len(rest) < 20:
        raise ValueError(f"not a /proc stat line: {text[:80]!r}")
    return StatFields(
        comm=text[open_paren + 1 : close_paren],
        state=rest[0],
        ppid=int(rest[1]),
        ticks=int(rest[11]) + int(rest[12]),
        starttime=int(rest[19]),
    )


def parse_switches(text: str) -> tuple[int, int]:
    """(voluntary, involuntary) context switches from a ``status`` file."""
    voluntary = nonvoluntary = 0
    for line in text.splitlines():
        if line.startswith("voluntary_ctxt_switches:"):
            voluntary = int(line.split(":", 1)[1])
        elif line.startswith("nonvoluntary_ctxt_switches:"):
            nonvoluntary = int(line.split(":", 1)[1])
    return voluntary, nonvoluntary


def parse_schedstat(text: str) -> int | None:
    """Nanoseconds on a CPU plus waiting for one, from a ``schedstat`` file."""
    fields = text.split()
    if len(fields) < 2 or not (fields[0].isdigit() and fields[1].isdigit()):
        return None
    return int(fields[0]) + int(fields[1])


@frozen
class ThreadCounters:
    ticks: int
    """CPU time (utime + stime) in clock ticks."""
    voluntary: int
    involuntary: int
    runnable_ns: int | None
    """On a CPU or waiting for one (None where schedstat is missing)."""


def _python_read(path: str) -> bytes:
    with open(path, "rb") as handle:
        return handle.read()


def _gil_holding_reader() -> Callable[[str], bytes] | None:
    """A reader of small ``/proc`` files that keeps the GIL for the whole read.

    Python's own file I/O lets go of the GIL around every system call (open, fstat, read,
    close). Each time, a thread spinning in Python takes the GIL and must soon hand it back,
    one voluntary context switch each: a sampler reading three files of every thread adds
    40-70 switches a second to the very thread it watches, and makes a spinning thread look
    like one that waits. These reads take microseconds and never block, so calling libc
    through ``ctypes.PyDLL`` (which keeps the GIL) costs the other threads nothing.
    None where that is not available (then Python's I/O is used).
    """
    try:
        import ctypes

        libc = ctypes.PyDLL(None, use_errno=True)
        c_open, c_read, c_close = libc.open, libc.read, libc.close
    except (ImportError, OSError, AttributeError):
        return None
    c_open.argtypes, c_open.restype = [ctypes.c_char_p, ctypes.c_int], ctypes.c_int
    c_read.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t]
    c_read.restype = ctypes.c_ssize_t
    c_close.argtypes, c_close.restype = [ctypes.c_int], ctypes.c_int
    flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
    size = 8192

    def read(path: str) -> bytes:
        fd = c_open(os.fsencode(path), flags)
        if fd < 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code), path)
        try:
            chunks: list[bytes] = []
            buf = ctypes.create_string_buffer(size)
            while True:
                n = c_read(fd, buf, size)
                if n < 0:
                    code = ctypes.get_errno()
                    raise OSError(code, os.strerror(code), path)
                if n == 0:
                    return b"".join(chunks)
                chunks.append(buf.raw[:n])
        finally:
            c_close(fd)

    return read


_reader: list[Callable[[str], bytes]] = []
"""The reader, chosen at the first read (not when the module loads, in every process)."""


def reader() -> Callable[[str], bytes]:
    """The GIL-holding reader where there is one, else Python's own."""
    if not _reader:
        _reader.append(_gil_holding_reader() or _python_read)
    return _reader[0]


def _read_bytes(path: str) -> bytes:
    return reader()(path)


def _read_text(path: str) -> str:
    return _read_bytes(path).decode("utf-8", "replace")


def read_own_thread(tid: int) -> ThreadCounters:
    """The counters of thread ``tid`` (its native id) of this process.

    Raises ``OSError`` when the thread is gone."""
    base = f"/proc/self/task/{tid}/"
    ticks = parse_stat(_read_text(base + "stat")).ticks
    voluntary, involuntary = parse_switches(_read_text(base + "status"))
    try:
        runnable = parse_schedstat(_read_text(base + "schedstat"))
    except OSError:
        runnable = None
    return ThreadCounters(ticks, voluntary, involuntary, runnable)
