"""Every change this process made to vLLM, with what was there before.

Three kinds of change, one registry (gevent's ``saved`` in spirit):

- class attributes replaced or added (``wrap`` for a wrapper around vLLM's
  function, ``apply`` for a plain value; ``revert``); the first original wins, so
  patching twice never loses vLLM's own attribute, and an attribute that was absent
  is recorded as absent (``ABSENT``), so revert deletes what patching added;
- attributes set on one vLLM object (``set_instance_attr``), such as the
  per-instance eviction hook of a tracked sender cache;
- objects whose class was switched (``switch_class``), such as each cache
  turned into its fixed class.

``revert_all`` undoes all three, so nothing the plugin changed survives it.
Objects are held weakly: a cache vLLM drops is not kept alive by the registry.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from typing import Any

from .records import frozen

# Set on every replacement this package installs.
PATCH_MARKER = "__mmcache_fix_patch__"
_MISSING = object()


class _Absent:
    """What a class had under a name the plugin added: nothing (revert deletes it)."""

    def __repr__(self) -> str:
        return "ABSENT"


ABSENT: Any = _Absent()


@frozen
class Applied:
    patch_id: str
    owner: type
    attr: str
    original: Any
    """The raw class attribute vLLM defined (a classmethod/staticmethod object), or
    ``ABSENT`` when the plugin added the name."""
    replacement: Any

    @property
    def target(self) -> str:
        return f"{self.owner.__module__}.{self.owner.__qualname__}.{self.attr}"


@frozen
class _InstanceChange:
    patch_id: str
    ref: Any  # weakref.ref to the object
    attr: str | None
    """The attribute set, or None for a class switch."""
    before: Any
    """The previous instance attribute (or _MISSING), or the previous class."""


_lock = threading.RLock()
_applied: dict[tuple[type, str], Applied] = {}
# (id(obj), attr or "__class__") -> change; mappings are unhashable, so keyed by id.
_instances: dict[tuple[int, str], _InstanceChange] = {}


def _raw(owner: type, attr: str) -> Any:
    return owner.__dict__.get(attr, ABSENT)


def _func_of(raw: Any) -> Any:
    return getattr(raw, "__func__", raw)


def is_patched(owner: type, attr: str) -> bool:
    return bool(getattr(_func_of(_raw(owner, attr)), PATCH_MARKER, False))


def get_original(owner: type, attr: str) -> Any:
    """vLLM's own attribute, whether or not it is patched now (``ABSENT`` if none)."""
    with _lock:
        entry = _applied.get((owner, attr))
        return entry.original if entry is not None else _raw(owner, attr)


def apply(patch_id: str, owner: type, attr: str, replacement: Any) -> bool:
    """Install ``replacement``; False when this patch is already in place."""
    with _lock:
        if (owner, attr) in _applied or is_patched(owner, attr):
            return False
        original = _raw(owner, attr)
        setattr(_func_of(replacement), PATCH_MARKER, patch_id)
        setattr(owner, attr, replacement)
        _applied[(owner, attr)] = Applied(patch_id, owner, attr, original, replacement)
        return True


def wrap(patch_id: str, owner: type, attr: str, make: Callable[[Any], Any]) -> bool:
    """Replace vLLM's function ``owner.attr`` by ``make(function)``; False when already done.

    The replacement gets ``functools.wraps(function)`` (name, docstring, ``__wrapped__``,
    so ``inspect.signature`` still reads vLLM's parameters), the marker and the registry
    record; a classmethod or staticmethod stays one. ``make`` may raise (a signature it
    cannot serve): then nothing is changed.
    """
    with _lock:
        if (owner, attr) in _applied or is_patched(owner, attr):
            return False
        raw = _raw(owner, attr)
        function = _func_of(raw)
        if not callable(function):
            raise TypeError(f"{owner.__qualname__}.{attr} is not a function")
        replacement: Any = functools.wraps(function)(make(function))
        if isinstance(raw, classmethod):
            replacement = classmethod(replacement)
        elif isinstance(raw, staticmethod):
            replacement = staticmethod(replacement)
        return apply(patch_id, owner, attr, replacement)


