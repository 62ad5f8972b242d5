"""Read a wrapped call's arguments by name, at positions checked when patching.

A wrapper that needs, say, the ``prompt`` of ``process_inputs`` must not
assume it is ``args[1]``: a release that reorders or renames parameters would
hand it the wrong value. :func:`reader` looks the names up in vLLM's own
signature once, when patching, and raises :class:`SignatureMismatch` (the
patch is then skipped, with that sentence logged) when one is missing.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any


class SignatureMismatch(LookupError):
    """vLLM's function does not take the parameters a wrapper reads."""


_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _params(func: Callable[..., Any], what: str) -> list[inspect.Parameter]:
    try:
        return list(inspect.signature(func).parameters.values())
    except (TypeError, ValueError) as exc:
        raise SignatureMismatch(f"{what}: no signature ({exc})") from exc


class ArgReader:
    """Finds one parameter in ``(args, kwargs)`` as the wrapper receives them."""

    __slots__ = ("name", "position")

    def __init__(self, name: str, position: int | None) -> None:
        self.name = name
        self.position = position

    def get(self, args: Sequence[Any], kwargs: dict[str, Any], default: Any = None) -> Any:
        if self.name in kwargs:
            return kwargs[self.name]
        pos = self.position
        if pos is not None and len(args) > pos:
            return args[pos]
        return default


def reader(func: Callable[..., Any], name: str, *, what: str, skip: int = 1) -> ArgReader:
    """An :class:`ArgReader` for ``name``; ``skip`` leading parameters (``self``) are not in
    the wrapper's ``args``."""
    params = _params(func, what)[skip:]
    for index, param in enumerate(params):
        if param.name == name:
            return ArgReader(name, index if param.kind in _POSITIONAL else None)
    raise SignatureMismatch(f"{what} has no parameter {name!r}")


def require_prefix(func: Callable[..., Any], names: Sequence[str], *, what: str) -> None:
    """``func``'s first positional parameters must be ``names`` (``self`` included)."""
    params = [p.name for p in _params(func, what) if p.kind in _POSITIONAL]
    if params[: len(names)] != list(names):
        raise SignatureMismatch(
            f"{what}({', '.join(params)}) does not start with ({', '.join(names)})"
        )
