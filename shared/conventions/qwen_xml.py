"""qwen_xml (Qwen3.5, Qwen3-Coder): Hermes's tags, but a call block holds the call as tags, and a
call that opens ends the reasoning, closed or not. The template says which (it writes
``<function=`` and ``<parameter=``).

Between ``<tool_call>`` and ``</tool_call>`` such a model writes the call as tags, one parameter
per block, each value on lines of its own::

    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    2
    </parameter>
    </function>

A value is text as it stands when its property is a string; otherwise it is JSON (a number,
``true``, a list, an object), and a value that does not read as JSON is kept as text.
``parse_call`` turns a body into (name, arguments) by the request's tool schemas; ``lark``
writes the Lark grammar (llguidance) of one or more calls of the given tools: every required
parameter present, in the schema's order with the optional ones where they fall, string values
free text that cannot close their block (within their length bounds, if any, and then without
"<"; a pattern is not held), enums their listed values, every other value held to its schema as
JSON.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from shared.chat_template import ChatTemplate
from shared.conventions.base import LEAD, Functions
from shared.conventions.call_streams import XmlCallReader
from shared.conventions.calls import CallSyntax
from shared.conventions.hermes import Hermes
from shared.conventions.reasoning import ReasoningSplitter, Splitter
from shared.tokenizer import Tokenizer

FUNCTION = re.compile(r"<function=([^>\n]+)>(.*)</function>", re.S)
PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)
# A string value and its block's end, as one terminal: text in which no "</" starts, then the
# closing tag (one lexeme, so the value's own line breaks never compete with the closing one).
STRING_AND_CLOSE = r"/([^<]|<[^\/])*\n<\/parameter>\n/"
NL = "\n"
CLOSE = json.dumps("\n</parameter>\n")
# a template that writes calls as tags holds these
TEMPLATE_MARKS = ("<function=", "<parameter=")


def properties(schema: Any) -> dict[str, Any]:
    props = schema.get("properties") if isinstance(schema, dict) else None
    return props if isinstance(props, dict) else {}


def is_string(schema: Any) -> bool:
    """A property whose value is written as bare text: type string (alone, or beside null)."""
    if not isinstance(schema, dict):
        return False
    kind = schema.get("type")
    if isinstance(kind, list):
        return "string" in kind and all(k in ("string", "null") for k in kind)
    if kind is None and isinstance(schema.get("enum"), list):
        return all(isinstance(v, str) for v in schema["enum"])
    return kind == "string"


def value_of(text: str, schema: Any) -> Any:
    if is_string(schema):
        return text
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return text


def parse_call(raw: str, schemas: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """(name, arguments) of one call's body, or None when it is not a well-formed call;
    ``schemas`` maps each tool's name to its parameters' schema."""
    found = FUNCTION.fullmatch(raw.strip())
    if found is None:
        return None
    name, body = found[1].strip(), found[2]
    if not name:
        return None
    props = properties(schemas.get(name))
    arguments: dict[str, Any] = {}
    at = 0
    for parameter in PARAMETER.finditer(body):
        if body[at:parameter.start()].strip():
            return None  # text between parameters: not a call
        key, value = parameter[1].strip(), parameter[2]
        # the value's own lines: the line breaks after the opening tag and before the closing one
        # are layout
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
        arguments[key] = value_of(value, props.get(key))
        at = parameter.end()
    if body[at:].strip():
        return None
    return name, arguments


def _literal(text: str) -> str:
    return json.dumps(text)


def _value_rule(schema: Any) -> str:
    """The grammar of one parameter's value and the tag that closes its block."""
    if isinstance(schema, dict) and isinstance(schema.get("enum"), list) and schema["enum"] and is_string(schema):
        return f"({' | '.join(_literal(v) for v in schema['enum'])}) {CLOSE}"
    if is_string(schema):
        low, high = schema.get("minLength", 0), schema.get("maxLength")
        if isinstance(low, int) and (isinstance(high, int) or low):
            # a bounded string: its characters counted, none of them "<"
            return f"/[^<]{{{low},{high if isinstance(high, int) else ''}}}\\n<\\/parameter>\\n/"
        return STRING_AND_CLOSE
    return f"%json {json.dumps(schema if isinstance(schema, dict) else {})} {CLOSE}"


def lark(functions: list[tuple[str, dict[str, Any]]], open_tag: str, close_tag: str, parallel: bool,
         optional: bool = False, lead: bool = False) -> str:
    """A Lark grammar for one or more calls of these (name, parameters schema) tools; the tags
    are special tokens, named as such. ``optional``: free text first, and a call may follow."""
    rules = []
    for i, (name, schema) in enumerate(functions):
        props = properties(schema)
        required = set(schema.get("required") or []) if isinstance(schema, dict) else set()
        parts = []
        for j, (key, prop) in enumerate(props.items()):
            rules.append(f"fn_{i}_p{j}: {_literal(f'<parameter={key}>{NL}')} {_value_rule(prop)}")
            parts.append(f"fn_{i}_p{j}" + ("" if key in required else "?"))
        rules.append(" ".join([f"fn_{i}:", _literal(f"<function={name}>{NL}"), *parts, '"</function>"']))
    alternatives = " | ".join(f"fn_{i}" for i in range(len(functions)))
    call = f'tc: {open_tag} "\\n" ({alternatives}) "\\n" {close_tag}'
    if optional:
        start = 'start: TEXT (tc ("\\n" tc)* "\\n"?)?' if parallel else 'start: TEXT (tc "\\n"?)?'
        return "\n".join([start, "TEXT: /(.|\\n)*/", call, *rules]) + "\n"
    more = ' ("\\n" tc)*' if parallel else ""
    return "\n".join([f"start: {LEAD if lead else ''}tc{more}", call, *rules]) + "\n"


class QwenXml(Hermes):
    name = "qwen_xml"

    def detects(self, tokenizer: Tokenizer, template: ChatTemplate | None) -> bool:
        return template is not None and all(mark in template.source for mark in TEMPLATE_MARKS)

    def splitter(self, *, starts_inside: Callable[[], bool], model_calls: bool, reads_calls: bool,
                 prefilled: bool) -> Splitter:
        # a call's opening tag ends the reasoning too (it stays in the text, for the calls' parser)
        return ReasoningSplitter(self.reasoning, inside=starts_inside(),
                                 call_opens=self.calls.open if model_calls else None)

    def call_syntax(self, tools: list[dict[str, Any]], forced: list[dict[str, Any]] | None) -> CallSyntax:
        # a value is read by its tool's schema (a string stays text)
        schemas = {tool["function"]["name"]: tool["function"].get("parameters") for tool in tools}
        return CallSyntax(None, None, False, lambda raw: parse_call(raw, schemas),
                          reader=lambda: XmlCallReader(schemas, is_string, value_of))

    def calls_lark(self, tokenizer: Tokenizer, functions: Functions, parallel: bool, optional: bool = False,
                   thinking: bool = False) -> str:
        return lark(functions, self.calls.open, self.calls.close, parallel, optional, lead=thinking)


QWEN_XML = QwenXml()
