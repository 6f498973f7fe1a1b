"""OpenAI Chat Completions (``POST /v1/chat/completions``): wire JSON <-> neutral request/events."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from gateway import sse
from gateway.dialects.common import (
    chat_template_kwargs,
    GRAMMAR_FIELD,
    grammar_extension,
    json_format_grammar,
    logprob_entries,
    max_tokens_field,
    new_id,
    one_constraint,
    openai_tool_choice,
    openai_sampling,
    reasoning_from_effort,
    stop_list,
)
from gateway.dialects import CHAT
from gateway.errors import sse_error_payload
from gateway.generation import Completion
from gateway.neutral import (
    Event,
    Finish,
    LogprobsDelta,
    NeutralRequest,
    Ping,
    ReasoningDelta,
    TextDelta,
    ToolCallArgumentsDelta,
    ToolCallStart,
    Usage,
    usage_extras,
)
from gateway.prompting import ModelView
from gateway.request_fields import (
    cartridges_field,
    speculation_field,
    check_type,
    field,
    last_user_index,
    number_in,
    unknown_fields,
    text_of_parts,
)
from shared.errors import InvalidRequestError, LmserveError

HONORED = {
    "cartridges",
    "speculation",
    "model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
    "min_p", "seed", "stop", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "logit_bias", "logprobs", "top_logprobs", "n", "stream", "stream_options", "reasoning_effort",
    "tools", "tool_choice", "parallel_tool_calls", "response_format", "prompt_cache_key", "grammar",
    "ignore_eos", "chat_template_kwargs",
}
IGNORED = {
    "user", "safety_identifier", "metadata", "store", "service_tier", "prompt_cache_retention",
    "prompt_cache_options", "verbosity", "modalities", "audio", "prediction", "web_search_options",
    "moderation",
}
REJECTED = {"functions", "function_call"}  # the pre-tools calling style
CALL_ID_PREFIX = "call_"
MESSAGE_FIELDS = {"role", "content", "name", "tool_calls", "tool_call_id", "refusal",
                  "reasoning_content", "reasoning", "function_call", "audio"}

TOOL_CHOICES = ("none", "auto", "required")

FINISH_REASONS = {"stop": "stop", "stop_sequence": "stop", "length": "length", "context": "length",
                  "tool_calls": "tool_calls", "error": "stop"}


@dataclass(frozen=True)
class ChatEcho:
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage


def parse(body: dict[str, Any], view: ModelView, headers: Any) -> NeutralRequest:
    unknown_fields(body, HONORED | IGNORED | REJECTED)
    for key in REJECTED:
        if key in body:
            raise InvalidRequestError(f"'{key}' is the retired function-calling style; send 'tools' instead", param=key)
    n = field(body, "n", int, default=1)
    if n != 1:
        raise InvalidRequestError(f"'n' must be 1: this server returns one choice per request, got {n}", param="n")
    grammar = one_constraint(("response_format", _response_format(body)), (GRAMMAR_FIELD, grammar_extension(body)))
    raw_messages = field(body, "messages", list, required=True)
    asking = last_user_index(raw_messages)
    messages = [_message(m, i, current=i == asking) for i, m in enumerate(raw_messages)]
    stream = bool(field(body, "stream", bool, default=False))
    stream_options = field(body, "stream_options", dict, default={})
    top_logprobs = number_in(body, "top_logprobs", 0, 20, integer=True, default=0)
    logprobs = bool(field(body, "logprobs", bool, default=False))
    if top_logprobs and not logprobs:
        raise InvalidRequestError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    sampling = openai_sampling(body, view, logprobs, top_logprobs)
    effort = field(body, "reasoning_effort", str)
    reasoning = reasoning_from_effort(effort, view, "reasoning_effort", reject_unsupported=True)
    template_kwargs, reasoning = chat_template_kwargs(body, view, reasoning)
    return NeutralRequest(
        dialect=CHAT,
        model=field(body, "model", str, default=view.model_id),
        messages=messages,
        max_tokens=max_tokens_field(body, "max_completion_tokens", "max_tokens", context=view.context_budget),
        sampling=sampling,
        stop=stop_list(body.get("stop"), "stop"),
        tools=[_tool(t, i) for i, t in enumerate(field(body, "tools", list, default=[]))],
        tool_choice=openai_tool_choice(_tool_choice(body.get("tool_choice", "auto")),
                                       bool(field(body, "parallel_tool_calls", bool, default=True))),
        reasoning=reasoning,
        reasoning_effort=effort if reasoning else None,
        template_kwargs=template_kwargs,
        stream=stream,
        ignore_eos=bool(field(body, "ignore_eos", bool, default=False)),
        cache_hint=field(body, "prompt_cache_key", str),
        cartridges=cartridges_field(body),
        speculate=speculation_field(body),
        grammar=grammar,
        echo=ChatEcho(bool(field(stream_options, "include_usage", bool, "stream_options", default=False))),
    )


def _response_format(body: dict[str, Any]) -> dict[str, str] | None:
    response_format = field(body, "response_format", dict)
    if response_format is None:
        return None
    kind = field(response_format, "type", str, "response_format", required=True)
    schema = None
    if kind == "json_schema":
        # strict or not, the schema is held to: constrained decoding costs nothing extra here
        spec = field(response_format, "json_schema", dict, "response_format", required=True)
        schema = field(spec, "schema", dict, "response_format.json_schema", default={"type": "object"})
    return json_format_grammar(kind, schema, "response_format")


def _message(message: Any, i: int, current: bool = False) -> dict[str, Any]:
    """One message in the template's shape; ``current``: the last user message, the turn being
    answered."""
    where = f"messages[{i}]"
    check_type(message, dict, where)
    unknown_fields(message, MESSAGE_FIELDS, where)
    role = field(message, "role", str, where, required=True)
    if role == "developer":
        role = "system"
    if role not in ("system", "user", "assistant", "tool"):
        raise InvalidRequestError(
            f"'{where}.role' must be system, developer, user, assistant or tool, got {role!r}", param=f"{where}.role")
    parts = ("text", "refusal") if role == "assistant" else ("text",)
    out: dict[str, Any] = {"role": role, "content": text_of_parts(message.get("content"), f"{where}.content", parts,
                                                                current_turn=current and role == "user")}
    if role == "assistant":
        calls = field(message, "tool_calls", list, where, default=[])
        if calls:
            out["tool_calls"] = [_history_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
        reasoning = field(message, "reasoning_content", str, where) or field(message, "reasoning", str, where)
        if reasoning:
            out["reasoning_content"] = reasoning
    if role == "tool":
        out["tool_call_id"] = field(message, "tool_call_id", str, where, required=True)
    name = field(message, "name", str, where)
    if name:
        out["name"] = name
    return out


def _history_call(call: Any, where: str) -> dict[str, Any]:
    check_type(call, dict, where)
    function = field(call, "function", dict, where, required=True)
    arguments = field(function, "arguments", str, f"{where}.function", default="{}")
    try:
        parsed = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        parsed = arguments  # the template shows it verbatim
    return {"id": field(call, "id", str, where, default=""), "type": "function",
            "function": {"name": field(function, "name", str, f"{where}.function", required=True),
                         "arguments": parsed}}


def _tool(tool: Any, i: int) -> dict[str, Any]:
    where = f"tools[{i}]"
    check_type(tool, dict, where)
    kind = field(tool, "type", str, where, default="function")
    if kind != "function":
        raise InvalidRequestError(f"'{where}.type' {kind!r} is not supported; send function tools", param=f"{where}.type")
    function = field(tool, "function", dict, where, required=True)
    field(function, "name", str, f"{where}.function", required=True)
    return {"type": "function", "function": function}


def _tool_choice(choice: Any) -> Any:
    check_type(choice, (str, dict), "tool_choice")
    if isinstance(choice, str) and choice not in TOOL_CHOICES:
        raise InvalidRequestError(f"'tool_choice' must be one of {', '.join(TOOL_CHOICES)} or an object, "
                                  f"got {choice!r}", param="tool_choice")
    if isinstance(choice, dict):
        field(choice, "type", str, "tool_choice", required=True)
    return choice


# --- rendering ------------------------------------------------------------------------------

def _usage(usage: Usage) -> dict[str, Any]:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": usage.reasoning_tokens}, **usage_extras(usage)}


def render(request: NeutralRequest, view: ModelView, completion: Completion) -> dict[str, Any]:
    finish = completion.finish
    assert finish is not None
    message: dict[str, Any] = {"role": "assistant", "content": completion.content, "refusal": None}
    if completion.calls:
        message["tool_calls"] = [{"id": CALL_ID_PREFIX + call.call_id, "type": "function",
                                  "function": {"name": call.name, "arguments": call.arguments_json}}
                                 for call in completion.calls]
        message["content"] = completion.content or None  # a reply of calls only has no content
    if completion.reasoning_text:
        message["reasoning_content"] = message["reasoning"] = completion.reasoning_text
    logprobs = ({"content": logprob_entries(completion.logprobs), "refusal": None}
                if request.sampling.logprobs else None)
    return {"id": new_id("chatcmpl-"), "object": "chat.completion", "created": int(time.time()),
            "model": request.model, "system_fingerprint": view.card.fingerprint[:16],
            "choices": [{"index": 0, "message": message, "logprobs": logprobs,
                         "finish_reason": FINISH_REASONS.get(finish.reason, "stop")}],
            "usage": _usage(finish.usage)}


async def stream(request: NeutralRequest, view: ModelView, events: AsyncIterator[Event]) -> AsyncIterator[bytes]:
    base = {"id": new_id("chatcmpl-"), "object": "chat.completion.chunk", "created": int(time.time()),
            "model": request.model, "system_fingerprint": view.card.fingerprint[:16]}

    def chunk(delta: dict[str, Any], finish_reason: str | None = None, logprobs: Any = None) -> bytes:
        return sse.event({**base, "choices": [{"index": 0, "delta": delta, "logprobs": logprobs,
                                               "finish_reason": finish_reason}], "usage": None})

    yield chunk({"role": "assistant", "content": ""})
    try:
        async for event in events:
            if isinstance(event, TextDelta):
                yield chunk({"content": event.text})
            elif isinstance(event, ReasoningDelta):
                yield chunk({"reasoning_content": event.text, "reasoning": event.text})
            elif isinstance(event, ToolCallStart):
                # The SDK wants id, type and name on a call's first delta, and function on every one.
                yield chunk({"tool_calls": [{"index": event.index, "id": CALL_ID_PREFIX + event.call_id,
                                             "type": "function",
                                             "function": {"name": event.name, "arguments": ""}}]})
            elif isinstance(event, ToolCallArgumentsDelta):
                yield chunk({"tool_calls": [{"index": event.index,
                                             "function": {"arguments": event.json_fragment}}]})
            elif isinstance(event, LogprobsDelta) and request.sampling.logprobs:
                yield chunk({}, logprobs={"content": logprob_entries(event.items), "refusal": None})
            elif isinstance(event, Ping):
                yield sse.comment()
            elif isinstance(event, Finish):
                if event.reason == "error":
                    yield sse.event(sse_error_payload(CHAT, LmserveError(event.error or "generation failed")))
                    return
                yield chunk({}, FINISH_REASONS.get(event.reason, "stop"))
                if isinstance(request.echo, ChatEcho) and request.echo.include_usage:
                    yield sse.event({**base, "choices": [], "usage": _usage(event.usage)})
    except LmserveError as exc:
        yield sse.event(sse_error_payload(CHAT, exc))
        return
    yield sse.event("[DONE]")
