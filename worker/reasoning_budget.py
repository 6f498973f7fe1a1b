"""Reasoning budgets (GENERATE ``reasoning_budget``): a reply thinks for at most N tokens.

Enforced where tokens are chosen: once a stream has written N tokens inside a reasoning block
(its closing marker counted among them), the next tokens are not sampled but forced, the
convention's closing marker (``</think>``, Gemma 4's ``<channel|>``, Inkling's
``<|end_message|>``), the way the model's template closes the block; the model then goes on
with its answer. A forced token is chosen inside ``Decoding.emit``, so a speculative draft that
differs from it is refused like any other that differs from the chosen token.

The markers are read as token ids (``ReasoningMarkers``): the block opens where the reply's
last tokens are the opening marker's, and closes on the closing marker's. Whether the reply
starts inside a block (a template that writes ``<think>`` into the generation prompt, or a
client's prefill that opens one) is read from the prompt: an opening marker after its last
closing one.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from shared.conventions.base import Convention, in_vocabulary
from shared.tokenizer import Tokenizer


@dataclass(frozen=True)
class ReasoningMarkers:
    """A convention's reasoning tags as the token ids a reply writes them in."""
    open: tuple[int, ...]
    close: tuple[int, ...]

    @classmethod
    def of(cls, tokenizer: Tokenizer, convention: Convention) -> ReasoningMarkers | None:
        """None where the vocabulary lacks the convention's reasoning marker tokens (a model
        without a reasoning channel, whose replies may write the tags' text in any tokens)."""
        if not convention.reasoning_tokens or not in_vocabulary(tokenizer, convention.reasoning_tokens):
            return None
        tags = convention.reasoning
        return cls(*(_marker_ids(tokenizer, text) for text in (tags.open, tags.close)))


def _marker_ids(tokenizer: Tokenizer, text: str) -> tuple[int, ...]:
    """A tag's ids: the added token it names, as encoding would match it (a worker otherwise never
    builds the encoder, which takes a large vocabulary's merges seconds and megabytes), else encoded."""
    single = tokenizer.piece_to_id(text)
    if single is not None and (single in tokenizer.special_ids or single in tokenizer.user_defined_ids):
        return (single,)
    return tuple(tokenizer.encode(text, add_special=False, parse_special=True))


def _ends_with(tokens: Sequence[int], marker: tuple[int, ...], end: int) -> bool:
    return end >= len(marker) and tuple(tokens[end - len(marker):end]) == marker


def _opened_in(prompt: Sequence[int], markers: ReasoningMarkers) -> bool:
    """The prompt leaves a reasoning block open: its last marker is an opening one."""
    for end in range(len(prompt), 0, -1):
        if _ends_with(prompt, markers.close, end):
            return False
        if _ends_with(prompt, markers.open, end):
            return True
    return False


class ReasoningBudget:
    """One stream's count of reasoning tokens, and the closing marker it forces at the budget."""

    def __init__(self, markers: ReasoningMarkers, budget: int, prompt: Sequence[int]):
        self.markers = markers
        self.budget = budget
        self.inside = _opened_in(prompt, markers)
        self.spent = 0  # tokens written inside the current block
        self.forcing: deque[int] = deque()  # the closing marker's ids not yet written
        self.recent: list[int] = []  # the last tokens written, as many as the longer marker has
        self.keep = max(len(markers.open), len(markers.close))

    def forced(self) -> int | None:
        """The token the stream must write next, or None: it samples freely."""
        if not self.forcing and self.inside and self.spent + len(self.markers.close) >= self.budget:
            self.forcing.extend(self.markers.close)
        return self.forcing[0] if self.forcing else None

    def took(self, token: int) -> None:
        """The stream wrote ``token`` (forced or sampled)."""
        if self.forcing and self.forcing[0] == token:
            self.forcing.popleft()
        self.recent = [*self.recent, token][-self.keep:]
        if self.inside:
            self.spent += 1
            if _ends_with(self.recent, self.markers.close, len(self.recent)):
                self.inside, self.forcing = False, deque()
        elif _ends_with(self.recent, self.markers.open, len(self.recent)):
            self.inside, self.spent = True, 0
