"""Reading a call block while it is written: its name as soon as it is known, and its arguments
as the JSON text the finished call will carry, growing with every piece of the body.

A ``BodyReader`` is fed a call block's body (without its tags) in pieces. It says the call's
``name`` once it is known, whether the call is ``ready`` to be announced (its name is known and
its arguments have begun), and ``arguments``: the prefix, written so far, of the arguments as
``json.dumps(arguments, ensure_ascii=False)`` will write them once the whole body is read by the
convention's parser. So the fragments a stream sends join into exactly the final arguments, and
every join of them is a JSON prefix (a number or a literal is written only once it ends, an
escape only whole). ``broken``: the body can no longer be a call; the parser then stops sending
and the whole body decides, as it always did (``shared/conventions/calls.py``).

One reader per way of writing a call: JSON objects (Hermes, Inkling), Gemma 4's ``call:NAME{…}``,
Qwen3.5's XML parameters (string values streamed, other values written when their block ends)
and nanochat's code (the body is the one argument's value).
"""

from __future__ import annotations

import json
import re
from typing import Any, Protocol

from shared.conventions.reasoning import partial_suffix


class BodyReader(Protocol):
    name: str | None
    ready: bool
    broken: bool
    arguments: str

    def feed(self, text: str) -> None: ...


def escaped(text: str) -> str:
    """Text as the inside of a JSON string, as ``json.dumps(..., ensure_ascii=False)`` writes it."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_LITERALS = {"true": "true", "false": "false", "null": "null"}
_SCALAR_CHARS = set("0123456789+-.eE") | set("truefalsn")
_VALUE, _KEY_OR_CLOSE, _KEY, _COLON, _AFTER, _DONE = "value", "key_or_close", "key", "colon", "after", "done"


class StructuredEcho:
    """An incremental reader of one JSON-like value that writes it back as ``json.dumps`` would.

    ``quote``/``escapes``: how strings are written (JSON's ``"`` with backslash escapes, or Gemma
    4's ``<|"|>`` token with none); ``bare_keys``: object keys may be written unquoted (Gemma 4);
    ``capture_key``: write back only the value of this key of the top-level object (else the
    whole value). ``values`` keeps the top-level object's string values, once whole."""

    def __init__(self, quote: str = '"', escapes: bool = True, bare_keys: bool = False,
                 capture_key: str | None = None, whitespace: str = " \t\n\r"):
        self.quote, self.escapes, self.bare_keys = quote, escapes, bare_keys
        self.capture_key = capture_key
        self.whitespace = whitespace
        self.stack: list[str] = []  # "{" or "[" per open container
        self.state = _VALUE
        self.pending = ""  # input that may be the start of a quote
        self.token: str | None = None  # "string" | "scalar" | "bare": the token being read
        self.text = ""  # a scalar's or a key's characters so far
        self.string_is_key = False
        self.escape = ""  # an escape sequence under way, backslash included
        self.high_surrogate = ""
        self.key = ""  # the top-level object's current key
        self.capturing = capture_key is None
        self.started = False  # the captured value has begun
        self.captured_kind = ""  # the first character the captured value was written with
        self.out = ""  # what is written back, of the captured value
        self.values: dict[str, str] = {}
        self.broken = False

    @property
    def done(self) -> bool:
        return self.state == _DONE and self.token is None

    def feed(self, text: str) -> None:
        text, self.pending = self.pending + text, ""
        at = 0
        while at < len(text) and not self.broken:
            if self.token == "string":
                at = self._string_run(text, at)
                continue
            if text.startswith(self.quote, at):
                if self.token == "scalar":
                    self._char(text[at])  # a quote right after a scalar: not a call
                    continue
                if self.token is None:
                    at += len(self.quote)
                    self._string_start()
                    continue
            if self.token is None and len(self.quote) > 1 and self.quote.startswith(text[at:]):
                self.pending = text[at:]  # perhaps a quote, cut before its end
                return
            self._char(text[at])
            at += 1

    def _string_run(self, text: str, at: int) -> int:
        """Reads a string's characters from ``at``; returns where reading goes on."""
        if self.escape:  # an escape sequence, one character at a time
            self._string_chars(text[at])
            return at + 1
        stops = [i for i in (text.find(self.quote, at), text.find("\\", at) if self.escapes else -1) if i != -1]
        if not stops:
            keep = partial_suffix(text[at:], (self.quote,)) if len(self.quote) > 1 else 0
            self._string_chars(text[at:len(text) - keep])
            self.pending = text[len(text) - keep:]
            return len(text)
        end = min(stops)
        self._string_chars(text[at:end])
        if text.startswith(self.quote, end):
            if not self.broken:
                self._string_end()
            return end + len(self.quote)
        self._string_chars("\\")
        return end + 1

    # --- tokens -----------------------------------------------------------------------------

    def _char(self, char: str) -> None:
        if self.token == "scalar":
            if char in _SCALAR_CHARS and char not in self.whitespace:
                self.text += char
                return
            self._scalar_end()
            if self.broken:
                return
        if self.token == "bare":
            if char == ":":
                key = self.text.strip()
                if not key or any(c in key for c in "{}[],"):
                    self.broken = True
                    return
                self.token = None
                self._key_done(key, bare=True)
                return
            else:
                self.text += char
                return
        if char in self.whitespace:
            return
        state = self.state
        if state in (_VALUE,):
            if char in "{[":
                self._value_starts(char)
                self._write(char)
                self.stack.append(char)
                self.state = _KEY_OR_CLOSE if char == "{" else _VALUE + "_or_close"
            elif char in _SCALAR_CHARS:
                self._value_starts(char)
                self.token, self.text = "scalar", char
            else:
                self.broken = True
        elif state == _VALUE + "_or_close":
            if char == "]":
                self._close("[")
            else:
                self.state = _VALUE
                self._char(char)
        elif state in (_KEY_OR_CLOSE, _KEY):
            if char == "}" and state == _KEY_OR_CLOSE:
                self._close("{")
            elif self.bare_keys and char not in "{}[],:":
                self.token, self.text = "bare", char
            else:
                self.broken = True
        elif state == _COLON:
            if char == ":":
                self.state = _VALUE
            else:
                self.broken = True
        elif state == _AFTER:
            top = self.stack[-1]
            if char == ",":
                self._write(", ")
                self.state = _KEY if top == "{" else _VALUE
            elif char == ("}" if top == "{" else "]"):
                self._close(top)
            else:
                self.broken = True
        else:  # _DONE: nothing may follow the value
            self.broken = True

    def _string_start(self) -> None:
        if self.state in (_KEY_OR_CLOSE, _KEY):
            self.string_is_key = True
        elif self.state in (_VALUE, _VALUE + "_or_close"):
            self.string_is_key = False
            self.state = _VALUE
            self._value_starts('"')
            self._write('"')
        else:
            self.broken = True
            return
        self.token, self.text, self.escape, self.high_surrogate = "string", "", "", ""

    def _string_chars(self, chars: str) -> None:
        decoded = []
        for char in chars:
            if self.escape:
                self.escape += char
                if len(self.escape) == 2 and char != "u":
                    simple = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r",
                              "t": "\t"}.get(char)
                    if simple is None:
                        self.broken = True
                        return
                    decoded.append(self.high_surrogate + simple)
                    self.escape = self.high_surrogate = ""
                elif len(self.escape) == 6:
                    try:
                        code = int(self.escape[2:], 16)
                    except ValueError:
                        self.broken = True
                        return
                    self.escape = ""
                    if 0xD800 <= code < 0xDC00 and not self.high_surrogate:
                        self.high_surrogate = chr(code)
                        continue
                    if self.high_surrogate and 0xDC00 <= code < 0xE000:
                        pair = 0x10000 + ((ord(self.high_surrogate) - 0xD800) << 10) + (code - 0xDC00)
                        decoded.append(chr(pair))
                        self.high_surrogate = ""
                        continue
                    decoded.append(self.high_surrogate + chr(code))
                    self.high_surrogate = ""
                continue
            if self.escapes and char == "\\":
                self.escape = char  # a high surrogate waits for the escape after it
                continue
            if self.high_surrogate:  # a lone high surrogate stays as json.loads keeps it
                decoded.append(self.high_surrogate)
                self.high_surrogate = ""
            if self.escapes and ord(char) < 0x20:
                self.broken = True  # a raw control character: not JSON
                return
            else:
                decoded.append(char)
        piece = "".join(decoded)
        if self.string_is_key or self._top_level_value():
            self.text += piece
        if not self.string_is_key and piece:
            self._write(escaped(piece))

    def _string_end(self) -> None:
        if self.high_surrogate:
            tail, self.high_surrogate = self.high_surrogate, ""
            if self.string_is_key or self._top_level_value():
                self.text += tail
            if not self.string_is_key:
                self._write(escaped(tail))
        self.token = None
        if self.string_is_key:
            self._key_done(self.text)
            return
        self._write('"')
        if self._top_level_value():
            self.values[self.key] = self.text
        self._value_ends()

    def _scalar_end(self) -> None:
        literal, self.token = self.text, None
        if literal in _LITERALS:
            written = _LITERALS[literal]
        elif _NUMBER.fullmatch(literal):
            written = json.dumps(json.loads(literal))
        else:
            self.broken = True
            return
        self._write(written)
        self._value_ends()

    def _key_done(self, key: str, bare: bool = False) -> None:
        if len(self.stack) == 1:
            self.key = key
        self._write(json.dumps(key, ensure_ascii=False) + ": ")
        self.state = _VALUE if bare else _COLON  # a bare key is read up to its colon
        self.string_is_key = False

    # --- structure --------------------------------------------------------------------------

    def _top_level_value(self) -> bool:
        return len(self.stack) == 1 and self.stack[0] == "{"

    def _value_starts(self, char: str) -> None:
        if self.capture_key is not None and self._top_level_value():
            self.capturing = self.key == self.capture_key
            if self.capturing:
                self.started, self.captured_kind = True, char
        elif self.capture_key is None and not self.stack:
            self.started, self.captured_kind = True, char

    def _value_ends(self) -> None:
        if not self.stack:
            self.state = _DONE
            return
        self.state = _AFTER
        if self.capture_key is not None and self._top_level_value():
            self.capturing = False

    def _close(self, opener: str) -> None:
        self._write("}" if opener == "{" else "]")
        self.stack.pop()
        self._value_ends()

    def _write(self, text: str) -> None:
        if self.capturing:
            self.out += text


