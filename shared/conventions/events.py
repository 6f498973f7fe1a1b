"""What a reply's readers hand on: text, reasoning and tool calls, as they are written.

The conventions' readers (shared/conventions/) produce them in both processes' shared code; the
gateway's neutral events (gateway/neutral.py) are these same classes, which every dialect renders.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TextDelta:
    text: str


@dataclass
class ReasoningDelta:
    text: str


@dataclass
class ToolCallStart:
    """A tool call the model is writing (announced once its name is known; with a convention
    that gives no reader of its calls, once whole), or has written.

    ``call_id`` is bare; each dialect puts its own prefix on it (call_, toolu_, fc_).
    """

    index: int  # 0, 1, ... in the order of the reply
    call_id: str
    name: str


@dataclass
class ToolCallArgumentsDelta:
    index: int
    json_fragment: str  # the fragments so far always join to a prefix of valid JSON


@dataclass
class ToolCallAbandoned:
    """An announced call that did not finish as a call (its body turned out malformed, or the
    reply ended inside it): its text follows as text, and no ToolCallEnd comes."""

    index: int
    call_id: str


@dataclass
class ToolCallEnd:
    index: int
    call_id: str
    name: str
    arguments_json: str  # the whole arguments object, the fragments joined
