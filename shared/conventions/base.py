"""What a convention declares: one way a model marks reasoning and tool calls in its replies.

A convention is one module of this package holding one ``Convention`` subclass, and one line in
the registry (``shared/conventions/__init__.py``). The worker asks it whether a vocabulary and
template follow it (``detects``, ``thinks_on_request``, ``calls_tools``); the gateway asks it how
a request switches thinking on, how a reply splits into reasoning and text, how a call block
reads, and the grammar that forces a call. Every marker is written once, in its module.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from shared.chat_template import ChatTemplate
from shared.conventions.calls import CallSyntax, ToolCallParser
from shared.conventions.reasoning import ReasoningSplitter, Splitter
from shared.errors import InvalidRequestError
from shared.protocol import Tags
from shared.tokenizer import Tokenizer

# the layout, up to two line breaks, a model may write after its reasoning and before a forced call
LEAD = '"\\n"? "\\n"? '

Functions = list[tuple[str, dict[str, Any]]]  # the tools a grammar may call: (name, arguments schema)


def in_vocabulary(tokenizer: Tokenizer, texts: tuple[str, ...]) -> bool:
    """Every one of these texts is a token of the vocabulary."""
    return all(tokenizer.piece_to_id(text) is not None for text in texts)


class Convention:
    """The declarations of one convention; the defaults are those of a convention that writes
    reasoning between two tags and each call as a block between two tags."""

    name: ClassVar[str]  # Capabilities.convention: what the worker's MODEL_CARD names
    reasoning: ClassVar[Tags]  # the reasoning block's markers
    calls: ClassVar[Tags]  # a call block's markers
    # marker texts the vocabulary holds as tokens when a model follows the convention
    reasoning_tokens: ClassVar[tuple[str, ...]] = ()
    call_tokens: ClassVar[tuple[str, ...]] = ()
    reasoning_switch: ClassVar[str] = "enable_thinking"  # the template variable that turns reasoning on
    declares_tools: ClassVar[tuple[str, ...]] = ("tools", "tool_call")  # a template that calls tools holds these
    keeps_markers: ClassVar[bool] = False  # its markers are control tokens the reply's reader must see
    prefill_opens: ClassVar[str] = ""  # what the prompt gets before a client's prefill
    # under tool_choice auto, the calls of tools whose arguments are a contract are held by a grammar
    binds_chosen_calls: ClassVar[bool] = True
    # a forced call's grammar holds the whole reply, its reasoning included (the worker cannot
    # wait for the end of the reasoning before applying it)
    grammar_holds_reasoning: ClassVar[bool] = False

    # --- the worker: what the vocabulary and template say ---------------------------------------

    def detects(self, tokenizer: Tokenizer, template: ChatTemplate | None) -> bool:
        """The vocabulary holds this convention's reasoning markers or its call markers."""
        return any(markers and in_vocabulary(tokenizer, markers)
                   for markers in (self.reasoning_tokens, self.call_tokens))

    def thinks_on_request(self, tokenizer: Tokenizer, template: ChatTemplate | None) -> bool:
        """The vocabulary has the reasoning markers and the template knows the switch."""
        markers = self.reasoning_tokens
        return (template is not None and bool(markers) and in_vocabulary(tokenizer, markers)
                and self.reasoning_switch in template.source)

    def calls_tools(self, tokenizer: Tokenizer, template: ChatTemplate | None) -> bool:
        """The vocabulary has the call markers and the template shows tools and calls."""
        return (template is not None and in_vocabulary(tokenizer, self.call_tokens)
                and all(text in template.source for text in self.declares_tools))

    # --- the gateway: prompts -------------------------------------------------------------------

    def template_switch(self, reasoning: bool, effort: str | None) -> dict[str, Any]:
        """The template variables that switch a request's reasoning on or off (``effort``: an
        OpenAI effort word, for a template that takes one)."""
        return {self.reasoning_switch: reasoning}

    # --- the gateway: replies -------------------------------------------------------------------

    def kept_ids(self, tokenizer: Tokenizer) -> frozenset[int]:
        """Control tokens the detokenizer keeps in the reply's text, for the splitter to read."""
        return frozenset()

    def splitter(self, *, starts_inside: Callable[[], bool], model_calls: bool, reads_calls: bool,
                 prefilled: bool) -> Splitter:
        """The reader that splits a chat reply into reasoning and text. ``starts_inside``: whether
        the prompt opened the reasoning block (asked only by a splitter that needs it: it renders
        the template); ``model_calls``: the model calls tools in this convention; ``reads_calls``:
        this request's calls are read from the reply; ``prefilled``: the reply continues a
        client's prefill."""
        return ReasoningSplitter(self.reasoning, inside=starts_inside())

    def call_syntax(self, tools: list[dict[str, Any]], forced: list[dict[str, Any]] | None) -> CallSyntax:
        """What a call block holds and how it reads, for a request with these tools (``forced``:
        the ones a call is forced to, if it is)."""
        raise NotImplementedError(f"the {self.name} convention declares no call syntax")

    def call_parser(self, limit: int | None, tools: list[dict[str, Any]] = (),  # type: ignore[assignment]
                    forced: list[dict[str, Any]] | None = None) -> ToolCallParser:
        """The stream reader of a reply's call blocks; ``limit``: calls after which it is done."""
        return ToolCallParser(self.calls, limit, self.call_syntax(list(tools), forced))

    def calls_lark(self, tokenizer: Tokenizer, functions: Functions, parallel: bool, optional: bool = False,
                   thinking: bool = False) -> str:
        """The Lark grammar (llguidance) of calls of these tools in this convention: one, or with
        ``parallel`` one or more. ``optional``: free text first, then calls or none.
        ``thinking``: reasoning is on, so the grammar begins where the reasoning ends."""
        raise InvalidRequestError(f"this model's convention ({self.name}) has no grammar to force a call with",
                                  param="tool_choice")