class JsonCallReader:
    """A call written as a JSON object: ``{"name": ..., "arguments": {...}}`` (the arguments under
    ``arguments_key``). A call whose arguments are not an object as written (a JSON string of
    them) is not streamed: it is announced whole when it closes."""

    def __init__(self, arguments_key: str = "arguments"):
        self.echo = StructuredEcho(capture_key=arguments_key)
        self.leading = True

    def feed(self, text: str) -> None:
        if self.leading:  # the object must be the body's first non-blank character
            stripped = text.lstrip()
            if not stripped:
                return
            self.leading = False
            if not stripped.startswith("{"):
                self.echo.broken = True
        self.echo.feed(text)

    @property
    def name(self) -> str | None:
        name = self.echo.values.get("name")
        return name if name is not None and name.strip() else None

    @property
    def ready(self) -> bool:
        return self.name is not None and self.echo.started and self.echo.captured_kind == "{"

    @property
    def broken(self) -> bool:
        return self.echo.broken

    @property
    def arguments(self) -> str:
        return self.echo.out


class GemmaCallReader:
    """Gemma 4's ``call:NAME{key:value,…}``: strings between ``<|"|>`` quotes, bare keys."""

    def __init__(self, quote: str, prefix: str = "call:"):
        self.prefix = prefix
        self.head = ""
        self.name: str | None = None
        self.echo = StructuredEcho(quote=quote, escapes=False, bare_keys=True, whitespace=" \t\n")
        self._broken = False

    def feed(self, text: str) -> None:
        if self.name is None and not self._broken:
            self.head += text
            head = self.head.lstrip()
            if not (head.startswith(self.prefix) or self.prefix.startswith(head)):
                self._broken = True
                return
            brace = head.find("{")
            if brace < 0:
                return
            name = head[len(self.prefix):brace].strip()
            if not name:
                self._broken = True
                return
            self.name, text = name, head[brace:]
        if self.name is not None:
            self.echo.feed(text)

    @property
    def ready(self) -> bool:
        return self.name is not None and self.echo.started

    @property
    def broken(self) -> bool:
        return self._broken or self.echo.broken

    @property
    def arguments(self) -> str:
        return self.echo.out


