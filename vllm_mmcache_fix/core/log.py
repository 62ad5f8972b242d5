"""The plugin's logger: under ``vllm.`` so lines come out in vLLM's own format.

vLLM configures only the ``vllm`` logger (with ``propagate`` off), so a child
logger is the one way to land in the same handler and format. Every line
starts with ``vllm-mmcache-fix:`` so one grep shows which processes are
protected.
"""

from __future__ import annotations

import logging
import threading
import time

from .messages import PREFIX

LOGGER_NAME = "vllm.mmcache_fix"

logger = logging.getLogger(LOGGER_NAME)


def has_destination() -> bool:
    """Whether a line logged now reaches a handler.

    vLLM 0.32 configures its logger only after plugins load in the API server;
    a line logged before that is dropped.
    """
    return logger.hasHandlers()


def info(msg: str, *args: object) -> None:
    logger.info(PREFIX + msg, *args)


def warning(msg: str, *args: object) -> None:
    logger.warning(PREFIX + msg, *args)


def debug(msg: str, *args: object) -> None:
    logger.debug(PREFIX + msg, *args)


def exception(msg: str, exc: BaseException, *args: object) -> None:
    """A WARNING with ``exc``'s traceback attached."""
    logger.warning(PREFIX + msg, *args, exc_info=(type(exc), exc, exc.__traceback__))


class RateLimiter:
    """Allows one event per ``interval`` seconds; counts what it held back."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._next = 0.0
        self.suppressed = 0
        self._lock = threading.Lock()

    def ready(self) -> tuple[bool, int]:
        """(may log now, events held back since the last allowed one)."""
        now = time.monotonic()
        with self._lock:
            if now < self._next:
                self.suppressed += 1
                return False, 0
            held, self.suppressed = self.suppressed, 0
            self._next = now + self.interval
            return True, held
