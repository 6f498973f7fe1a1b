"""What a reply's readers hand on: text, reasoning and whole tool calls.

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
    """A tool call the model completed (calls are only announced once whole and valid).

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
class ToolCallEnd:
    index: int
    call_id: str
    name: str
    arguments_json: str  # the whole arguments object, the fragments joined
