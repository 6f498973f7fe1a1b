"""Inkling: a reply is a run of blocks, read into reasoning, text and calls; the grammar that
forces a call; and how a request's reasoning becomes the template's effort.

An Inkling model answers in blocks. The first follows the prompt's ``<|message_model|>``, each
later one opens with its own; a block is an optional author name, a content-kind token, its
text and ``<|end_message|>``; ``<|content_model_end_sampling|>`` (EOS) ends the reply::

    <|content_thinking|>I should check.<|end_message|><|message_model|><|content_text|>Let me
    look.<|end_message|><|message_model|>get_weather<|content_invoke_tool_json|>{"name":
    "get_weather","args":{"city":"Paris"}}<|end_message|><|content_model_end_sampling|>

The markers are control tokens, which the gateway's detokenizer drops from any other model's
reply; for this convention it keeps them (``marker_ids``), and ``InklingBlocks``, the reasoning
splitter of such a model, takes every one of them out again. The template thinks on request by
``reasoning_effort`` and declares tools with ``tool_declare``.

Decisions a client may notice:

- Thinking blocks are reasoning, text blocks (and xml ones) text; reasoning and text stream as
  they arrive, holding back only what may be the start of a marker. No marker and no author
  name is ever shown. Two blocks of the same kind in a row are joined by a blank line.
- A call block is handed on as it is written, its markers included, to the tool-call parser
  (``shared/conventions/calls.py``, tags ``<|content_invoke_tool_json|>`` and ``<|end_message|>``),
  which streams it: JSON with a ``name`` and an object of ``args`` (``SYNTAX``). A malformed call, or one
  cut off when the reply ends (max_tokens), comes back as the text of its body; on a request
  without tools a call block is text too.
- A marker ends its block wherever it falls, inside a JSON string too: it is a control token,
  which no string holds. A kind token inside a block ends that block and starts one of its kind.
- Text before any kind token that cannot be an author name (a space, punctuation, more than 64
  characters) is text: a reply that writes no markers still reads as text.
- Reasoning: a request that asks for it renders the template with the client's effort as its
  ``reasoning_effort`` (OpenAI's effort words pass as they are; Anthropic's thinking budget
  becomes one, see ``gateway/dialects/anthropic_messages.py``), or the template's default (0.9)
  when the client named none; a request that does not ask renders ``reasoning_effort`` "none".
  A thinking block the model writes anyway is still reasoning, never text.
- An Anthropic prefill continues a text block: the prompt gets ``<|content_text|>`` before it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from shared.conventions.base import Convention, Functions
from shared.conventions.call_streams import JsonCallReader
from shared.conventions.calls import CallSyntax, parse_json_call
from shared.conventions.events import ReasoningDelta, TextDelta
from shared.conventions.reasoning import Splitter, partial_suffix
from shared.errors import InvalidRequestError
from shared.protocol import Tags
from shared.tokenizer import Tokenizer

MESSAGE_MODEL = "<|message_model|>"
END = "<|end_message|>"
THINKING = "<|content_thinking|>"
TEXT = "<|content_text|>"
XML = "<|content_xml|>"
CALL = "<|content_invoke_tool_json|>"
KINDS = (THINKING, TEXT, XML, CALL)
MARKERS = (MESSAGE_MODEL, END, *KINDS)

# what an author name may be: a tool's name, as OpenAI and Anthropic allow them
AUTHOR = re.compile(r"[A-Za-z0-9_.\-]{0,64}")
BLOCK_JOINER = "\n\n"
EFFORT_OFF = "none"
EFFORT_DEFAULT = "default"  # OpenAI's word for the model's own default: the template's

_HEAD, _BETWEEN, _BODY = "head", "between", "body"


def marker_ids(tokenizer: Tokenizer) -> frozenset[int]:
    """The ids of the markers a reply's reader must see, to keep them in the decoded text."""
    return frozenset(i for i in map(tokenizer.piece_to_id, MARKERS) if i is not None)


def template_effort(reasoning: bool, effort: str | None) -> str | None:
    """The template's ``reasoning_effort`` for a request: "none" when it does not ask for
    reasoning, the client's effort word when it names one, else None (the template's default)."""
    if not reasoning:
        return EFFORT_OFF
    return None if effort in (None, EFFORT_DEFAULT) else effort


