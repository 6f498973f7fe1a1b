"""Tool calls as blocks of a reply, read the same way for every convention that writes them so.

A convention marks each call with a pair of tags and says, in its ``CallSyntax``, what a block
holds: where its strings start and end (a closing tag inside a string does not close the call)
and how a whole block is read into a name and arguments. ``ToolCallParser`` reads the reply's text
stream (after the reasoning split and stop strings) and turns each block into the events every
dialect renders.

Decisions a client may notice:

- A call streams as it is written where its convention gives a reader of its body
  (``CallSyntax.reader``, shared/conventions/call_streams.py): it is announced once its name is
  known and its first argument's value has begun, and its arguments follow as fragments of the JSON the
  finished call carries. The closing tag still decides: a body that does not read as a call
  comes back as the text the model wrote, and one that was announced is first abandoned
  (``ToolCallAbandoned``), as is a call still open when the reply ends. Without a reader a call
  is announced whole, once closed.
- In JSON bodies a raw line break cannot be part of a string, so one ends the string for this
  purpose: a call with an unterminated string is still closed by its tag (and returned as text)
  instead of swallowing the rest of the reply. (Gemma 4's strings, between ``<|"|>`` quotes, may
  hold line breaks.)
- The whitespace a model writes around its calls (the line break before a call, between calls,
  after the last one) is layout, not text: it is dropped, so no dialect shows an empty text part.
- Arguments are re-serialized (``json.dumps``, non-ASCII kept) and handed out in several
  fragments, each cut where the text so far is a prefix a partial-JSON reader accepts (Anthropic's
  SDK parses the accumulated fragments after every delta). A call's index counts the calls
  announced, abandoned ones included, so a client never merges two calls.
- With parallel calls off, the reply ends after its first call (``limit``).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shared.conventions.call_streams import BodyReader
from shared.conventions.events import (
    TextDelta,
    ToolCallAbandoned,
    ToolCallArgumentsDelta,
    ToolCallEnd,
    ToolCallStart,
)
from shared.conventions.reasoning import partial_suffix
from shared.protocol import Tags

FRAGMENT_CHARS = 12  # about three tokens of JSON per arguments delta
# The bound on JSON whitespace in a forced call: a small model left free to write whitespace can
# loop on it forever inside a call.
CALL_WHITESPACE = {"whitespace_pattern": r"[ \n]{0,2}"}

ParsedEvent = TextDelta | ToolCallStart | ToolCallArgumentsDelta | ToolCallEnd | ToolCallAbandoned


@dataclass(frozen=True)
class CallSyntax:
    """What a call block holds: where its strings start and end (a tag inside a string does
    not close the call) and how its body is read."""

    quote: str | None  # None: the body has no strings
    escape: str | None  # the character that escapes the next one inside a string
    newline_ends_string: bool
    parse: Callable[[str], tuple[str, dict[str, Any]] | None]
    tags_are_text: bool = True  # False: the tags are control tokens, never shown (Inkling's)
    # a new reader of a body as it is written, to stream the call; None: announced once closed
    reader: Callable[[], BodyReader] | None = None


class ToolCallParser:
    """Feed the reply's text pieces; get back text and tool-call events (see the module doc)."""

    def __init__(self, tags: Tags, limit: int | None, syntax: CallSyntax):
        self.tags = tags
        self.limit = limit
        self.syntax = syntax
        self.completed = 0
        self.announced = 0  # calls announced, abandoned ones included: the next call's index
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
        self.reader: BodyReader | None = None  # the open call's reader, if it streams
        self.fed = 0  # how much of the body the reader has read
        self.started: ToolCallStart | None = None  # the open call, once announced
        self.sent = 0  # how much of the reader's arguments the stream has sent

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
                self._abandon(out)
                self._text(self.gap + self._as_text(self.body, closed=False), out)
            else:
                self._text(self.held, out)
        self.inside, self.held, self.body, self.gap = False, "", "", ""
        return out

    def _read_text(self, text: str, out: list[ParsedEvent]) -> str:
        buffer, self.held = self.held + text, ""
        at = buffer.find(self.tags.open)
        if at == -1:
            keep = partial_suffix(buffer, (self.tags.open,))
            released = buffer[:len(buffer) - keep]
            body = released.rstrip()
            self.held = released[len(body):] + buffer[len(buffer) - keep:]
            self._text(body, out)
            return ""
        before = buffer[:at]
        body = before.rstrip()
        self._text(body, out)
        self._open(gap=before[len(body):])
        return buffer[at + len(self.tags.open):]

    def _open(self, gap: str) -> None:
        self.inside, self.gap = True, gap
        self.body, self.scanned, self.in_string, self.escaped = "", 0, False, False
        self.reader = self.syntax.reader() if self.syntax.reader is not None else None
        self.fed, self.started, self.sent = 0, None, 0

    def _read_call(self, text: str, out: list[ParsedEvent]) -> str:
        self.body += text
        body, syntax = self.body, self.syntax
        for i in range(self.scanned, len(body)):
            char = body[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == syntax.escape:
                    self.escaped = True
                elif (char == "\n" and syntax.newline_ends_string) or body.endswith(syntax.quote, 0, i + 1):
                    self.in_string = False
                continue
            if syntax.quote is not None and body.endswith(syntax.quote, 0, i + 1):
                self.in_string = True
            elif char == ">" and body.endswith(self.tags.close, 0, i + 1):  # tags end with ">"
                self.inside = False
                raw = body[:i + 1 - len(self.tags.close)]
                self._stream(raw, out)
                self._close(raw, out)
                return body[i + 1:]
            elif char == ">" and body.endswith(self.tags.open, 0, i + 1):
                # A new call opens before this one closed: this one was never finished.
                self._abandon(out)
                self._text(self.gap + self._as_text(body[:i + 1 - len(self.tags.open)], closed=False), out)
                self._open(gap="")
                return body[i + 1:]
        self.scanned = len(body)
        # what may be the start of a tag waits: a tag is no part of the body
        self._stream(body[:len(body) - partial_suffix(body, (self.tags.close, self.tags.open))], out)
        return ""

    def _stream(self, body: str, out: list[ParsedEvent]) -> None:
        """Hands the body's new text to the call's reader; announces the call once it is ready
        and sends what its arguments grew by."""
        reader = self.reader
        if reader is None or len(body) <= self.fed:
            return
        reader.feed(body[self.fed:])
        self.fed = len(body)
        if reader.broken:
            return
        if self.started is None and reader.ready and reader.name is not None and value_begun(reader.arguments):
            self.started = ToolCallStart(self.announced, secrets.token_hex(12), reader.name)
            self.announced += 1
            out.append(self.started)
        if self.started is not None and len(reader.arguments) > self.sent:
            out += self._deltas(self.started.index, reader.arguments[self.sent:])
            self.sent = len(reader.arguments)

    def _deltas(self, index: int, text: str) -> list[ParsedEvent]:
        return argument_deltas(index, text, self.sent)

    def _abandon(self, out: list[ParsedEvent]) -> None:
        """The announced call will not be finished: its body is text after all."""
        if self.started is not None:
            out.append(ToolCallAbandoned(self.started.index, self.started.call_id))
        self.started, self.reader = None, None

    def _close(self, raw: str, out: list[ParsedEvent]) -> None:
        call = self.syntax.parse(raw)
        if call is None:
            self._abandon(out)
            self._text(self.gap + self._as_text(raw, closed=True), out)
            self.gap = ""
            return
        if self.started is None:
            out.extend(call_events(self.announced, *call))
            self.announced += 1
        else:
            out.extend(self._finish_started(*call))
        self.completed += 1
        self.after_call, self.gap = True, ""

    def _finish_started(self, name: str, arguments: dict[str, Any]) -> list[ParsedEvent]:
        started, self.started, reader, self.reader = self.started, None, self.reader, None
        assert started is not None and reader is not None
        return finish_started(started, reader.arguments[:self.sent], name, arguments)

    def _as_text(self, raw: str, closed: bool) -> str:
        """A block that is not a call, as the text the model wrote."""
        if not self.syntax.tags_are_text:
            return raw
        return self.tags.open + raw + (self.tags.close if closed else "")

    def _text(self, text: str, out: list[ParsedEvent]) -> None:
        if self.after_call:
            text = text.lstrip()
        if text:
            self.after_call = False
            out.append(TextDelta(text))


def value_begun(arguments: str) -> bool:
    """The arguments hold more than an opening brace and a key: a call broken right there (``{"a": }``,
    a common slip) is never announced, so it comes back as text alone, streamed or not."""
    return arguments not in ("", "{") and not arguments.endswith(": ")


def argument_deltas(index: int, text: str, sent: int) -> list[ParsedEvent]:
    """Fragments of a call's arguments, ``sent`` characters of which went out before; what comes
    from their start at once (a whole body in one piece) is cut as a whole call's is."""
    pieces = json_fragments(text) if sent == 0 else [text]
    return [ToolCallArgumentsDelta(index, piece) for piece in pieces]


def finish_started(started: ToolCallStart, sent: str, name: str, arguments: dict[str, Any]) -> list[ParsedEvent]:
    """The rest of an announced call's arguments (``sent`` went out already), and its end."""
    arguments_json = json.dumps(arguments, ensure_ascii=False)
    out: list[ParsedEvent] = []
    if arguments_json.startswith(sent) and len(arguments_json) > len(sent):
        out += argument_deltas(started.index, arguments_json[len(sent):], len(sent))
    # (a body its reader wrote otherwise, duplicate keys: the end carries the arguments as read)
    return out + [ToolCallEnd(started.index, started.call_id, name, arguments_json)]


def call_events(index: int, name: str, arguments: dict[str, Any]) -> list[ParsedEvent]:
    """One whole call as the neutral events every dialect renders."""
    call_id = secrets.token_hex(12)
    arguments_json = json.dumps(arguments, ensure_ascii=False)
    return [ToolCallStart(index, call_id, name),
            *(ToolCallArgumentsDelta(index, piece) for piece in json_fragments(arguments_json)),
            ToolCallEnd(index, call_id, name, arguments_json)]


def parse_json_call(raw: str, arguments_key: str = "arguments") -> tuple[str, dict[str, Any]] | None:
    """(name, arguments) of one call written as a JSON object, or None when it is not a
    well-formed call; the arguments are under ``arguments_key`` (Inkling's calls: ``args``)."""
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: nested past any real arguments
        return None
    if not isinstance(value, dict):
        return None
    name = value.get("name")
    if not isinstance(name, str) or not name.strip():
        return None
    arguments = value.get(arguments_key, {})
    if isinstance(arguments, str):
        # Some models write the arguments object as a JSON string.
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except (ValueError, RecursionError):
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



def json_call_schema(name: str, arguments: dict[str, Any], whitespace: bool = True) -> dict[str, Any]:
    """The JSON schema of one call as a JSON object: ``{"name": ..., "arguments": {...}}``."""
    schema: dict[str, Any] = {
        "type": "object", "properties": {"name": {"const": name}, "arguments": arguments},
        "required": ["name", "arguments"], "additionalProperties": False}
    if whitespace:  # a %json block inside Lark takes its options from the schema itself
        schema["x-guidance"] = CALL_WHITESPACE
    return schema
