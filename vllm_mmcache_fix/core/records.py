"""``@frozen``: ``@dataclass(frozen=True)`` without generating code, for what every process loads.

``dataclass`` compiles each class's ``__init__``, ``__repr__``, ``__eq__``, ``__hash__``,
``__setattr__`` and ``__delattr__`` from source text: about 0.5 ms a class, and the plugin's
entry point runs in every vLLM process (workers included). A record gets shared,
ready-made methods instead (a few microseconds) and the same behaviour: fields in
annotation order, defaults, keyword or positional arguments, frozen instances (``setattr``
raises ``dataclasses.FrozenInstanceError``), value equality and hashing, the same ``repr``.
``dataclasses.fields``, ``asdict``, ``astuple``, ``replace`` and ``is_dataclass`` accept
records: each carries the ``__dataclass_fields__`` table those functions read. On a
Python whose ``dataclasses`` lacks that table's parts, ``frozen`` is ``dataclass(frozen=True)``.

Use it for immutable records with immutable defaults (no ``field(default_factory=...)``,
no ``__post_init__``); anything else stays a dataclass.
"""

from __future__ import annotations

import dataclasses

TYPE_CHECKING = False  # as typing's, without importing typing in every vLLM process
if TYPE_CHECKING:
    from typing import Any, TypeVar

    from typing_extensions import dataclass_transform

    T = TypeVar("T")

_FIELDS = getattr(dataclasses, "_FIELDS", None)
_FIELD = getattr(dataclasses, "_FIELD", None)
_PARAMS = getattr(dataclasses, "_PARAMS", None)
_SUPPORTED = (
    isinstance(_FIELDS, str)
    and _FIELD is not None
    and isinstance(_PARAMS, str)
    and hasattr(dataclasses, "_DataclassParams")
)


def _field_names(cls: type) -> tuple[str, ...]:
    names: list[str] = list(getattr(cls, "__record_fields__", ()))
    for name, annotation in cls.__dict__.get("__annotations__", {}).items():
        text = annotation if isinstance(annotation, str) else repr(annotation)
        if "ClassVar" in text or "InitVar" in text:
            continue
        if name not in names:
            names.append(name)
    return tuple(names)


def _make_init(cls: type, names: tuple[str, ...], defaults: dict[str, Any]) -> Any:
    title = cls.__name__
    count = len(names)
    setter = object.__setattr__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        given = len(args)
        if given > count:
            raise TypeError(
                f"{title}.__init__() takes {count + 1} positional arguments but "
                f"{given + 1} were given"
            )
        for name, value in zip(names, args):
            setter(self, name, value)
        if given == count and not kwargs:
            return
        for name in names[given:]:
            if name in kwargs:
                setter(self, name, kwargs.pop(name))
            elif name in defaults:
                setter(self, name, defaults[name])
            else:
                raise TypeError(
                    f"{title}.__init__() missing 1 required positional argument: {name!r}"
                )
        for key in kwargs:  # what is left was given twice or is no field
            if key in names:
                raise TypeError(f"{title}.__init__() got multiple values for argument {key!r}")
            raise TypeError(f"{title}.__init__() got an unexpected keyword argument {key!r}")

    return __init__


def _values(self: Any) -> tuple[Any, ...]:
    return tuple(getattr(self, name) for name in self.__record_fields__)


def _repr(self: Any) -> str:
    inner = ", ".join(f"{name}={getattr(self, name)!r}" for name in self.__record_fields__)
    return f"{type(self).__qualname__}({inner})"


def _eq(self: Any, other: object) -> Any:
    if other.__class__ is self.__class__:
        return _values(self) == _values(other)
    return NotImplemented


def _hash(self: Any) -> int:
    return hash(_values(self))


def _setattr(self: Any, name: str, value: Any) -> None:
    raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}")


def _delattr(self: Any, name: str) -> None:
    raise dataclasses.FrozenInstanceError(f"cannot delete field {name!r}")


def _dataclass_table(cls: type, names: tuple[str, ...], defaults: dict[str, Any]) -> None:
    """What ``dataclasses.fields``/``asdict``/``replace`` read."""
    annotations = cls.__dict__.get("__annotations__", {})
    table = {}
    for name in names:
        spec: Any = dataclasses.field(default=defaults.get(name, dataclasses.MISSING))
        spec.name = name
        spec.type = annotations.get(name, "Any")
        spec._field_type = _FIELD
        table[name] = spec
    setattr(cls, _FIELDS, table)  # type: ignore[arg-type]
    params: Any = dataclasses._DataclassParams.__new__(dataclasses._DataclassParams)  # type: ignore[attr-defined]
    for key, value in (
        ("init", True),
        ("repr", True),
        ("eq", True),
        ("order", False),
        ("unsafe_hash", False),
        ("frozen", True),
    ):
        try:
            object.__setattr__(params, key, value)
        except Exception:
            pass
    setattr(cls, _PARAMS, params)  # type: ignore[arg-type]


def _frozen(cls: type) -> type:
    if not _SUPPORTED:
        return dataclasses.dataclass(frozen=True)(cls)
    names = _field_names(cls)
    inherited: dict[str, Any] = dict(getattr(cls, "__record_defaults__", {}))
    defaults = inherited | {n: cls.__dict__[n] for n in names if n in cls.__dict__}
    cls.__record_fields__ = names  # type: ignore[attr-defined]
    cls.__record_defaults__ = defaults  # type: ignore[attr-defined]
    setattr(cls, "__match_args__", names)  # noqa: B010
    cls.__init__ = _make_init(cls, names, defaults)  # type: ignore[misc]
    cls.__repr__ = _repr  # type: ignore[method-assign,assignment]
    cls.__eq__ = _eq  # type: ignore[method-assign,assignment]
    cls.__hash__ = _hash  # type: ignore[method-assign,assignment]
    cls.__setattr__ = _setattr  # type: ignore[method-assign,assignment]
    cls.__delattr__ = _delattr  # type: ignore[method-assign,assignment]
    _dataclass_table(cls, names, defaults)
    return cls


if TYPE_CHECKING:

    @dataclass_transform(frozen_default=True)
    def frozen(cls: type[T]) -> type[T]: ...

else:
    frozen = _frozen
