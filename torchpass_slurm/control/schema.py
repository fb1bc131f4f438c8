"""The wire rules of a typed body, derived from its dataclass (no zmq, no I/O).

A body is a frozen dataclass; each of its fields is one key of the JSON object on
the wire, with the JSON types its annotation allows::

    annotation             on the wire              absent
    int                    an integer (not a bool)  an error, unless the field has a default
    float                  a number
    str, bool              a string, true/false
    tuple[int, ...]        a list of integers       (``items``; read back as a tuple)
    int | None             an integer; with ``wire(null=True)`` null too
    Mapping[str, Any]      an object

A field without a default is required; one with a default may be absent, and is left
out of :func:`dump` while it is None (a ``null=True`` field is always written: null
is one of its values). :func:`wire` adds what an annotation cannot say: a codec
between the wire value and the field's type (a task beat, a mesh), and an ``extra``
field that keeps the keys a body carries beyond its own (a report's).

:func:`parse` is the one check of a received body: :func:`~torchpass_slurm.control.messages.decode`
runs it, so what a receiver's code reads has been checked by the same declaration
the sender built it from. It raises :class:`~torchpass_slurm.errors.ControlPlaneError`
saying which field, what it was and what was expected.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from torchpass_slurm.errors import ControlPlaneError

__all__ = [
    "JSONObject",
    "Body",
    "Spec",
    "wire",
    "specs",
    "required_types",
    "check_value",
    "parse",
    "dump",
    "describe",
]

T = TypeVar("T")
B = TypeVar("B", bound="Body")
#: A JSON object as it travels: a body (what ``to_body`` returns and ``from_body`` reads), a
#: report's fields, a copy of a rank's state. Its keys and their types are its class's.
JSONObject = dict[str, Any]
_NONE = type(None)


def wire(
    *,
    null: bool = False,
    items: type | None = None,
    decode: Callable[[Any, str], Any] | None = None,
    encode: Callable[[Any], Any] | None = None,
    json: tuple[type, ...] | None = None,
    extra: bool = False,
) -> JSONObject:
    """Field metadata: ``null`` (None travels as null), ``items`` (a list's element type),
    ``decode(value, what)``/``encode(value)`` (the wire value <-> the field's value),
    ``json`` (the wire types, where the annotation is not a JSON type), ``extra`` (the field
    holds the keys the body carries beyond its declared ones)."""
    return {
        "torchpass_wire": {
            "null": null,
            "items": items,
            "decode": decode,
            "encode": encode,
            "json": json,
            "extra": extra,
        }
    }


@dataclass(frozen=True)
class Spec:
    """One key of a body on the wire."""

    name: str
    types: tuple[type, ...]
    required: bool
    null: bool = False
    items: type | None = None
    decode: Callable[[Any, str], Any] | None = None
    encode: Callable[[Any], Any] | None = None


def _json_types(hint: Any) -> tuple[type, ...]:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return tuple(t for arg in typing.get_args(hint) for t in _json_types(arg))
    base = origin or hint
    if base is _NONE:
        return ()
    if isinstance(base, type):
        if issubclass(base, bool):
            return (bool,)
        if issubclass(base, str):  # a StrEnum too
            return (str,)
        if issubclass(base, int):
            return (int,)
        if issubclass(base, float):
            return (int, float)
        if issubclass(base, Mapping):
            return (dict,)
        if issubclass(base, Sequence):
            return (list,)
    raise TypeError(f"{hint!r} is not a JSON type: give the field wire(json=...)")


_SPECS: dict[type, tuple[tuple[Spec, ...], str | None]] = {}


def _specs(cls: type) -> tuple[tuple[Spec, ...], str | None]:
    if cls not in _SPECS:
        _SPECS[cls] = _read_specs(cls)
    return _SPECS[cls]


def _read_specs(cls: type) -> tuple[tuple[Spec, ...], str | None]:
    hints = typing.get_type_hints(cls)
    found: list[Spec] = []
    extra: str | None = None
    for f in dataclasses.fields(cls):
        meta = f.metadata.get("torchpass_wire", {})
        if meta.get("extra"):
            extra = f.name
            continue
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        null = bool(meta.get("null"))
        wanted = meta.get("json") or _json_types(hints[f.name])
        found.append(
            Spec(
                f.name,
                (*wanted, _NONE) if null else tuple(wanted),
                required,
                null,
                meta.get("items"),
                meta.get("decode"),
                meta.get("encode"),
            )
        )
    return tuple(found), extra


def specs(cls: type) -> tuple[Spec, ...]:
    """The wire keys of the body dataclass ``cls``, in field order."""
    return _specs(cls)[0]


def required_types(cls: type) -> dict[str, tuple[type, ...]]:
    """The required keys of ``cls`` with their JSON types (``messages.BODY_SCHEMAS``)."""
    return {s.name: s.types for s in specs(cls) if s.required}


def describe(types_: tuple[type, ...]) -> str:
    """``int or null``: the JSON types a key allows, for an error message."""
    return " or ".join("null" if t is _NONE else t.__name__ for t in types_)


def check_value(spec: Spec, value: object, what: str) -> None:
    """Raise ControlPlaneError unless ``value`` is of the wire types ``spec`` allows."""
    wrong = (isinstance(value, bool) and bool not in spec.types) or not isinstance(value, spec.types)
    if wrong:
        raise ControlPlaneError(
            f"{what} field {spec.name!r} is {type(value).__name__}; expected {describe(spec.types)}"
        )
    if spec.items is not None and isinstance(value, list):
        item = spec.items
        for v in value:
            if (isinstance(v, bool) and item is not bool) or not isinstance(v, item):
                raise ControlPlaneError(
                    f"{what} field {spec.name!r} holds a {type(v).__name__}; "
                    f"expected a list of {item.__name__}"
                )


def parse(cls: type[T], body: Mapping[str, Any], what: str) -> T:
    """The body dataclass ``cls`` read from the JSON object ``body``: every declared key
    checked (a required one present), decoded, and the rest kept in the ``extra`` field if
    ``cls`` has one (dropped otherwise: a newer peer may send more). ControlPlaneError if it
    does not fit."""
    if not isinstance(body, Mapping):
        raise ControlPlaneError(f"{what} is a {type(body).__name__}; expected a JSON object")
    declared, extra = _specs(cls)
    values: JSONObject = {}
    for spec in declared:
        if spec.name not in body:
            if spec.required:
                raise ControlPlaneError(f"{what} lacks the field {spec.name!r}")
            continue
        value = body[spec.name]
        check_value(spec, value, what)
        if spec.decode is not None:
            value = spec.decode(value, f"{what} field {spec.name!r}")
        elif isinstance(value, list):  # a declared list is a tuple of its dataclass (frozen)
            value = tuple(value)
        values[spec.name] = value
    if extra is not None:
        names = {s.name for s in declared}
        values[extra] = {k: v for k, v in body.items() if k not in names}
    return cls(**values)


def dump(obj: Any) -> JSONObject:
    """The JSON object of the body dataclass ``obj`` (see the module docstring for what is left out)."""
    declared, extra = _specs(type(obj))
    body: JSONObject = dict(getattr(obj, extra)) if extra is not None else {}
    for spec in declared:
        value = getattr(obj, spec.name)
        if value is None and not spec.required and not spec.null:
            continue
        if value is not None and spec.encode is not None:
            value = spec.encode(value)
        elif isinstance(value, tuple):
            value = list(value)
        body[spec.name] = value
    return body


class Body:
    """A typed body whose wire form is its dataclass's: :func:`dump` out, :func:`parse` in.

    A subclass is a frozen dataclass that names its message in ``WIRE_NAME`` (for the
    errors :func:`parse` raises); a body with more to check overrides ``from_body``.
    """

    WIRE_NAME: ClassVar[str]

    def to_body(self) -> JSONObject:
        return dump(self)

    @classmethod
    def from_body(cls: type[B], body: Mapping[str, Any]) -> B:
        return parse(cls, body, f"'{cls.WIRE_NAME}' body")
