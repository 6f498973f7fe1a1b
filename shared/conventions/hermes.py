"""Hermes (the Qwen3 family and its kin): reasoning between ``<think>`` tags, and each call a
block of JSON between ``<tool_call>`` tags::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

It is also the convention of a model whose vocabulary holds no convention's markers: its tags
are what such a reply is searched for, and never found.
"""

from __future__ import annotations

import json
from typing import Any

from shared.chat_template import ChatTemplate
from shared.conventions.base import LEAD, Convention, Functions
from shared.conventions.call_streams import JsonCallReader
from shared.conventions.calls import CallSyntax, json_call_schema, parse_json_call
from shared.protocol import Tags
from shared.tokenizer import Tokenizer

THINK = Tags("<think>", "</think>")
CALLS = Tags("<tool_call>", "</tool_call>")
# a JSON body: "</tool_call>" inside a string does not close the call; it streams as it is written
SYNTAX = CallSyntax('"', "\\", True, parse_json_call, reader=JsonCallReader)


def lark(functions: Functions, tags: Tags, parallel: bool, optional: bool = False, lead: bool = False) -> str:
    """A Lark grammar for one or more call blocks of these (name, arguments schema) tools
    (``optional``: text, which the calls may follow, and no call at all is fine too).

    The tags are special tokens of the model's vocabulary, so the grammar names them as tokens
    (a string literal would never match them), and free text, which cannot hold a special token,
    ends where a call opens. ``lead``: after a reasoning block the model's own layout, up to two
    line breaks, may come before the first call.
    """
    alternatives = " | ".join(f"fn_{i}" for i in range(len(functions)))
    rules = "\n".join(f"fn_{i}: %json {json.dumps(json_call_schema(name, arguments))}"
                      for i, (name, arguments) in enumerate(functions))
    call = f'tc: {tags.open} "\\n" ({alternatives}) "\\n" {tags.close}\n'
    if optional:
        # after the last call only layout: the reply ends there (Hermes models stop after calls)
        start = 'start: TEXT (tc ("\\n" tc)* "\\n"?)?\n' if parallel else 'start: TEXT (tc "\\n"?)?\n'
        return f"{start}TEXT: /(.|\\n)*/\n{call}{rules}\n"
    more = ' ("\\n" tc)*' if parallel else ""
    return f"start: {LEAD if lead else ''}tc{more}\n{call}{rules}\n"


class Hermes(Convention):
    name = "hermes"
    reasoning = THINK
    calls = CALLS
    reasoning_tokens = (THINK.open, THINK.close)
    call_tokens = (CALLS.open, CALLS.close)

    def detects(self, tokenizer: Tokenizer, template: ChatTemplate | None) -> bool:
        return True  # the last of the registry: whatever no other convention claims

    def call_syntax(self, tools: list[dict[str, Any]], forced: list[dict[str, Any]] | None) -> CallSyntax:
        return SYNTAX

    def calls_lark(self, tokenizer: Tokenizer, functions: Functions, parallel: bool, optional: bool = False,
                   thinking: bool = False) -> str:
        return lark(functions, self.calls, parallel, optional, lead=thinking)


HERMES = Hermes()
