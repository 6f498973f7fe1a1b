"""Reading a request body: JSON parsing, field types and unknown fields, with messages that
name the field at fault (``messages[2].content``) and what it should be."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from shared.errors import InvalidRequestError

_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "a boolean",
               list: "an array", dict: "an object", type(None): "null"}


def parse_json_object(body: bytes) -> dict[str, Any]:
    if not body.strip():
        raise InvalidRequestError("the request body is empty; send a JSON object")
    try:
        value = json.loads(body)
    except UnicodeDecodeError:
        raise InvalidRequestError("the request body is not UTF-8 text")
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(
            f"the request body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}")
    if not isinstance(value, dict):
        raise InvalidRequestError(f"the request body must be a JSON object, not {_describe(value)}")
    return value


def _describe(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    for kind, name in _TYPE_NAMES.items():
        if isinstance(value, kind):
            return name
    return type(value).__name__


def _matches(value: Any, kinds: tuple[type, ...]) -> bool:
    if isinstance(value, bool):
        return bool in kinds
    if isinstance(value, int) and float in kinds:
        return True
    return isinstance(value, kinds)


def check_type(value: Any, kinds: type | tuple[type, ...], where: str) -> Any:
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    if not _matches(value, kinds):
        wanted = " or ".join(_TYPE_NAMES.get(k, k.__name__) for k in kinds)
        raise InvalidRequestError(f"'{where}' must be {wanted}, got {_describe(value)}", param=where)
    return value


def field(obj: dict[str, Any], key: str, kinds: type | tuple[type, ...], where: str = "",
          required: bool = False, default: Any = None) -> Any:
    """obj[key] checked against kinds; missing or null gives default (or an error if required)."""
    path = f"{where}.{key}" if where else key
    value = obj.get(key)
    if value is None:
        if required:
            raise InvalidRequestError(f"'{path}' is required", param=path)
        return default
    return check_type(value, kinds, path)


def number_in(obj: dict[str, Any], key: str, low: float, high: float, where: str = "",
              default: Any = None, integer: bool = False) -> Any:
    value = field(obj, key, int if integer else float, where, default=default)
    if value is None or value is default:
        return value
    path = f"{where}.{key}" if where else key
    if not low <= value <= high:
        raise InvalidRequestError(f"'{path}' must be between {low:g} and {high:g}, got {value}", param=path)
    return value


def reject_unknown(obj: dict[str, Any], known: Iterable[str], where: str = "") -> None:
    unknown = sorted(set(obj) - set(known))
    if unknown:
        path = f"{where}.{unknown[0]}" if where else unknown[0]
        raise InvalidRequestError(
            f"unknown field '{path}'" + (f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else "")
            + "; see docs/API.md for the fields this server takes", param=path)


def text_of_parts(content: Any, where: str, part_types: tuple[str, ...] = ("text",)) -> str:
    """A message content that is a string or a list of text parts, as one string."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    check_type(content, (str, list), where)
    pieces = []
    for i, part in enumerate(content):
        path = f"{where}[{i}]"
        check_type(part, dict, path)
        kind = field(part, "type", str, path, required=True)
        if kind not in part_types:
            raise InvalidRequestError(
                f"'{path}.type' is {kind!r}; this server reads only {', '.join(part_types)} parts here "
                f"(the model takes text only)", param=f"{path}.type")
        # a refusal part carries its words under "refusal", every other text part under "text"
        pieces.append(field(part, "refusal" if kind == "refusal" else "text", str, path, required=True))
    return "".join(pieces)