def revert(owner: type, attr: str) -> bool:
    with _lock:
        entry = _applied.pop((owner, attr), None)
        if entry is None:
            return False
        if entry.original is ABSENT:
            if attr in owner.__dict__:
                delattr(owner, attr)
        else:
            setattr(owner, attr, entry.original)
        return True


def _forget(
    key: tuple[int, str],
    change: _InstanceChange,
    lock: Any = _lock,
    instances: dict[tuple[int, str], _InstanceChange] = _instances,
) -> None:
    # Bound at definition: an object that dies at interpreter exit, after the module's
    # globals were cleared, must not print "Exception ignored" (an EngineCore's last lines).
    with lock:
        if instances.get(key) is change:
            del instances[key]


def _forgotten(key: tuple[int, str], holder: list[_InstanceChange], forget: Any, _ref: Any) -> None:
    forget(key, holder[0])


def _track(key: tuple[int, str], obj: Any, change_of: Any) -> None:
    # change_of(ref) builds the record; the callback drops it when obj dies.
    holder: list[_InstanceChange] = []
    ref: Callable[[], Any]
    try:
        ref = weakref.ref(obj, functools.partial(_forgotten, key, holder, _forget))
    except TypeError:
        ref = lambda: obj  # noqa: E731  (not weakly referenceable: keep it)
    change = change_of(ref)
    holder.append(change)
    _instances[key] = change


def set_instance_attr(patch_id: str, obj: Any, attr: str, value: Any) -> None:
    """Set ``obj.__dict__[attr]``, remembering what was there first."""
    with _lock:
        key = (id(obj), attr)
        existing = _instances.get(key)
        if existing is None or existing.ref() is not obj:
            before = obj.__dict__.get(attr, _MISSING)
            _track(key, obj, lambda ref: _InstanceChange(patch_id, ref, attr, before))
        obj.__dict__[attr] = value


def revert_instance_attr(obj: Any, attr: str) -> bool:
    with _lock:
        change = _instances.pop((id(obj), attr), None)
        if change is None or change.ref() is not obj:
            return False
        _restore(obj, change)
        return True


def switch_class(patch_id: str, obj: Any, cls: type) -> None:
    """Give ``obj`` the class ``cls``, remembering its first class."""
    with _lock:
        key = (id(obj), "__class__")
        existing = _instances.get(key)
        if existing is None or existing.ref() is not obj:
            before = type(obj)
            _track(key, obj, lambda ref: _InstanceChange(patch_id, ref, None, before))
        obj.__class__ = cls


def original_class(obj: Any) -> type:
    with _lock:
        change = _instances.get((id(obj), "__class__"))
        if change is not None and change.ref() is obj:
            return change.before
        return type(obj)


def _restore(obj: Any, change: _InstanceChange) -> None:
    if change.attr is None:
        obj.__class__ = change.before
    elif change.before is _MISSING:
        obj.__dict__.pop(change.attr, None)
    else:
        obj.__dict__[change.attr] = change.before


def revert_patch(patch_id: str) -> int:
    """Undo every change recorded under ``patch_id``; returns how many."""
    with _lock:
        undone = 0
        for entry in [e for e in _applied.values() if e.patch_id == patch_id]:
            undone += revert(entry.owner, entry.attr)
        for key, change in list(_instances.items()):
            if change.patch_id != patch_id:
                continue
            del _instances[key]
            obj = change.ref()
            if obj is not None:
                _restore(obj, change)
                undone += 1
        return undone


def revert_all() -> list[Applied]:
    with _lock:
        entries = list(_applied.values())
        for entry in entries:
            revert(entry.owner, entry.attr)
        for key, change in list(_instances.items()):
            del _instances[key]
            obj = change.ref()
            if obj is not None:
                _restore(obj, change)
        return entries


def applied() -> list[Applied]:
    with _lock:
        return list(_applied.values())


def instance_changes() -> list[tuple[str, str]]:
    """(patch id, what) for each live object change."""
    with _lock:
        out = []
        for change in _instances.values():
            obj = change.ref()
            if obj is None:
                continue
            what = "class" if change.attr is None else change.attr
            out.append((change.patch_id, f"{type(obj).__name__}.{what}"))
        return out
