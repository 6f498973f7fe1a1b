"""What the loaded model can do, decided once from its vocabulary and chat template and sent to
every gateway in MODEL_CARD (``shared.protocol.Capabilities``).

The conventions a model may follow, each a way of marking reasoning and tool calls in a reply,
are the registry's (``shared/conventions/``): the first that claims the vocabulary and template
is the model's. Its template then says whether the model thinks on request (it knows the
convention's switch) and whether it calls tools (it shows tools and calls).
"""

from __future__ import annotations

from shared import conventions
from shared.chat_template import ChatTemplate
from shared.conventions.base import Convention
from shared.protocol import Tags
from shared.tokenizer import Tokenizer


def convention(tokenizer: Tokenizer, template: ChatTemplate | None = None) -> Convention:
    """The convention the vocabulary and template follow (Hermes when no other claims them: its
    tags are what a reply of a model without markers is searched for, and never found)."""
    return conventions.detect(tokenizer, template)


def has_reasoning_switch(tokenizer: Tokenizer, template: ChatTemplate | None) -> bool:
    """A model can think on request when its vocabulary has its convention's reasoning markers
    and its template knows the convention's switch (enable_thinking; Inkling's reasoning_effort)."""
    return convention(tokenizer, template).thinks_on_request(tokenizer, template)


def tool_call_tags(tokenizer: Tokenizer, template: ChatTemplate | None) -> Tags | None:
    """The call tags of a model that calls tools in its convention: its vocabulary has the
    call markers and its template shows tools and calls; None otherwise."""
    found = convention(tokenizer, template)
    return found.calls if found.calls_tools(tokenizer, template) else None
