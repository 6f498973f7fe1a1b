"""The Hermes tool-call stream parser alone, on crafted replies cut at every character boundary.

However a reply is cut into pieces, the parser must give the same text and the same calls, and
every call's argument fragments must join, at every step, into JSON a partial-JSON reader (the
one Anthropic's SDK uses) accepts.
"""

from __future__ import annotations

import json
from typing import Any

import jiter
import pytest

from gateway.neutral import (
    TextDelta,
    ToolCallAbandoned,
    ToolCallArgumentsDelta,
    ToolCallEnd,
    ToolCallStart,
)
from gateway.dialects.common import openai_tool_choice
from shared.conventions.calls import ToolCallParser, json_fragments
from shared.conventions.hermes import HERMES

WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TIME = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "Europe/Paris", "format": 24}}\n</tool_call>'


def call(name: str, arguments: dict[str, Any]) -> tuple[str, str, dict[str, Any]]:
    return ("call", name, arguments)


CASES: list[tuple[str, str, list[Any]]] = [
    ("plain text", "The weather is fine.\n", [("text", "The weather is fine.\n")]),
    ("one call", WEATHER, [call("get_weather", {"city": "Paris"})]),
    ("two calls", WEATHER + "\n" + TIME + "\n",
     [call("get_weather", {"city": "Paris"}), call("get_time", {"zone": "Europe/Paris", "format": 24})]),
    ("text around a call", "Let me check.\n" + WEATHER + "\nDone.",
     [("text", "Let me check."), call("get_weather", {"city": "Paris"}), ("text", "Done.")]),
    ("malformed json", 'Hm.\n<tool_call>\n{"name": "f", "arguments": {"a": }\n</tool_call>',
     [("text", 'Hm.\n<tool_call>\n{"name": "f", "arguments": {"a": }\n</tool_call>')]),
    ("unclosed call at the end", 'Sure.\n<tool_call>\n{"name": "f", "arguments": {"a": 1',
     [("text", 'Sure.\n<tool_call>\n{"name": "f", "arguments": {"a": 1')]),
    ("missing name", '<tool_call>{"arguments": {}}</tool_call>', [("text", '<tool_call>{"arguments": {}}</tool_call>')]),
    ("arguments not an object", '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
     [("text", '<tool_call>{"name": "f", "arguments": [1]}</tool_call>')]),
    ("closing tag inside a json string",
     '<tool_call>{"name": "echo", "arguments": {"text": "a </tool_call> b {x} <tool_call>"}}</tool_call>',
     [call("echo", {"text": "a </tool_call> b {x} <tool_call>"})]),
    ("nested braces and escapes",
     '<tool_call>{"name": "f", "arguments": {"a": {"b": [1, {"c": "}]"}]}, "q": "say \\"hi\\"\\\\n"}}</tool_call>',
     [call("f", {"a": {"b": [1, {"c": "}]"}]}, "q": 'say "hi"\\n'})]),
    ("unicode", 'Voilà ✓ <tool_call>{"name": "météo", "arguments": {"city": "Zürich 東京 🌧", "e": "\\u00e9"}}</tool_call>',
     [("text", "Voilà ✓"), call("météo", {"city": "Zürich 東京 🌧", "e": "é"})]),
    ("arguments written as a json string", '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>',
     [call("f", {"a": 1})]),
    ("no arguments", '<tool_call>{"name": "now"}</tool_call>', [call("now", {})]),
    ("an unterminated string does not swallow the next call",
     '<tool_call>{"name": "a", "arguments": {"x": "oops}\n</tool_call>\n' + WEATHER,
     [("text", '<tool_call>{"name": "a", "arguments": {"x": "oops}\n</tool_call>'), call("get_weather", {"city": "Paris"})]),
    ("a call left open before the next one", '<tool_call>{"name": "a"\n' + WEATHER,
     [("text", '<tool_call>{"name": "a"\n'), call("get_weather", {"city": "Paris"})]),
    ("tag-like text", "a <tool b <tool_cal", [("text", "a <tool b <tool_cal")]),
]


def splits(text: str):
    """Every way of cutting text in two, and one character at a time."""
    for cut in range(len(text) + 1):
        yield [text[:cut], text[cut:]]
    yield list(text)


def run(pieces: list[str], limit: int | None = None) -> tuple[list[Any], ToolCallParser]:
    parser = HERMES.call_parser(limit)
    events = []
    for piece in pieces:
        events += parser.push(piece)
    events += parser.flush()
    return events, parser


