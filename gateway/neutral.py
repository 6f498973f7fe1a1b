"""The neutral request and events every dialect translates to and from.

A dialect module parses its wire JSON into a ``NeutralRequest`` and renders the ``Event``s of
``gateway.generation`` back into its wire shape; nothing else passes between them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shared.conventions.events import (  # what the conventions' reply readers produce
    ReasoningDelta,
    TextDelta,
    ToolCallAbandoned,
    ToolCallArgumentsDelta,
    ToolCallEnd,
    ToolCallStart,
)
from shared.sampling_params import SamplingParams

NONE, AUTO, REQUIRED, NAMED = "none", "auto", "required", "named"  # ToolChoice.mode
FUNCTION, CUSTOM = "function", "custom"  # ToolChoice.kind


@dataclass(frozen=True)
class ToolChoice:
    """Which calls a reply may or must make, whatever the dialect that asked.

    ``none``: the tools are not shown; ``auto``: the model calls as it likes; ``required``: it must
    call one of ``tools`` (None: of any of the request's); ``named``: it must call the one tool in
    ``tools``, a function, or a freeform (``custom``) tool whose input is then the whole reply.
    A name the client left out is None (refused when the request is planned)."""

    mode: str = AUTO
    tools: tuple[str | None, ...] | None = None
    kind: str = FUNCTION
    parallel: bool = True  # the reply may make several calls

    @property
    def forces_call(self) -> bool:
        return self.mode in (REQUIRED, NAMED)


@dataclass
class NeutralRequest:
    dialect: str  # one of gateway.dialects: CHAT, RESPONSES, ANTHROPIC
    model: str  # echoed back as the caller sent it
    messages: list[dict[str, Any]]  # chat-template messages: role, content (str), tool_calls, …
    max_tokens: int | None = None  # None: up to the context budget; 0 only with prompt_logprobs
    prompt_logprobs: int | None = None  # score the prompt too, with this many alternatives per token
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: list[str] = field(default_factory=list)
    tools: list[dict[str, Any]] = field(default_factory=list)  # {"type":"function","function":{…}}
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    reasoning: bool = False  # open the model's reasoning channel
    # how hard to think when reasoning, as an OpenAI effort word (low … max; Anthropic's budget
    # mapped to one); None: the model's default. Only a template that takes it reads it.
    reasoning_effort: str | None = None
    # at most this many reasoning tokens (Anthropic's thinking.budget_tokens); None: the effort's
    # budget, if it has one (gateway/generation.py reasoning_budget)
    reasoning_budget: int | None = None
    prefill: str = ""  # text the reply must continue from (Anthropic final assistant turn)
    # chat_template_kwargs: more variables for the chat template (checked against what it reads)
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    stream: bool = False
    # A text completion's prompt (text, or token ids) continued as it is: no template, no
    # reasoning split, no tools; ``messages`` is then empty.
    prompt: str | list[int] | None = None
    # fill-in-the-middle: the text after the gap, where ``prompt`` is the text before it
    suffix: str | None = None
    ignore_eos: bool = False  # generate past end-of-turn tokens, up to max_tokens (benchmark clients)
    cache_hint: str | None = None  # session id for cache affinity
    tenant: str = ""  # whose cached prefixes it may reuse (gateway.edge: one per API key when there are several)
    # this server's extension: the KV prefixes (cartridges, by name) to serve it behind; empty:
    # the worker's default (--cartridge), if any
    cartridges: list[str] = field(default_factory=list)
    speculate: bool = True  # this server's extension: speculation: false turns speculative decoding off
    # The reply's constraint, as the worker takes it ({"kind": json_schema | json_object | regex |
    # lark, "source": text}); forced tool calls bring their own (gateway/tool_calls.py).
    grammar: dict[str, str] | None = None
    # Freeform (custom) tools' grammars ({"kind": lark | regex, "source"}) for their one string
    # input; gateway/tool_calls.py decides how a call holds to them.
    tool_input_grammars: dict[str, dict[str, str]] = field(default_factory=dict)
    # Every tool's schema is a contract for its calls (Anthropic's input_schema), not only the
    # ones marked strict.
    tool_schemas_bind: bool = False
    # The dialect's own values for its reply: a dataclass its module defines and reads back.
    echo: object = None

    @property
    def grammar_after_reasoning(self) -> bool:
        """With reasoning on, the model thinks freely first and the grammar holds what follows
        ``</think>``."""
        return self.reasoning


@dataclass
class Usage:
    prompt_tokens: int = 0  # all prompt tokens, cached included
    cached_tokens: int = 0  # of which reused from the KV cache
    completion_tokens: int = 0
    reasoning_tokens: int = 0
    cartridges: list[str] = field(default_factory=list)  # the KV prefixes it was served behind
    drafted_tokens: int = 0  # speculative decoding: tokens drafted, and of them those that stood
    accepted_tokens: int = 0
    # why a server limit cut the reply (gateway/generation.py): "deadline" (--max-request-seconds)
    # or "max_output_tokens" (--max-output-tokens); None: no server limit did
    truncated: str | None = None


def usage_extras(usage: Usage) -> dict[str, Any]:
    """What every dialect's usage block carries beyond its own fields (this server's extension):
    the cartridges that served the reply, what speculative decoding drafted and what of it
    stood, and the server limit that cut the reply, where there were any."""
    extras: dict[str, Any] = {"cartridges": list(usage.cartridges)} if usage.cartridges else {}
    if usage.drafted_tokens:
        extras["speculation"] = {"drafted_tokens": usage.drafted_tokens, "accepted_tokens": usage.accepted_tokens}
    if usage.truncated:
        extras["truncated"] = usage.truncated
    return extras


@dataclass
class TokenLogprob:
    token: str
    logprob: float | None  # None only for a prompt's first token (PromptLogprobs)
    bytes: list[int]
    top: list[tuple[str, float, list[int]]]


@dataclass
class LogprobsDelta:
    items: list[TokenLogprob]


@dataclass
class PromptLogprobs:
    """The prompt's own tokens, scored (a request with ``prompt_logprobs``): the first one has
    no logprob (nothing predicts it); control tokens carry empty text, as the echoed prompt does."""
    items: list[TokenLogprob]


@dataclass
class Ping:
    """Nothing new yet (a long prefill): keep the connection alive."""


@dataclass
class Placement:
    """Where a request went and why, filled in by ``gateway.worker_pool`` for the access log
    and the response headers."""
    worker: str = ""  # the worker's host:pid, or its endpoint before its card arrived
    route: str = ""  # prefix | hash | load | round-robin (gateway.worker_pool)
    resent: int = 0  # times it moved on after a worker failed or was full before starting it


@dataclass
class Started:
    """The worker accepted the request; prompt size is known."""

    prompt_tokens: int
    # which worker took it and why; it changes if that worker fails before the reply starts
    # and another takes the request over
    placement: Placement | None = None
    cartridges: list[str] = field(default_factory=list)  # the KV prefixes it is served behind


@dataclass
class Finish:
    # "stop" (end of turn), "length" (max_tokens), "stop_sequence", "tool_calls" (the reply
    # completed at least one call), "context" (the context budget ran out), "error"
    reason: str
    usage: Usage
    stop_sequence: str | None = None
    error: str | None = None


Event = (TextDelta | ReasoningDelta | LogprobsDelta | PromptLogprobs | ToolCallStart | ToolCallArgumentsDelta | ToolCallEnd
         | ToolCallAbandoned | Ping | Started | Finish)
