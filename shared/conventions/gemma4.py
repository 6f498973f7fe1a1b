"""Gemma 4: reasoning in a thought channel, ``<|channel>thought`` … ``<channel|>``, and each call a
block ``<|tool_call>call:NAME{key:value,…}<tool_call|>``.

Between its call tags a Gemma 4 model writes ``call:NAME{key:value,…}``: keys bare, strings
between ``<|"|>`` quotes (a token of its own, with no escapes inside), numbers, ``true``,
``false``, ``null``, lists in ``[…]`` and objects in ``{…}``, written compactly, keys in sorted
order (as the chat template shows them). ``parse_call`` turns a body into (name, arguments);
``lark`` writes the Lark grammar (llguidance) of one or more calls of the given tools, each
call's arguments held to its JSON schema as far as this syntax can say it: every property's
value to its type, its enum or const (strings to their pattern or length bounds), the required
properties present, properties in sorted order, none but the declared ones unless the schema
allows more. Numeric bounds and array lengths are not held.
"""

from __future__ import annotations

import json
import re
from typing import Any

from shared.conventions.base import LEAD, Convention, Functions
from shared.conventions.call_streams import GemmaCallReader
from shared.conventions.calls import CallSyntax
from shared.errors import InvalidRequestError
from shared.protocol import Tags
from shared.tokenizer import Tokenizer

CHANNEL = "<|channel>"  # a token, which the thought channel's opening tag starts with
THOUGHT = Tags(CHANNEL + "thought", "<channel|>")
CALLS = Tags("<|tool_call>", "<tool_call|>")
QUOTE = '<|"|>'
CALL_PREFIX = "call:"
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_WHITESPACE = " \t\n"


class _Malformed(Exception):
    pass


def parse_call(raw: str) -> tuple[str, dict[str, Any]] | None:
    """(name, arguments) of one call's body, or None when it is not a well-formed call."""
    body = raw.strip()
    brace = body.find("{")
    if not body.startswith(CALL_PREFIX) or brace < 0:
        return None
    name = body[len(CALL_PREFIX):brace].strip()
    if not name:
        return None
    try:
        arguments, end = _value(body, brace)
    except (_Malformed, RecursionError):  # RecursionError: nested past any real arguments
        return None
    if end != len(body) or not isinstance(arguments, dict):
        return None
    return name, arguments


def _skip(text: str, at: int) -> int:
    while at < len(text) and text[at] in _WHITESPACE:
        at += 1
    return at


def _value(text: str, at: int) -> tuple[Any, int]:
    at = _skip(text, at)
    if text.startswith(QUOTE, at):
        end = text.find(QUOTE, at + len(QUOTE))
        if end < 0:
            raise _Malformed
        return text[at + len(QUOTE):end], end + len(QUOTE)
    if text.startswith("{", at):
        return _container(text, at + 1, "}", keyed=True)
    if text.startswith("[", at):
        return _container(text, at + 1, "]", keyed=False)
    for word, value in (("true", True), ("false", False), ("null", None)):
        if text.startswith(word, at):
            return value, at + len(word)
    number = _NUMBER.match(text, at)
    if number is None:
        raise _Malformed
    literal = number.group()
    return (float(literal) if any(c in literal for c in ".eE") else int(literal)), number.end()


def _container(text: str, at: int, close: str, keyed: bool) -> tuple[Any, int]:
    items: dict[str, Any] | list[Any] = {} if keyed else []
    at = _skip(text, at)
    if text.startswith(close, at):
        return items, at + 1
    while True:
        if keyed:
            at = _skip(text, at)
            if text.startswith(QUOTE, at):  # a quoted key, as the declarations write them
                key, at = _value(text, at)
            else:
                colon = text.find(":", at)
                if colon < 0:
                    raise _Malformed
                key, at = text[at:colon].strip(), colon
                if not key or any(c in key for c in "{}[],"):
                    raise _Malformed
            at = _skip(text, at)
            if not text.startswith(":", at):
                raise _Malformed
            value, at = _value(text, at + 1)
            items[key] = value  # type: ignore[index]
        else:
            value, at = _value(text, at)
            items.append(value)  # type: ignore[union-attr]
        at = _skip(text, at)
        if text.startswith(",", at):
            at += 1
        elif text.startswith(close, at):
            return items, at + 1
        else:
            raise _Malformed