def summarize(events: list[Any]) -> list[Any]:
    """Adjacent text joined; each call checked for a well-formed event sequence and summarized."""
    out: list[Any] = []
    open_call: ToolCallStart | None = None
    fragments: list[str] = []
    for event in events:
        if isinstance(event, TextDelta):
            assert open_call is None and event.text
            if out and out[-1][0] == "text":
                out[-1] = ("text", out[-1][1] + event.text)
            else:
                out.append(("text", event.text))
        elif isinstance(event, ToolCallStart):
            assert open_call is None
            open_call, fragments = event, []
        elif isinstance(event, ToolCallArgumentsDelta):
            assert open_call is not None and event.index == open_call.index and event.json_fragment
            fragments.append(event.json_fragment)
            so_far = "".join(fragments).encode()
            jiter.from_json(so_far, partial_mode=True)  # what Anthropic's SDK does on each delta
            jiter.from_json(so_far, partial_mode="trailing-strings")
        elif isinstance(event, ToolCallAbandoned):
            # a call announced while it was written that did not read as a call: its text follows
            assert open_call is not None and (event.index, event.call_id) == (open_call.index, open_call.call_id)
            open_call = None
        else:
            assert isinstance(event, ToolCallEnd) and open_call is not None
            assert (event.index, event.call_id, event.name) == (open_call.index, open_call.call_id, open_call.name)
            assert "".join(fragments) == event.arguments_json
            out.append(("call", event.name, json.loads(event.arguments_json)))
            open_call = None
    assert open_call is None
    return out


@pytest.mark.parametrize("name, reply, expected", CASES, ids=[case[0] for case in CASES])
def test_any_cut_gives_the_same_text_and_calls(name, reply, expected):
    for pieces in splits(reply):
        events, parser = run(pieces)
        assert summarize(events) == expected, pieces
        assert parser.completed == sum(item[0] == "call" for item in expected)


def test_calls_are_numbered_in_order_with_distinct_ids():
    events, _ = run([WEATHER, "\n", TIME])
    starts = [e for e in events if isinstance(e, ToolCallStart)]
    assert [s.index for s in starts] == [0, 1]
    assert len({s.call_id for s in starts}) == 2
    assert all(s.call_id.isalnum() for s in starts)


def test_a_limit_of_one_ends_the_reply_at_the_first_call():
    for pieces in splits("First.\n" + WEATHER + "\n" + TIME + "\nAfter."):
        events, parser = run(pieces, limit=1)
        assert summarize(events) == [("text", "First."), call("get_weather", {"city": "Paris"})]
        assert parser.done


def test_long_arguments_come_in_several_fragments():
    arguments = {"path": "src/main.py", "content": 'print("héllo")\n' * 5, "n": [1, 2.5, True, None]}
    events, _ = run([f'<tool_call>{json.dumps({"name": "write", "arguments": arguments})}</tool_call>'])
    fragments = [e.json_fragment for e in events if isinstance(e, ToolCallArgumentsDelta)]
    assert len(fragments) > 5
    assert json.loads("".join(fragments)) == arguments


@pytest.mark.parametrize("text", [
    json.dumps({"a": "x\\y\"z\u0001\n", "b": [True, False, None, -12.5e3], "c": {"d": "🌧" * 20}}),
    json.dumps({"k" * 30: "v" * 30}, ensure_ascii=False),
    "{}",
])
def test_json_fragments_never_cut_an_escape_or_a_literal(text):
    for size in range(1, 8):
        pieces = json_fragments(text, size)
        assert "".join(pieces) == text
        for end in range(1, len(pieces) + 1):
            prefix = "".join(pieces[:end])
            assert not prefix.endswith("\\") or prefix.endswith("\\\\")
            jiter.from_json(prefix.encode(), partial_mode=True)
            if end < len(pieces):
                # outside strings, a cut follows punctuation or a space: never mid-number or mid-literal
                assert prefix[-1] in '{[,: "' or _inside_string(prefix)


def _inside_string(prefix: str) -> bool:
    inside, escaped = False, False
    for char in prefix:
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif char == '"':
            inside = not inside
    return inside


@pytest.mark.parametrize("choice, forced", [
    ("auto", False), ("none", False), ("required", True), (None, False),
    ({"type": "function", "function": {"name": "f"}}, True), ({"type": "function", "name": "f"}, True),
    ({"type": "custom", "name": "apply_patch"}, True),
    ({"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": []}}, True),
    ({"type": "allowed_tools", "mode": "auto", "tools": []}, False),
])
def test_which_tool_choices_force_a_call(choice, forced):
    assert openai_tool_choice(choice).forces_call is forced
