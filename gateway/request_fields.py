"""Reading a request body: JSON parsing, field types and unknown fields, with messages that
name the field at fault (``messages[2].content``) and what it should be."""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from typing import Any

from shared.errors import InvalidRequestError

_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "a boolean",
               list: "an array", dict: "an object", type(None): "null"}


MAX_DEPTH = 256  # JSON schemas and tool arguments nest far less; deeper is an attack or a bug
MAX_INT_BITS = 13_300  # about 4,000 decimal digits, under what Python will print (4,300)
# A \uD800-\uDFFF escape: JSON allows one alone, Unicode text does not.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89abcdefABCDEF]")


def parse_json_object(body: bytes) -> dict[str, Any]:
    if not body.strip():
        raise InvalidRequestError("the request body is empty; send a JSON object")
    try:
        # strict UTF-8 first: json.loads would take UTF-16 or UTF-32 bytes, and raw surrogates
        text = body.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError:
        raise InvalidRequestError("the request body is not UTF-8 text")
    try:
        value = json.loads(text, parse_constant=_not_json)
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(
            f"the request body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}")
    except RecursionError:
        raise InvalidRequestError("the request body nests arrays or objects too deeply to read")
    except ValueError:  # an integer longer than Python converts (4,300 digits)
        raise InvalidRequestError("the request body holds an integer of more than 4,000 digits; "
                                  "no field of this API takes one")
    if not isinstance(value, dict):
        raise InvalidRequestError(f"the request body must be a JSON object, not {_describe(value)}")
    _check_values(value, check_text=_SURROGATE_ESCAPE.search(text) is not None)
    return value


def _not_json(name: str) -> None:
    raise InvalidRequestError(f"the request body is not valid JSON: {name} is not a JSON value")


def _check_values(value: Any, check_text: bool) -> None:
    """What JSON allows and the rest of the server could not handle, found in one pass over
    the body's values (iterative, so depth cannot exhaust the stack): nesting deeper than
    MAX_DEPTH, integers too long to print, and (when the body has escaped surrogates at all)
    strings with a lone surrogate, which are not Unicode text."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Iterable[Any] = item.values()
            if check_text:
                children = [*item.keys(), *item.values()]
        elif isinstance(item, list):
            children = item
        elif isinstance(item, str):
            if check_text:
                _check_text(item)
            continue
        elif isinstance(item, int) and item.bit_length() > MAX_INT_BITS:
            raise InvalidRequestError("the request body holds an integer of more than 4,000 digits; "
                                      "no field of this API takes one")
        elif isinstance(item, float) and not math.isfinite(item):  # 1e999
            raise InvalidRequestError("the request body holds a number too large to represent")
        else:
            continue
        if depth >= MAX_DEPTH:
            raise InvalidRequestError(f"the request body nests arrays or objects more than {MAX_DEPTH} deep")
        stack.extend((child, depth + 1) for child in children)


def _check_text(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(
            f"the request body has a string with a lone UTF-16 surrogate "
            f"({text[exc.start:exc.end].encode('unicode_escape').decode()}); strings must be valid Unicode")


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


@dataclass
class FieldTolerance:
    """One request's rule for fields this server does not know: ignored (the default; their
    paths are noted for the reply's ``x-lmserve-ignored-fields``) or refused (--strict-fields)."""

    strict: bool = False
    endpoint: str = ""  # the path the request came to, for the log line
    ignored: list[str] = dataclass_field(default_factory=list)


_tolerance: ContextVar[FieldTolerance | None] = ContextVar("field_tolerance", default=None)
_warned: set[str] = set()  # field names already logged by this process
log = logging.getLogger("lmserve.gateway")


@contextmanager
def tolerating(tolerance: FieldTolerance) -> Iterator[FieldTolerance]:
    """Parse a request under ``tolerance`` (outside one, unknown fields are ignored unnoted)."""
    token = _tolerance.set(tolerance)
    try:
        yield tolerance
    finally:
        _tolerance.reset(token)