class InklingBlocks:
    """The reasoning splitter of an Inkling model: feed the reply's text (markers kept); get
    back reasoning and text, and each call block as the text its parser reads (``CALL body
    END``, handed on as it comes), or whole as its plain body when ``calls`` is off."""

    def __init__(self, calls: bool, in_text: bool = False):
        self.calls = calls
        self.state = _BODY if in_text else _HEAD  # in_text: a prefill opened a text block
        self.kind = TEXT if in_text else None
        self.held = ""  # text that may be the start of a marker
        self.name = ""  # head: what may be an author name
        self.body = ""  # a call block's text so far
        self.shown = False  # the open block has shown something
        self.last_kind: str | None = None  # the kind of the last block that showed something

    @property
    def inside(self) -> bool:
        """In a thinking block (its tokens are reasoning tokens)."""
        return self.state == _BODY and self.kind == THINKING

    def push(self, text: str) -> list[TextDelta | ReasoningDelta]:
        out: list[TextDelta | ReasoningDelta] = []
        buffer, self.held = self.held + text, ""
        while buffer:
            found = [(at, marker) for marker in MARKERS if (at := buffer.find(marker)) != -1]
            if not found:
                keep = partial_suffix(buffer, MARKERS)
                self._content(buffer[:len(buffer) - keep], out)
                self.held = buffer[len(buffer) - keep:]
                break
            at, marker = min(found)
            self._content(buffer[:at], out)
            buffer = buffer[at + len(marker):]
            self._marker(marker, out)
        return out

    def flush(self) -> list[TextDelta | ReasoningDelta]:
        """The reply is over: what was held back, and a block still open, as what it is."""
        out: list[TextDelta | ReasoningDelta] = []
        held, self.held = self.held, ""
        self._content(held, out)
        if self.state == _BODY and self.kind == CALL:
            # cut off: the parser's flush gives the body back as text
            if not self.calls:
                self._emit(self.body, out, TEXT)
            self.body = ""
        else:
            self._close(out)
        self.state = _BETWEEN
        return out

    def _content(self, text: str, out: list[TextDelta | ReasoningDelta]) -> None:
        if not text:
            return
        if self.state == _BETWEEN:
            text = text.lstrip()  # layout between blocks
            if not text:
                return
            self.state, self.name = _HEAD, ""
        if self.state == _HEAD:
            self.name += text
            if AUTHOR.fullmatch(self.name):
                return
            # not a name: a block written without its kind token, read as text
            text, self.name = self.name, ""
            self._open(TEXT)
        if self.kind == CALL and not self.calls:
            self.body += text
        elif self.kind == CALL:
            self._emit(text, out, TEXT)
        else:
            self._emit(text, out, self.kind)

    def _marker(self, marker: str, out: list[TextDelta | ReasoningDelta]) -> None:
        if marker in KINDS:
            if self.state == _BODY:
                self._close(out)  # a kind token inside a block starts another block
            self._open(marker)  # whatever stood before it was the author's name
            if marker == CALL and self.calls:
                self._emit(CALL, out, TEXT)
            return
        self._close(out)
        self.state, self.name = (_HEAD, "") if marker == MESSAGE_MODEL else (_BETWEEN, "")

    def _open(self, kind: str) -> None:
        self.state, self.kind, self.name, self.body, self.shown = _BODY, kind, "", "", False

    def _close(self, out: list[TextDelta | ReasoningDelta]) -> None:
        """The open block ends: a call is handed on; a head that never got its kind is text."""
        if self.state == _HEAD and self.name:
            self._open(TEXT)
            self._emit(self.name, out, TEXT)
        elif self.state == _BODY and self.kind == CALL:
            self._emit(END if self.calls else self.body, out, TEXT)
        self.state, self.kind, self.name, self.body = _BETWEEN, None, "", ""

    def _emit(self, text: str, out: list[TextDelta | ReasoningDelta], kind: str | None) -> None:
        if not text:
            return
        reasoning = kind == THINKING
        channel = THINKING if reasoning else TEXT
        if not self.shown and self.last_kind == channel:
            text = BLOCK_JOINER + text
        self.shown, self.last_kind = True, channel
        out.append(ReasoningDelta(text) if reasoning else TextDelta(text))


