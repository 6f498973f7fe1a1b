"""Type checks for what a peer sends: a msgpack map held against a dataclass's declared fields.

Every message of ``shared/protocol.py`` is decoded through ``fields_of``. A field missing, or
holding a value of another type than its declaration's, raises ``WireTypeError`` naming the field
(``request_id``, ``sampling.temperature``, ``stop_ids[2]``) and the type it must have, so a
malformed message is refused with its reason instead of failing somewhere past the decoder.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
import typing
from typing import Any


class WireTypeError(ValueError):
    """A field missing from a message, or of another type than declared."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field
        self.message = message


# the exact Python types a msgpack value of a plain declared type decodes to (a boolean is no integer)
PLAIN_TYPES: dict[Any, tuple[type, ...]] = {str: (str,), int: (int,), float: (int, float), bytes: (bytes,),
                                            bool: (bool,)}


@functools.cache
def declared_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def fields_of(cls: type, body: dict[str, Any], path: str = "", wire_types: dict[str, Any] | None = None,
              skip: frozenset[str] = frozenset()) -> dict[str, Any]:
    """The values of ``cls``'s fields found in ``body``, each checked against its declared type
    (``wire_types`` stand in for declarations where the wire form differs); a field without a
    default must be present. Keys that name no field are left out: a newer peer may send more."""
    declared = {**declared_types(cls), **(wire_types or {})}
    values = {}
    for field in dataclasses.fields(cls):
        if not field.init or field.name in skip:
            continue
        where = f"{path}{field.name}"
        if field.name in body:
            values[field.name] = checked(body[field.name], declared[field.name], where)
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise WireTypeError(where, f"{where} is missing")
    return values


def checked(value: Any, expected: Any, where: str) -> Any:
    """``value`` if it is of the type ``expected`` (an enum member, a dataclass or a NamedTuple
    built from it where one is declared); else WireTypeError."""
    origin, args = typing.get_origin(expected), typing.get_args(expected)
    if expected is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        for option in args:  # the option of the value's outer shape answers for what is inside
            if fits_outside(value, option):
                return checked(value, option, where)
        raise mismatch(value, expected, where)
    if not fits_outside(value, expected):
        raise mismatch(value, expected, where)
    if isinstance(expected, type) and issubclass(expected, enum.Enum):
        try:
            return expected(value)
        except (ValueError, TypeError):
            raise WireTypeError(where, f"{where} must be one of {', '.join(repr(m.value) for m in expected)}, "
                                       f"not {value!r:.40}") from None
    if dataclasses.is_dataclass(expected):
        from_wire = getattr(expected, "from_wire", None)
        if from_wire is not None:  # its wire form differs from its fields
            return from_wire(value, f"{where}.")
        return expected(**fields_of(expected, value, f"{where}."))
    if is_named_tuple(expected):  # travels as a list of its fields, in order
        if len(value) != len(expected._fields):
            raise WireTypeError(where, f"{where} must be a list of {len(expected._fields)}, not of {len(value)}")
        kinds = declared_types(expected)
        return expected(*(checked(item, kinds[name], f"{where}[{i}]")
                          for i, (item, name) in enumerate(zip(value, expected._fields))))
    if origin is list:
        plain = PLAIN_TYPES.get(args[0])
        if plain is not None and all(type(item) in plain for item in value):
            return value  # a long list of plain values (a vocabulary) passes without a call per item
        return [checked(item, args[0], f"{where}[{i}]") for i, item in enumerate(value)]
    if origin is tuple:
        if len(value) != len(args):
            raise WireTypeError(where, f"{where} must be a list of {len(args)}, not of {len(value)}")
        return tuple(checked(item, kind, f"{where}[{i}]") for i, (item, kind) in enumerate(zip(value, args)))
    if origin is dict:
        return {checked(key, args[0], f"{where} key"): checked(item, args[1], f"{where}.{key}")
                for key, item in value.items()}
    return value


def fits_outside(value: Any, expected: Any) -> bool:
    """Whether the value's own type is the declared one, its items unlooked at."""
    origin = typing.get_origin(expected) or expected
    if expected is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(fits_outside(value, option) for option in typing.get_args(expected))
    if expected is type(None):
        return value is None
    if isinstance(value, bool):  # msgpack's true and false are Python ints too
        return expected is bool
    if expected is float:
        return isinstance(value, (int, float))
    if isinstance(expected, type) and issubclass(expected, enum.Enum):
        return True  # which values it takes is the enum's to say
    if dataclasses.is_dataclass(expected):
        return isinstance(value, dict)
    if origin is tuple or is_named_tuple(expected):
        return isinstance(value, list)
    return isinstance(value, origin)


def is_named_tuple(expected: Any) -> bool:
    return isinstance(expected, type) and issubclass(expected, tuple) and hasattr(expected, "_fields")


def mismatch(value: Any, expected: Any, where: str) -> WireTypeError:
    return WireTypeError(where, f"{where} must be {type_name(expected)}, not {value_kind(value)}")


def type_name(expected: Any) -> str:
    """A declared type as a message says it."""
    origin = typing.get_origin(expected) or expected
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_name(option) for option in typing.get_args(expected))
    if origin is dict or dataclasses.is_dataclass(expected):
        return "a map"
    if origin in (list, tuple) or is_named_tuple(expected):
        return "a list"
    return {str: "a string", int: "an integer", float: "a number", bool: "true or false", bytes: "bytes",
            type(None): "nil"}.get(origin, getattr(origin, "__name__", str(origin)))


def value_kind(value: Any) -> str:
    """What a decoded msgpack value is, as a message says it."""
    if isinstance(value, bool):
        return "a boolean"
    for kind, name in ((type(None), "nil"), (int, "an integer"), (float, "a number"), (str, "a string"),
                       (bytes, "bytes"), (list, "a list"), (dict, "a map")):
        if isinstance(value, kind):
            return name
    return type(value).__name__