def unknown_fields(obj: dict[str, Any], known: Iterable[str], where: str = "") -> None:
    """Fields of ``obj`` not in ``known``: a 400 under --strict-fields, else noted and ignored
    (a client adding a field of a newer API, or of another server's, keeps working)."""
    unknown = sorted(set(obj) - set(known))
    if not unknown:
        return
    tolerance = _tolerance.get() or FieldTolerance()
    paths = [f"{where}.{name}" if where else name for name in unknown]
    if tolerance.strict:
        raise InvalidRequestError(
            f"unknown field '{paths[0]}'" + (f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else "")
            + "; see docs/API.md for the fields this server takes", param=paths[0])
    tolerance.ignored.extend(paths)
    for name in unknown:
        if name not in _warned:
            _warned.add(name)
            log.warning('ignored unknown field "%s" in %s (said once per field name; --strict-fields refuses '
                        "unknown fields)", name, tolerance.endpoint or "a request")


# Parts a text-only model cannot read, in each dialect's names -> what the prompt says instead.
MEDIA_PARTS = {"image_url": "image", "input_image": "image", "image": "image", "input_audio": "audio",
               "file": "file", "input_file": "file", "document": "document"}


# A text part's fields in the OpenAI dialects (Responses' output_text carries annotations, logprobs).
TEXT_PART_FIELDS = {"type", "text", "refusal", "annotations", "logprobs"}


def media_placeholder(kind: str) -> str:
    """What stands in the prompt for a media part of an earlier turn: a past screenshot or a
    tool's image must not make every later turn of a conversation fail."""
    return f"[{MEDIA_PARTS[kind]} omitted: this model reads text only]"


def refuse_media(kind: str, path: str) -> None:
    """A media part in the turn being answered: the model cannot see what it is asked about."""
    raise InvalidRequestError(
        f"'{path}' is {'an' if MEDIA_PARTS[kind][0] in 'aeiou' else 'a'} {MEDIA_PARTS[kind]} ({kind!r}) in the turn "
        f"being answered, and the model on this server reads text only; send the question as text "
        f"(media in earlier turns are kept as a note that they were there)", param=f"{path}.type")


def last_user_index(messages: list[Any]) -> int:
    """The index of the last message (or input item) a user wrote: the turn being answered,
    whatever follows it (an assistant prefill, tool calls and their results). -1 if none."""
    return max((i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "user"), default=-1)


def text_of_parts(content: Any, where: str, part_types: tuple[str, ...] = ("text",),
                  current_turn: bool = False) -> str:
    """A message content that is a string or a list of text parts, as one string. Media parts
    become a placeholder text, or an error in the turn being answered (``current_turn``)."""
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
        if kind in MEDIA_PARTS:
            if current_turn:
                refuse_media(kind, path)
            pieces.append(media_placeholder(kind))
            continue
        if kind not in part_types:
            raise InvalidRequestError(
                f"'{path}.type' is {kind!r}; this server reads only {', '.join(part_types)} parts here",
                param=f"{path}.type")
        unknown_fields(part, TEXT_PART_FIELDS, path)
        # a refusal part carries its words under "refusal", every other text part under "text"
        pieces.append(field(part, "refusal" if kind == "refusal" else "text", str, path, required=True))
    return "".join(pieces)


def speculation_field(body: dict[str, Any]) -> bool:
    """This server's extension in every dialect: ``speculation: false`` turns speculative
    decoding off for the request (it never changes a token: a client measuring speed may want
    it off)."""
    return field(body, "speculation", bool, default=True)


def cartridges_field(body: dict[str, Any]) -> list[str]:
    """This server's extension in every dialect: ``cartridges``, the names of the KV prefixes
    (``--cartridges``) to serve the request behind; absent or empty: the worker's default."""
    names = field(body, "cartridges", list, default=[])
    for i, name in enumerate(names):
        if not isinstance(name, str) or not name:
            raise InvalidRequestError(f"'cartridges[{i}]' must be a cartridge's name (a non-empty string)",
                                      param="cartridges")
    return names


def token_ids(value: Any, where: str, vocab_size: int) -> list[int]:
    """A list of token ids, each an integer of the model's vocabulary."""
    check_type(value, list, where)
    for i, item in enumerate(value):
        check_type(item, int, f"{where}[{i}]")
        if not 0 <= item < vocab_size:
            raise InvalidRequestError(f"'{where}[{i}]' is {item}, which is not a token id of this model "
                                      f"(0 to {vocab_size - 1})", param=f"{where}[{i}]")
    return value
