"""Tool calls in the model's reply, in the Hermes convention, once for every dialect.

A model with this convention (Qwen3 and its kin) declares nothing special: among its text it
writes ``<tool_call>\\n{"name": "get_weather", "arguments": {"city": "Paris"}}\\n</tool_call>``,
one block per call. ``ToolCallParser`` reads the reply's text stream (after the reasoning split
and stop strings) and turns each block into neutral events; the dialects render those natively.

Decisions a client may notice:

- A call is announced only once its closing tag has arrived and its JSON holds a name and an
  object of arguments. A call still open when the reply ends, bad JSON, or a missing name comes
  back as the text the model wrote, so a stream never carries half a call and never fails on one.
- ``</tool_call>`` inside a JSON string does not close the call. A raw line break cannot be part
  of a JSON string, so one ends the string for this purpose: a call with an unterminated string
  is still closed by its tag (and returned as text) instead of swallowing the rest of the reply.
- The whitespace a model writes around its calls (the line break before a call, between calls,
  after the last one) is layout, not text: it is dropped, so no dialect shows an empty text part.
- Arguments are re-serialized (``json.dumps``, non-ASCII kept) and handed out in several
  fragments, each cut where the text so far is a prefix a partial-JSON reader accepts (Anthropic's
  SDK parses the accumulated fragments after every delta).
- With parallel calls off, the reply ends after its first call (see ``ToolPlan.limit``).
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any

from gateway.neutral import (
    NeutralRequest,
    TextDelta,
    ToolCallArgumentsDelta,
    ToolCallEnd,
    ToolCallStart,
)
from gateway.prompting import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, ModelView
from gateway.stop_strings import partial_suffix
from shared.errors import InvalidRequestError

FRAGMENT_CHARS = 12  # about three tokens of JSON per arguments delta

ParsedEvent = TextDelta | ToolCallStart | ToolCallArgumentsDelta | ToolCallEnd


# --- what a request's tools become --------------------------------------------------------------

@dataclass(frozen=True)
class ToolPlan:
    declared: list[dict[str, Any]]  # the tools the chat template is shown
    parse: bool  # scan the reply for calls
    limit: int | None  # calls after which the reply ends; None: no limit


def plan(view: ModelView, request: NeutralRequest, refuse_forced: bool = True) -> ToolPlan:
    """How a request's tools are handled on this model.

    Without a tool convention the model cannot call anything: its declarations are dropped, so
    a client that always sends tools still gets plain chat, and a call the client insists on is
    refused (a model can only be made to call through constrained decoding).
    With ``tool_choice`` none the tools are not shown, so the model has no call to make.
    refuse_forced=False is for counting a prompt, which never runs.
    """
    if not view.has_tool_convention:
        if refuse_forced and forces_call(request.tool_choice):
            raise InvalidRequestError(
                f"forced tool calls need constrained decoding, which this server does not have yet; "
                f"the model {view.model_id} has no tool-call convention of its own, so send "
                f"tool_choice auto or none", param="tool_choice")
        return ToolPlan([], False, None)
    if not request.tools or request.tool_choice == "none":
        return ToolPlan([], False, None)
    return ToolPlan(request.tools, True, None if request.parallel_tool_calls else 1)


def forces_call(tool_choice: Any) -> bool:
    """Whether a tool_choice (Chat's, Responses' or Anthropic's mapped one) demands a call."""
    if isinstance(tool_choice, str):
        return tool_choice == "required"
    if not isinstance(tool_choice, dict):
        return False
    kind = tool_choice.get("type")
    if kind == "allowed_tools":
        # Chat nests the mode, Responses keeps it flat.
        nested = tool_choice.get("allowed_tools")
        mode = nested.get("mode") if isinstance(nested, dict) else tool_choice.get("mode")
        return mode == "required"
    return kind in ("function", "custom", "tool", "any")


# --- the stream parser --------------------------------------------------------------------------

class ToolCallParser:
    """Feed the reply's text pieces; get back text and tool-call events (see the module doc)."""

    def __init__(self, limit: int | None = None):
        self.limit = limit
        self.completed = 0
        self.inside = False
        # Outside a call: text held back because it may start a call tag, or is whitespace that
        # may precede one. Inside: the call's text so far, and how far it has been scanned.
        self.held = ""
        self.body = ""
        self.scanned = 0
        self.in_string = False
        self.escaped = False
        self.gap = ""  # whitespace dropped before the open call, given back if it is not a call
        self.after_call = False  # whitespace right after a call is layout too

    @property
    def done(self) -> bool:
        """The reply has all the calls it may have; whatever follows is dropped."""
        return self.limit is not None and self.completed >= self.limit

    def push(self, text: str) -> list[ParsedEvent]:
        out: list[ParsedEvent] = []
        while text and not self.done:
            text = self._read_call(text, out) if self.inside else self._read_text(text, out)
        return out

    def flush(self) -> list[ParsedEvent]:
        """End of the reply: a call still open, or held-back text, is text after all."""
        out: list[ParsedEvent] = []
        if not self.done:
            if self.inside:
                self._text(self.gap + TOOL_CALL_OPEN + self.body, out)
            else:
                self._text(self.held, out)
        self.inside, self.held, self.body, self.gap = False, "", "", ""
        return out

    def _read_text(self, text: str, out: list[ParsedEvent]) -> str:
        buffer, self.held = self.held + text, ""
        at = buffer.find(TOOL_CALL_OPEN)
        if at == -1:
            keep = partial_suffix(buffer, (TOOL_CALL_OPEN,))
            released = buffer[:len(buffer) - keep]
            body = released.rstrip()
            self.held = released[len(body):] + buffer[len(buffer) - keep:]
            self._text(body, out)
            return ""
        before = buffer[:at]
        body = before.rstrip()
        self._text(body, out)
        self._open(gap=before[len(body):])
        return buffer[at + len(TOOL_CALL_OPEN):]

    def _open(self, gap: str) -> None:
        self.inside, self.gap = True, gap
        self.body, self.scanned, self.in_string, self.escaped = "", 0, False, False

    def _read_call(self, text: str, out: list[ParsedEvent]) -> str:
        self.body += text
        body = self.body
        for i in range(self.scanned, len(body)):
            char = body[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char in '"\n':
                    self.in_string = False
                continue
            if char == '"':
                self.in_string = True
            elif char == ">" and body.endswith(TOOL_CALL_CLOSE, 0, i + 1):
                self.inside = False
                self._close(body[:i + 1 - len(TOOL_CALL_CLOSE)], out)
                return body[i + 1:]
            elif char == ">" and body.endswith(TOOL_CALL_OPEN, 0, i + 1):
                # A new call opens before this one closed: this one was never finished.
                self._text(self.gap + TOOL_CALL_OPEN + body[:i + 1 - len(TOOL_CALL_OPEN)], out)
                self._open(gap="")
                return body[i + 1:]
        self.scanned = len(body)
        return ""

    def _close(self, raw: str, out: list[ParsedEvent]) -> None:
        call = parse_call(raw)
        if call is None:
            self._text(self.gap + TOOL_CALL_OPEN + raw + TOOL_CALL_CLOSE, out)
            self.gap = ""
            return
        name, arguments = call
        index, call_id = self.completed, secrets.token_hex(12)
        arguments_json = json.dumps(arguments, ensure_ascii=False)
        out.append(ToolCallStart(index, call_id, name))
        out.extend(ToolCallArgumentsDelta(index, piece) for piece in json_fragments(arguments_json))
        out.append(ToolCallEnd(index, call_id, name, arguments_json))
        self.completed += 1
        self.after_call, self.gap = True, ""

    def _text(self, text: str, out: list[ParsedEvent]) -> None:
        if self.after_call:
            text = text.lstrip()
        if text:
            self.after_call = False
            out.append(TextDelta(text))


def parse_call(raw: str) -> tuple[str, dict[str, Any]] | None:
    """(name, arguments) of one call's JSON, or None when it is not a well-formed call."""
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(value, dict):
        return None
    name = value.get("name")
    if not isinstance(name, str) or not name.strip():
        return None
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):
        # Some models write the arguments object as a JSON string.
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return name, arguments


def json_fragments(text: str, size: int = FRAGMENT_CHARS) -> list[str]:
    """Serialized JSON cut into pieces of about ``size`` characters.

    A cut falls inside a string (never inside an escape sequence) or after punctuation or
    whitespace outside strings (never inside a number or a literal), so every join of the first
    pieces is a JSON prefix that partial-JSON readers accept.
    """
    pieces: list[str] = []
    start = 0
    in_string = False
    escape_left = 0  # characters of an escape sequence still to come
    for i, char in enumerate(text):
        if i - start >= size and escape_left == 0 and (in_string or text[i - 1] in "{[,: "):
            pieces.append(text[start:i])
            start = i
        if escape_left:
            escape_left = 4 if escape_left == -1 and char == "u" else max(escape_left - 1, 0)
        elif in_string and char == "\\":
            escape_left = -1  # the escaped character decides the length
        elif char == '"':
            in_string = not in_string
    pieces.append(text[start:])
    return [piece for piece in pieces if piece]
