"""Splitting a reply's reasoning from its text, between a convention's reasoning tags.

``ReasoningSplitter`` is the splitter of every convention that marks its reasoning with a pair of
tags (Hermes's ``<think>``, Gemma 4's thought channel); a convention whose reply is built
otherwise (Inkling's blocks) brings its own, with the same two methods.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from shared.conventions.events import ReasoningDelta, TextDelta
from shared.protocol import Tags


class Splitter(Protocol):
    """Feed the reply's text; get back reasoning and text. ``inside``: the tokens read now are
    reasoning tokens (the usage counts them)."""

    inside: bool

    def push(self, text: str) -> list[TextDelta | ReasoningDelta]: ...

    def flush(self) -> list[TextDelta | ReasoningDelta]: ...


def partial_suffix(buffer: str, tags: Sequence[str]) -> int:
    """Length of the longest suffix of buffer that is a proper prefix of one of tags: the text
    to hold back until the next piece shows whether a tag starts there."""
    longest = max((len(tag) for tag in tags), default=0)
    for length in range(min(len(buffer), longest - 1), 0, -1):
        tail = buffer[-length:]
        if any(tag.startswith(tail) for tag in tags):
            return length
    return 0


class ReasoningSplitter:
    """Routes text between the reasoning tags (``<think>`` and ``</think>``) to reasoning, the
    rest to content.

    The line breaks a model writes just inside the tags and right after the closing one are
    layout (Qwen3 writes ``<think>\n...\n</think>\n\n``, and its template trims reasoning when
    it renders it back), so they are dropped.
    """

    def __init__(self, tags: Tags, inside: bool = False, call_opens: str | None = None):
        self.tags = tags
        self.inside = inside
        # a call's opening tag that ends the reasoning too (it stays in the text, for the calls'
        # parser): Qwen3.5 may open a call without closing its think block
        self.call_opens = call_opens
        self.held = ""
        self.closed_once = False
        self.at_edge = True  # nothing emitted since the last tag (or the start)

    def push(self, text: str) -> list[TextDelta | ReasoningDelta]:
        out: list[TextDelta | ReasoningDelta] = []
        buffer = self.held + text
        self.held = ""
        while buffer:
            tag = self.tags.close if self.inside else self.tags.open
            position = buffer.find(tag)
            if self.inside and self.call_opens:
                call = buffer.find(self.call_opens)
                if call != -1 and (position == -1 or call < position):
                    self._emit(buffer[:call].rstrip("\n"), out)
                    self.closed_once, self.inside, self.at_edge = True, False, True
                    buffer = buffer[call:]
                    continue
            if position == -1:
                tags = (tag, self.call_opens) if self.inside and self.call_opens else (tag,)
                ready = buffer[:len(buffer) - partial_suffix(buffer, tags)]
                if self.inside:  # line breaks may be the ones right before the closing tag
                    ready = ready.rstrip("\n")
                emit, self.held = ready, buffer[len(ready):]
                buffer = ""
            else:
                emit, buffer = buffer[:position], buffer[position + len(tag):]
                if self.inside:
                    emit = emit.rstrip("\n")
            self._emit(emit, out)
            if position != -1:
                if self.inside:
                    self.closed_once = True
                self.inside = not self.inside
                self.at_edge = True
        return out

    def flush(self) -> list[TextDelta | ReasoningDelta]:
        held, self.held = self.held, ""
        out: list[TextDelta | ReasoningDelta] = []
        self._emit(held.rstrip("\n") if self.inside else held, out)
        return out

    def _emit(self, text: str, out: list[TextDelta | ReasoningDelta]) -> None:
        if self.at_edge and (self.inside or self.closed_once):
            text = text.lstrip("\n")
        if text:
            self.at_edge = False
            out.append(ReasoningDelta(text) if self.inside else TextDelta(text))