# --- the grammar of a forced call ---------------------------------------------------------------

def _call_schema(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """A call block's JSON: the name first, then the arguments, compact as the model writes it."""
    return {"type": "object", "properties": {"name": {"const": name}, "args": arguments},
            "required": ["name", "args"], "additionalProperties": False,
            "x-guidance": {"whitespace_flexible": False}}


def lark(tokenizer: Tokenizer, functions: Functions, parallel: bool,
         optional: bool = False, thinking: bool = False) -> str | None:
    """A Lark grammar (llguidance) of call blocks of these (name, arguments schema) tools, the
    markers named by their token ids; None when the vocabulary lacks one of them.

    The grammar holds the whole reply, from right after the prompt's ``<|message_model|>`` (so
    the first block has none of its own). ``thinking``: a thinking block may come first (with
    reasoning on; its end marker ends any block, so the grammar cannot wait for it as it waits
    for ``</think>``). ``optional``: thinking and text blocks (with no author name), then a call
    or none."""
    ids = {marker: tokenizer.piece_to_id(marker) for marker in MARKERS}
    if None in ids.values():
        return None
    token = {marker: f"<[{token_id}]>" for marker, token_id in ids.items()}
    lines = [f"tc: {' | '.join(f'fn_{i}' for i in range(len(functions)))}"]
    lines += [f"fn_{i}: {json.dumps(name)} {token[CALL]} %json {json.dumps(_call_schema(name, schema))} {token[END]}"
              for i, (name, schema) in enumerate(functions)]
    block = "tc"
    if optional:
        block = "blk"
        lines += ["blk: free | tc", f"free: ({token[THINKING]} | {token[TEXT]} | {token[XML]}) TEXT {token[END]}",
                  "TEXT: /(.|\\n)*/"]
    if parallel:
        first = f"{block} ({token[MESSAGE_MODEL]} {block})*"
    else:  # one call at most, and the reply ends with it
        first = f"(free {token[MESSAGE_MODEL]})* (free | tc)" if optional else "tc"
    if thinking:
        lines += [f"thought: {token[THINKING]} THOUGHT {token[END]} {token[MESSAGE_MODEL]}", "THOUGHT: /(.|\\n)*/"]
    start = f"start: {'thought? ' if thinking else ''}{first}"
    return "\n".join([start, *lines]) + "\n"


# the block reader ends a call block at its marker, strings or not; the markers are never shown
SYNTAX = CallSyntax(None, None, False, lambda raw: parse_json_call(raw, "args"), tags_are_text=False,
                    reader=lambda: JsonCallReader("args"))


class Inkling(Convention):
    name = "inkling"
    reasoning = Tags(THINKING, END)
    calls = Tags(CALL, END)
    reasoning_tokens = (MESSAGE_MODEL, THINKING, END)
    call_tokens = (MESSAGE_MODEL, CALL, END)
    reasoning_switch = "reasoning_effort"
    declares_tools = ("tools", "tool_declare")
    keeps_markers = True
    prefill_opens = TEXT  # a prefill continues a text block
    grammar_holds_reasoning = True  # the end of a thinking block is the end of any block

    def template_switch(self, reasoning: bool, effort: str | None) -> dict[str, Any]:
        level = template_effort(reasoning, effort)
        return {self.reasoning_switch: level} if level is not None else {}

    def kept_ids(self, tokenizer: Tokenizer) -> frozenset[int]:
        return marker_ids(tokenizer)

    def splitter(self, *, starts_inside: Callable[[], bool], model_calls: bool, reads_calls: bool,
                 prefilled: bool) -> Splitter:
        return InklingBlocks(calls=reads_calls, in_text=prefilled)

    def call_syntax(self, tools: list[dict[str, Any]], forced: list[dict[str, Any]] | None) -> CallSyntax:
        return SYNTAX

    def calls_lark(self, tokenizer: Tokenizer, functions: Functions, parallel: bool, optional: bool = False,
                   thinking: bool = False) -> str:
        grammar = lark(tokenizer, functions, parallel, optional, thinking=thinking)
        if grammar is None:
            raise InvalidRequestError("this model's vocabulary lacks its block tokens; tool_choice cannot force a call")
        return grammar


INKLING = Inkling()
