"""The reasoning split alone: Qwen3-shaped replies cut at every character boundary."""

from __future__ import annotations

import pytest

from gateway.neutral import ReasoningDelta, TextDelta
from shared.conventions.hermes import THINK as THINK_TAGS
from shared.conventions.reasoning import ReasoningSplitter


def split(pieces: list[str], inside: bool = False) -> tuple[str, str]:
    splitter = ReasoningSplitter(THINK_TAGS, inside)
    events = [event for piece in pieces for event in splitter.push(piece)] + splitter.flush()
    assert all(event.text for event in events)
    return ("".join(e.text for e in events if isinstance(e, ReasoningDelta)),
            "".join(e.text for e in events if isinstance(e, TextDelta)))


def cuts(text: str):
    for cut in range(len(text) + 1):
        yield [text[:cut], text[cut:]]
    yield list(text)


@pytest.mark.parametrize("reply, inside, expected", [
    # the model opens the block itself (thinking on); the line breaks around it are layout
    ("<think>\nFirst.\n\nSecond.\n</think>\n\nThe answer.\n", False, ("First.\n\nSecond.", "The answer.\n")),
    # the template opened the block in the prompt (Qwen3-2507 thinking style)
    ("\nHmm.\n</think>\n\nYes.", True, ("Hmm.", "Yes.")),
    # thinking off: the prompt holds the empty block, the reply is all text, its line breaks kept
    ("\nPlain text.\n", False, ("", "\nPlain text.\n")),
    # cut off while thinking: what was thought is still reasoning
    ("<think>\nStill thinking\n", False, ("Still thinking", "")),
    ("a <thin b", False, ("", "a <thin b")),
])
def test_any_cut_gives_the_same_split(reply, inside, expected):
    for pieces in cuts(reply):
        assert split(pieces, inside) == expected, pieces