# --- the grammar of a forced call -------------------------------------------------------------

ANY = "(.|\\n)*"  # any text, line breaks included
BARE_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")


def _searching(pattern: str) -> str | None:
    """A JSON schema pattern (matched anywhere in the string unless anchored) as a regex the
    whole string must match; None where its anchors are not plainly at its two ends (an
    alternation at its top level, an anchor that is escaped or inside)."""
    depth, escaped, in_class = 0, False, False
    for char in pattern:
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif in_class:
            in_class = char != "]"
        elif char == "[":
            in_class = True
        elif char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        elif char == "|" and depth == 0:
            return None
    starts = pattern.startswith("^")
    backslashes = len(pattern[:-1]) - len(pattern[:-1].rstrip("\\"))
    ends = pattern.endswith("$") and backslashes % 2 == 0
    core = pattern[1 if starts else 0:len(pattern) - 1 if ends else len(pattern)]
    if "^" in core.replace("\\^", "").replace("[^", "") or "$" in core.replace("\\$", ""):
        return None
    return ("" if starts else ANY) + f"(?:{core})" + ("" if ends else ANY)


def _slashes_escaped(regex: str) -> str:
    """The regex inside Lark's /…/: a slash not already escaped gets its backslash."""
    return re.sub(r"(?<!\\)((?:\\\\)*)/", r"\1\\/", regex)


class _Rules:
    """Lark rules for the values of JSON schemas, in this syntax; the quote as token ``q``."""

    def __init__(self, quote_id: int):
        self.quote = f"<[{quote_id}]>"
        self.lines: list[str] = []
        self.count = 0

    def new(self, body: str) -> str:
        name = f"v{self.count}"
        self.count += 1
        self.lines.append(f"{name}: {body}")
        return name

    def literal(self, value: Any) -> str:
        if isinstance(value, str):
            return f"{self.quote} {json.dumps(value)} {self.quote}"
        if isinstance(value, bool) or value is None:
            return json.dumps(json.dumps(value))
        if isinstance(value, (int, float)):
            return json.dumps(json.dumps(value))
        return "g4_value"

    def value(self, schema: Any) -> str:
        """A Lark expression for a value of ``schema``."""
        if not isinstance(schema, dict):
            return "g4_value"
        if "const" in schema:
            return self.literal(schema["const"])
        if isinstance(schema.get("enum"), list) and schema["enum"]:
            return "(" + " | ".join(self.literal(v) for v in schema["enum"]) + ")"
        for combinator in ("anyOf", "oneOf"):
            if isinstance(schema.get(combinator), list) and schema[combinator]:
                return "(" + " | ".join(self.value(s) for s in schema[combinator]) + ")"
        kind = schema.get("type")
        if isinstance(kind, list):
            return "(" + " | ".join(self.value({**schema, "type": k}) for k in kind) + ")" if kind else "g4_value"
        if kind == "string":
            return self.string(schema)
        if kind == "integer":
            return "G4_INT"
        if kind == "number":
            return "G4_NUMBER"
        if kind == "boolean":
            return '("true" | "false")'
        if kind == "null":
            return '"null"'
        if kind == "array":
            item = self.value(schema.get("items", {}))
            return self.new(f'"[" ({item} ("," {item})*)? "]"')
        if kind == "object" or "properties" in schema:
            return self.object(schema)
        return "g4_value"

    def string(self, schema: dict[str, Any]) -> str:
        """A string, held to its pattern or its length bounds where it has them."""
        pattern = schema.get("pattern")
        low, high = schema.get("minLength", 0), schema.get("maxLength")
        if isinstance(pattern, str):
            body = _searching(pattern)
            if body is None:
                return "g4_string"  # a pattern this cannot place safely: the string is left free
        elif isinstance(low, int) and (isinstance(high, int) or low):
            body = f"(.|\\n){{{low},{high if isinstance(high, int) else ''}}}"
        else:
            return "g4_string"
        return self.new(f"{self.quote} /{_slashes_escaped(body)}/ {self.quote}")

    def key(self, name: str) -> str:
        """A property name and its colon: bare where the syntax allows, else quoted."""
        if BARE_KEY.fullmatch(name):
            return json.dumps(name + ":")
        return f'{self.quote} {json.dumps(name)} {self.quote} ":"'

    def object(self, schema: dict[str, Any]) -> str:
        properties = schema.get("properties")
        if not isinstance(properties, dict) or not properties:
            return "g4_dict"
        required = set(schema.get("required") or [])
        names = sorted(properties)
        pairs = [f"{self.key(name)} {self.value(properties[name])}" for name in names]
        extra = schema.get("additionalProperties", True) is not False
        # rest: what may follow once a pair is written, from property i on; first: the same
        # while none is (no comma before it). Each is a rule of its own, or "" for nothing, so
        # that optional properties do not multiply the grammar's size.
        rest = '("," g4_pair)*' if extra else ""
        first = '(g4_pair ("," g4_pair)*)?' if extra else ""
        for index in reversed(range(len(names))):
            pair = pairs[index]
            if names[index] in required:
                rest, first = self.new(f'"," {pair} {rest}'), self.new(f"{pair} {rest}")
            else:
                first = self.new(f"{pair} {rest} | {first}" if first else f"({pair} {rest})?")
                rest = self.new(f'("," {pair})? {rest}')
        return self.new(f'"{{" {first} "}}"')


