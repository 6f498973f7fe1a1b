"""What the loaded model can do, decided once from its vocabulary and chat template and sent to
every gateway in MODEL_CARD (``shared.protocol.Capabilities``).

These conventions are known, each a way of marking reasoning and tool calls in a reply:

- ``hermes`` (the Qwen3 family and its kin): a reasoning block between ``<think>`` tags, and tool
  calls as Hermes blocks, JSON between ``<tool_call>`` tags;
- ``gemma4``: reasoning in a thought channel, ``<|channel>thought`` … ``<channel|>``, and calls
  as ``<|tool_call>call:NAME{key:value,…}<tool_call|>`` with strings quoted by ``<|"|>``;
- ``nanochat``: no reasoning, and one tool, its calculator: ``<|python_start|>`` code
  ``<|python_end|>`` (the caller runs it; its template knows no tool declarations);
- ``qwen_xml`` (Qwen3.5, Qwen3-Coder): Hermes's tags, but a call block holds
  ``<function=NAME>`` and a ``<parameter=KEY>`` block per argument (``gateway/qwen_xml_calls.py``),
  and a call that opens ends the reasoning, closed or not;
- ``inkling``: a reply is a run of blocks, ``[NAME]<|content_KIND|>…<|end_message|>``, each after
  the first opened by ``<|message_model|>``: thinking blocks are its reasoning, text blocks its
  text, ``invoke_tool_json`` blocks its calls (``gateway/inkling_blocks.py``). Its markers are
  control tokens, which the gateway keeps in the reply's text for this convention.

The vocabulary says which convention a model follows (its marker tokens); the template says
whether it thinks on request (it knows ``enable_thinking``; Inkling's, ``reasoning_effort``),
whether it calls tools, and, for Hermes's tags, whether its calls are JSON or tags (it writes
``<function=`` and ``<parameter=``).
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.chat_template import ChatTemplate
from shared.protocol import Tags
from shared.tokenizer import Tokenizer

THINK_TAGS = Tags("<think>", "</think>")
HERMES_CALL_TAGS = Tags("<tool_call>", "</tool_call>")
GEMMA4_THOUGHT_TAGS = Tags("<|channel>thought", "<channel|>")
GEMMA4_CALL_TAGS = Tags("<|tool_call>", "<tool_call|>")
GEMMA4_QUOTE = '<|"|>'


INKLING_MESSAGE_MODEL, INKLING_END = "<|message_model|>", "<|end_message|>"
INKLING_THINKING_TAGS = Tags("<|content_thinking|>", INKLING_END)
INKLING_CALL_TAGS = Tags("<|content_invoke_tool_json|>", INKLING_END)


@dataclass(frozen=True)
class Convention:
    name: str  # the call format's name (Capabilities.tool_call_format)
    reasoning: Tags
    calls: Tags
    reasoning_tokens: tuple[str, ...]  # marker texts the vocabulary must hold as tokens
    call_tokens: tuple[str, ...]
    reasoning_switch: str = "enable_thinking"  # the template variable that turns reasoning on
    declares_tools: tuple[str, ...] = ("tools", "tool_call")  # a template that calls tools holds these


NANOCHAT_CALL_TAGS = Tags("<|python_start|>", "<|python_end|>")
HERMES = Convention("hermes", THINK_TAGS, HERMES_CALL_TAGS, ("<think>", "</think>"), ("<tool_call>", "</tool_call>"))
GEMMA4 = Convention("gemma4", GEMMA4_THOUGHT_TAGS, GEMMA4_CALL_TAGS, ("<|channel>", "<channel|>"),
                    ("<|tool_call>", "<tool_call|>", GEMMA4_QUOTE))
NANOCHAT = Convention("nanochat", THINK_TAGS, NANOCHAT_CALL_TAGS, (), (NANOCHAT_CALL_TAGS.open, NANOCHAT_CALL_TAGS.close))
QWEN_XML = Convention("qwen_xml", THINK_TAGS, HERMES_CALL_TAGS, HERMES.reasoning_tokens, HERMES.call_tokens)
INKLING = Convention("inkling", INKLING_THINKING_TAGS, INKLING_CALL_TAGS,
                     (INKLING_MESSAGE_MODEL, INKLING_THINKING_TAGS.open, INKLING_END),
                     (INKLING_MESSAGE_MODEL, INKLING_CALL_TAGS.open, INKLING_END),
                     reasoning_switch="reasoning_effort", declares_tools=("tools", "tool_declare"))
CONVENTIONS = (INKLING, GEMMA4, NANOCHAT, HERMES)


def _in_vocabulary(tokenizer: Tokenizer, texts: tuple[str, ...]) -> bool:
    return all(tokenizer.piece_to_id(text) is not None for text in texts)


def convention(tokenizer: Tokenizer, template: ChatTemplate | None = None) -> Convention:
    """The convention whose markers the vocabulary holds (Hermes when none's are: its tags are
    what a reply of a model without markers is searched for, and never found); Hermes's tags
    with a template that writes calls as tags are qwen_xml."""
    found = next((candidate for candidate in CONVENTIONS
                  if any(markers and _in_vocabulary(tokenizer, markers)
                         for markers in (candidate.reasoning_tokens, candidate.call_tokens))), HERMES)
    if found is HERMES and template is not None and "<function=" in template.source \
            and "<parameter=" in template.source:
        return QWEN_XML
    return found


def has_reasoning_switch(tokenizer: Tokenizer, template: ChatTemplate | None) -> bool:
    """A model can think on request when its vocabulary has its convention's reasoning markers
    and its template knows the convention's switch (enable_thinking; Inkling's reasoning_effort)."""
    found = convention(tokenizer)
    markers = found.reasoning_tokens
    return (template is not None and bool(markers) and _in_vocabulary(tokenizer, markers)
            and found.reasoning_switch in template.source)


def tool_call_tags(tokenizer: Tokenizer, template: ChatTemplate | None) -> Tags | None:
    """The call tags of a model that calls tools in its convention: its vocabulary has the
    call markers and its template shows tools and calls (nanochat's, calls alone: its one tool
    is never declared)."""
    found = convention(tokenizer)
    if template is None or not _in_vocabulary(tokenizer, found.call_tokens):
        return None
    source = template.source
    if found is NANOCHAT:
        return found.calls if found.calls.open in source else None
    return found.calls if all(text in source for text in found.declares_tools) else None
