"""Plain HTTP against a local server (standard library only), free ports, and a thread
that polls a URL."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import TypeVar


@dataclass
class Reply:
    """One request's outcome; ``status`` is None on a timeout or a connection error."""

    status: int | None
    latency_s: float
    timed_out: bool = False
    error: str = ""
    body: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_get(url: str, timeout: float) -> tuple[int | None, str, float]:
    """``(status, body, seconds)``; status None when nothing answered."""
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode(errors="replace"), time.monotonic() - t0
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace"), time.monotonic() - t0
    except (OSError, urllib.error.URLError) as e:
        return None, str(e), time.monotonic() - t0


def http_post(url: str, payload: dict[str, object], timeout: float) -> Reply:
    """POST ``payload`` as JSON; never raises for HTTP or network errors."""
    data = json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    t0 = time.monotonic()

    def took() -> float:
        return round(time.monotonic() - t0, 3)

    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return Reply(r.status, took(), body=r.read().decode(errors="replace"))
    except urllib.error.HTTPError as e:
        return Reply(e.code, took(), body=e.read().decode(errors="replace"))
    except (TimeoutError, socket.timeout) as e:
        return Reply(None, took(), timed_out=True, error=f"timeout: {e}")
    except urllib.error.URLError as e:
        timed_out = isinstance(e.reason, (TimeoutError, socket.timeout))
        return Reply(None, took(), timed_out=timed_out, error=str(e.reason))
    except OSError as e:
        return Reply(None, took(), error=str(e))


_P = TypeVar("_P", bound="UrlPoller")


class UrlPoller:
    """Polls ``url`` in a daemon thread named ``name``: started on entering, stopped on
    leaving (:meth:`stop`). Subclasses poll in :meth:`_run`, every ``interval`` s with a
    ``timeout`` s client timeout, waiting on ``_stop`` in between."""

    def __init__(self, url: str, interval: float, timeout: float, *, name: str) -> None:
        self.url = url
        self.interval = interval
        self.timeout = timeout
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def __enter__(self: _P) -> _P:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop polling; waits for the poll under way (at most ``timeout + 5`` s)."""
        self._stop.set()
        self._thread.join(self.timeout + 5)

    def _run(self) -> None:
        raise NotImplementedError
