"""What the loaded model can do, decided once from its vocabulary and chat template and sent to
every gateway in MODEL_CARD (``shared.protocol.Capabilities``).

The conventions known here are the ones the Qwen3 family and its kin follow: a reasoning block
between ``<think>`` tags, switched by the template's ``enable_thinking``, and tool calls as
Hermes blocks between ``<tool_call>`` tags.
"""

from __future__ import annotations

from shared.chat_template import ChatTemplate
from shared.protocol import Tags
from shared.tokenizer import Tokenizer

THINK_TAGS = Tags("<think>", "</think>")
HERMES_CALL_TAGS = Tags("<tool_call>", "</tool_call>")


def _in_vocabulary(tokenizer: Tokenizer, tags: Tags) -> bool:
    return tokenizer.piece_to_id(tags.open) is not None and tokenizer.piece_to_id(tags.close) is not None


def has_reasoning_switch(tokenizer: Tokenizer, template: ChatTemplate | None) -> bool:
    """A model can think on request when its vocabulary has the think tags and its template
    knows the enable_thinking switch."""
    return template is not None and _in_vocabulary(tokenizer, THINK_TAGS) and "enable_thinking" in template.source


def tool_call_tags(tokenizer: Tokenizer, template: ChatTemplate | None) -> Tags | None:
    """A model calls tools the Hermes way when its vocabulary has the call tags and its
    template shows tools and calls."""
    if template is None or not _in_vocabulary(tokenizer, HERMES_CALL_TAGS):
        return None
    source = template.source
    return HERMES_CALL_TAGS if "tools" in source and "tool_call" in source else None