class XmlCallReader:
    """Qwen3.5's ``<function=NAME>`` with one ``<parameter=KEY>`` block per argument: a string
    value (by its tool's schema) is written as it comes, any other value when its block ends
    (only then is it known to be JSON, or text)."""

    FUNCTION, PARAMETER, PARAMETER_END, FUNCTION_END = "<function=", "<parameter=", "</parameter>", "</function>"

    def __init__(self, schemas: dict[str, Any], is_string, value_of):
        self.schemas = schemas
        self.is_string, self.value_of = is_string, value_of
        self.buffer = ""
        self.name: str | None = None
        self.ready = False
        self.broken = False
        self.arguments = ""
        self.state = "head"
        self.key: str | None = None
        self.string = False
        self.value = ""  # the value so far (its first line break dropped)
        self.count = 0

    def _properties(self) -> dict[str, Any]:
        schema = self.schemas.get(self.name)
        props = schema.get("properties") if isinstance(schema, dict) else None
        return props if isinstance(props, dict) else {}

    def feed(self, text: str) -> None:
        self.buffer += text
        while not self.broken and self._step():
            pass

    def _step(self) -> bool:
        """Reads what it can of the buffer; True when it may read more."""
        if self.state == "value":
            return self._value()
        if self.state == "after":
            if self.buffer.strip():
                self.broken = True
            self.buffer = ""
            return False
        buffer = self.buffer.lstrip()
        if not buffer:
            self.buffer = ""
            return False
        tags = (self.FUNCTION,) if self.state == "head" else (self.PARAMETER, self.FUNCTION_END)
        tag = next((t for t in tags if buffer.startswith(t)), None)
        if tag is None:
            if not any(t.startswith(buffer) for t in tags):
                self.broken = True
            return False
        if tag == self.FUNCTION_END:
            self.arguments += "}"
            self.buffer, self.state = buffer[len(tag):], "after"
            return True
        end = buffer.find(">", len(tag))
        if end < 0:
            if "\n" in buffer:
                self.broken = True
            return False
        word = buffer[len(tag):end]
        if "\n" in word or not word.strip():
            self.broken = True
            return False
        self.buffer = buffer[end + 1:]
        if tag == self.FUNCTION:
            self.name, self.ready, self.state = word.strip(), True, "parameters"
            self.arguments = "{"
            return True
        self.key = word.strip()
        self.string = self.is_string(self._properties().get(self.key))
        self.arguments += (", " if self.count else "") + json.dumps(self.key, ensure_ascii=False) + ": "
        self.arguments += '"' if self.string else ""
        self.count += 1
        self.state, self.value = "value", ""
        self.first = True
        return True

    def _value(self) -> bool:
        if self.first:
            if not self.buffer:
                return False
            self.first = False
            if self.buffer.startswith("\n"):
                self.buffer = self.buffer[1:]
        end = self.buffer.find(self.PARAMETER_END)
        if end < 0:
            keep = partial_suffix(self.buffer, ("\n" + self.PARAMETER_END,))
            if self.buffer.endswith("\n"):
                keep = max(keep, 1)
            ready, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
            self.value += ready
            if self.string and ready:
                self.arguments += escaped(ready)
            return False
        piece, self.buffer = self.buffer[:end], self.buffer[end + len(self.PARAMETER_END):]
        piece = piece[:-1] if piece.endswith("\n") else piece
        self.value += piece
        if self.string:
            self.arguments += escaped(piece) + '"'
        else:
            self.arguments += json.dumps(self.value_of(self.value, self._properties().get(self.key)),
                                         ensure_ascii=False)
        self.state = "parameters"
        return True


class CodeReader:
    """nanochat's call: the whole body is the one argument's value (a body of blanks is no call)."""

    def __init__(self, name: str, argument: str):
        self.name = name
        self.argument = argument
        self.ready = False
        self.broken = False
        self.arguments = ""
        self.held = ""

    def feed(self, text: str) -> None:
        if not self.ready:
            self.held += text
            if not self.held.strip():
                return
            self.ready, text = True, self.held
            self.arguments = "{" + json.dumps(self.argument, ensure_ascii=False) + ': "'
        self.arguments += escaped(text)