def lark(tools: list[tuple[str, dict[str, Any]]], open_id: int, close_id: int, quote_id: int,
         parallel: bool, optional: bool = False, lead: bool = False) -> str:
    """Calls of these tools, (name, arguments schema) each, between the call tag tokens.

    ``optional``: free text first, then calls or none. ``lead``: up to two line breaks may
    come before the first call (after a reasoning block)."""
    rules = _Rules(quote_id)
    functions = [f"fn_{i}: {json.dumps(CALL_PREFIX + name)} {rules.object(schema) if schema else 'g4_dict'}"
                 for i, (name, schema) in enumerate(tools)]
    alternatives = " | ".join(f"fn_{i}" for i in range(len(tools)))
    calls = "tc*" if parallel else "tc?"
    if optional:
        start = f"start: TEXT {calls}\nTEXT: /(.|\\n)*/"
    else:
        start = "start: " + (LEAD if lead else "") + ("tc+" if parallel else "tc")
    q = rules.quote
    return "\n".join([
        start,
        f"tc: <[{open_id}]> ({alternatives}) <[{close_id}]>",
        *functions,
        *rules.lines,
        "g4_value: g4_string | g4_dict | g4_array | G4_NUMBER | \"true\" | \"false\" | \"null\"",
        f"g4_string: {q} G4_TEXT {q}",
        'g4_dict: "{" (g4_pair ("," g4_pair)*)? "}"',
        'g4_pair: G4_KEY ":" g4_value',
        'g4_array: "[" (g4_value ("," g4_value)*)? "]"',
        "G4_TEXT: /(.|\\n)*/",
        "G4_KEY: /[A-Za-z_][A-Za-z0-9_.\\-]*/",
        "G4_INT: /-?(0|[1-9][0-9]*)/",
        "G4_NUMBER: /-?(0|[1-9][0-9]*)(\\.[0-9]+)?([eE][+-]?[0-9]+)?/",
    ]) + "\n"


# strings between quote tokens, which may hold line breaks; no escapes
SYNTAX = CallSyntax(QUOTE, None, False, parse_call, reader=lambda: GemmaCallReader(QUOTE, CALL_PREFIX))


class Gemma4(Convention):
    name = "gemma4"
    reasoning = THOUGHT
    calls = CALLS
    reasoning_tokens = (CHANNEL, THOUGHT.close)
    call_tokens = (CALLS.open, CALLS.close, QUOTE)

    def call_syntax(self, tools: list[dict[str, Any]], forced: list[dict[str, Any]] | None) -> CallSyntax:
        return SYNTAX

    def calls_lark(self, tokenizer: Tokenizer, functions: Functions, parallel: bool, optional: bool = False,
                   thinking: bool = False) -> str:
        ids = [tokenizer.piece_to_id(text) for text in (self.calls.open, self.calls.close, QUOTE)]
        if None in ids:
            raise InvalidRequestError("this model's vocabulary lacks its call tokens; tool_choice cannot force a call")
        return lark(functions, *ids, parallel=parallel, optional=optional, lead=thinking)


GEMMA4 = Gemma4()
