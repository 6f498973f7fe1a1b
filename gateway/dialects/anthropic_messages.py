"""Anthropic Messages (``POST /v1/messages``, ``/v1/messages/count_tokens``): wire JSON <-> neutral
request/events.

Claude Code is the client that matters most here, so the parser is strict about what it can check
(types, ranges, unknown top-level fields) and tolerant about everything Anthropic keeps adding:
new block types, server tools, beta fields and headers are accepted without failing.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

from gateway import sse
from gateway.dialects.common import (
    chat_template_kwargs,
    GRAMMAR_FIELD,
    grammar_extension,
    json_format_grammar,
    max_tokens_field,
    new_id,
    one_constraint,
    stop_list,
)
from gateway.dialects import ANTHROPIC
from gateway.errors import sse_error_payload
from gateway.generation import Completion, prepare
from gateway.neutral import (
    AUTO,
    NAMED,
    NONE,
    REQUIRED,
    Event,
    Finish,
    NeutralRequest,
    Ping,
    ReasoningDelta,
    Started,
    TextDelta,
    ToolCallAbandoned,
    ToolCallArgumentsDelta,
    ToolCallStart,
    ToolChoice,
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
    media_placeholder,
    number_in,
    refuse_media,
    unknown_fields,
)
from shared.errors import InvalidRequestError, LmserveError

HONORED = {
    "cartridges",
    "speculation",
    "model", "max_tokens", "messages", "system", "stop_sequences", "stream", "temperature", "top_p",
    "top_k", "tools", "tool_choice", "thinking", "output_config", "output_format", "grammar",
    "chat_template_kwargs",
}
# Every other field of the current and beta MessageCreateParams: accepted so that a client
# sending them (Claude Code sends several) is never refused, and otherwise without effect.
IGNORED = {
    "metadata", "service_tier", "cache_control", "container", "diagnostics", "inference_geo", "speed",
    "user_profile_id", "workspace_id", "context_management", "mcp_servers", "compaction", "betas",
    "billing_policy", "fallback_credit_token", "fallbacks", "thread",
}

MESSAGE_FIELDS = {"role", "content"}
# The fields of each block type this server reads; a block of a type not here (server tools'
# blocks, and whatever Anthropic adds next) is not checked at all.
_CACHED = {"type", "cache_control"}
BLOCK_FIELDS = {
    "text": _CACHED | {"text", "citations"},
    "image": _CACHED | {"source"},
    "document": _CACHED | {"source", "title", "context", "citations"},
    "tool_use": _CACHED | {"id", "name", "input", "caller"},
    "tool_result": _CACHED | {"tool_use_id", "content", "is_error"},
    "thinking": {"type", "thinking", "signature"},
    "redacted_thinking": {"type", "data"},
}

THINKING_ON = ("enabled", "adaptive", "between_tools")
THINKING_TYPES = THINKING_ON + ("disabled",)
EFFORTS = ("low", "medium", "high", "xhigh", "max")
# a thinking budget as an effort word (for a model whose template takes one): the least budget
# of each, in tokens
BUDGET_EFFORTS = ((24_576, "max"), (8_192, "high"), (2_048, "medium"), (0, "low"))
TOOL_CHOICES = ("auto", "any", "tool", "none")
ROLES = ("user", "assistant", "system")
TEXT_ONLY_BLOCKS = ("image", "document")

# Claude Code's first system block carries a per-request checksum (cch=...); left in, it would
# change the prompt's first tokens on every request and defeat prefix reuse in the KV cache.
BILLING_HEADER_PREFIX = "x-anthropic-billing-header:"

TOOL_USE_ID_PREFIX = "toolu_"
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "stop_sequence": "stop_sequence",
                "tool_calls": "tool_use", "context": "model_context_window_exceeded"}

# Signatures only have to be opaque and stable within this process; a fresh key per process
# keeps anyone from forging one that a later version could choose to verify.
_SIGNING_KEY = secrets.token_bytes(32)

# Separates text blocks (and merged turns) so that adjacent sections do not run into each other.
BLOCK_JOINER = "\n\n"


@dataclass(frozen=True)
class AnthropicEcho:
    thinking_display: str | None = None  # "omitted": thinking blocks come without their text


def parse(body: dict[str, Any], view: ModelView, headers: Any) -> NeutralRequest:
    return _parse(body, view, headers, counting=False)


def count_tokens(body: dict[str, Any], view: ModelView, headers: Any) -> int:
    """The prompt length a generation with this body would have (same parse, same rendering)."""
    return len(prepare(view, _parse(body, view, headers, counting=True))[1])


def _parse(body: dict[str, Any], view: ModelView, headers: Any, counting: bool) -> NeutralRequest:
    unknown_fields(body, HONORED | IGNORED)
    # count_tokens has no max_tokens; a generation must say how long it may be.
    max_tokens = None if counting else _max_tokens(body)
    grammar = _output_format(body)
    reasoning, display, effort, budget = _thinking(body, view)
    template_kwargs, reasoning = chat_template_kwargs(body, view, reasoning)
    messages, prefill = _conversation(body)
    return NeutralRequest(
        dialect=ANTHROPIC,
        model=field(body, "model", str, default=view.model_id),
        messages=messages,
        max_tokens=max_tokens,
        # what the body leaves out takes the model's defaults
        sampling=view.card.sampling.params(
            temperature=number_in(body, "temperature", 0, 1),
            top_p=number_in(body, "top_p", 0, 1),
            top_k=number_in(body, "top_k", 0, 1 << 20, integer=True)),
        stop=stop_list(body.get("stop_sequences"), "stop_sequences"),
        tools=[tool for i, t in enumerate(field(body, "tools", list, default=[]))
               if (tool := _tool(t, i)) is not None],
        tool_choice=_tool_choice(body),
        reasoning=reasoning,
        reasoning_effort=effort if reasoning else None,
        reasoning_budget=budget if reasoning else None,
        template_kwargs=template_kwargs,
        prefill=prefill,
        stream=bool(field(body, "stream", bool, default=False)),
        cache_hint=headers.get("x-claude-code-session-id") if headers is not None else None,
        cartridges=cartridges_field(body),
        speculate=speculation_field(body),
        grammar=grammar,
        tool_schemas_bind=True,
        echo=AnthropicEcho(display),
    )


def _max_tokens(body: dict[str, Any]) -> int:
    """Required. Claude Code asks for a length of its own whatever a server's context is: one
    beyond the room the prompt leaves is capped, the reply then ending with
    ``model_context_window_exceeded``, as Anthropic's API answers one beyond the model's window."""
    value = max_tokens_field(body, "max_tokens")
    if value is None:
        field(body, "max_tokens", int, required=True)  # 'max_tokens' is required
    assert value is not None
    return value


def _output_format(body: dict[str, Any]) -> dict[str, str] | None:
    """Checks output_config, and returns the grammar its format (or the older top-level
    output_format, or this server's grammar extension) asks for."""
    config = field(body, "output_config", dict, default={})
    effort = field(config, "effort", str, "output_config")
    if effort is not None and effort not in EFFORTS:
        raise InvalidRequestError(f"'output_config.effort' must be one of {', '.join(EFFORTS)}, got {effort!r}",
                                  param="output_config.effort")
    formats: list[tuple[str, dict[str, str] | None]] = []
    for key, value in (("output_config.format", config.get("format")), ("output_format", body.get("output_format"))):
        grammar = None
        if value is not None:
            check_type(value, dict, key)
            kind = field(value, "type", str, key, required=True)
            if kind != "json_schema":  # Anthropic's only structured-output type
                raise InvalidRequestError(f"'{key}.type' must be json_schema, got {kind!r}", param=f"{key}.type")
            grammar = json_format_grammar(kind, field(value, "schema", dict, key, required=True), key)
        formats.append((key, grammar))
    return one_constraint(*formats, (GRAMMAR_FIELD, grammar_extension(body)))


def _thinking(body: dict[str, Any], view: ModelView) -> tuple[bool, str | None, str | None, int | None]:
    """Whether to open the reasoning channel, the requested thinking display, how hard to
    think (output_config.effort, else the thinking budget as an effort word, else None) and the
    thinking budget in tokens (None: none given; the effort's budget then holds).

    Asking a model without a reasoning channel to think is a no-op, never an error: Claude Code
    asks for thinking on every request to a Claude-4-style model name.
    """
    thinking = field(body, "thinking", dict)
    if thinking is None:
        return False, None, None, None
    kind = field(thinking, "type", str, "thinking", required=True)
    if kind not in THINKING_TYPES:
        raise InvalidRequestError(f"'thinking.type' must be one of {', '.join(THINKING_TYPES)}, got {kind!r}",
                                  param="thinking.type")
    budget = field(thinking, "budget_tokens", int, "thinking")
    if budget is not None and budget < 1:
        raise InvalidRequestError(f"'thinking.budget_tokens' must be at least 1, got {budget}",
                                  param="thinking.budget_tokens")
    display = field(thinking, "display", str, "thinking")
    effort = field(field(body, "output_config", dict, default={}), "effort", str, "output_config")
    if effort is None and budget is not None:
        effort = next(word for least, word in BUDGET_EFFORTS if budget >= least)
    return kind in THINKING_ON and view.has_reasoning_channel, display, effort, budget


# --- messages -------------------------------------------------------------------------------

def _conversation(body: dict[str, Any]) -> tuple[list[dict[str, Any]], str]:
    """Template messages (system first, then the turns, merged) and the prefill text."""
    raw = field(body, "messages", list, required=True)
    if not raw:
        raise InvalidRequestError("'messages' must hold at least one message", param="messages")
    turns: list[dict[str, Any]] = []
    system = _system_text(body.get("system"))
    if system:
        turns.append({"role": "system", "content": system})
    asking = last_user_index(raw)
    for i, message in enumerate(raw):
        turns.extend(_turns(message, i, current=i == asking))
    merged = _merge(turns)
    prefill = ""
    if merged and merged[-1]["role"] == "assistant":
        last = merged.pop()
        if last.get("tool_calls"):
            raise InvalidRequestError(
                "the final assistant message is a prefill the answer continues from, so it may hold "
                "text only, not tool_use blocks", param=f"messages[{len(raw) - 1}].content")
        prefill = last["content"]
    return merged, prefill


def _system_text(system: Any) -> str:
    if system is None or isinstance(system, str):
        return system or ""
    texts = []
    for where, block, kind in _typed_blocks(system, "system"):
        if kind != "text":
            raise InvalidRequestError(f"'{where}.type' must be text, got {kind!r}", param=f"{where}.type")
        text = field(block, "text", str, where, required=True)
        if not text.startswith(BILLING_HEADER_PREFIX):
            texts.append(text)
    return BLOCK_JOINER.join(texts)


def _turns(message: Any, i: int, current: bool = False) -> list[dict[str, Any]]:
    """One Anthropic message as template messages: a user message with tool results becomes
    one ``tool`` message per result, then the user's own text (if any)."""
    where = f"messages[{i}]"
    check_type(message, dict, where)
    unknown_fields(message, MESSAGE_FIELDS, where)
    role = field(message, "role", str, where, required=True)
    if role not in ROLES:
        raise InvalidRequestError(f"'{where}.role' must be user, assistant or system, got {role!r}",
                                  param=f"{where}.role")
    content = message.get("content")
    if content is None:
        raise InvalidRequestError(f"'{where}.content' is required", param=f"{where}.content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    results: list[dict[str, Any]] = []
    for path, block, kind in _typed_blocks(content, f"{where}.content"):
        if kind == "text":
            texts.append(field(block, "text", str, path, required=True))
        elif kind in TEXT_ONLY_BLOCKS:
            if current:  # the turn being answered asks about what it cannot see
                refuse_media(kind, path)
            texts.append(media_placeholder(kind))
        elif kind == "tool_use":
            _require_role(role, "assistant", kind, path)
            calls.append(_history_call(block, path))
        elif kind == "tool_result":
            _require_role(role, "user", kind, path)
            results.append(_tool_result(block, path))
        elif kind == "thinking":
            # Earlier thinking comes back with our signature (or another server's): accepted as is.
            if role == "assistant":
                reasoning.append(field(block, "thinking", str, path, default=""))
        elif kind == "redacted_thinking":
            pass  # encrypted by whoever produced it: nothing a model could read
        else:
            # server_tool_use, web_search_tool_result, search_result and whatever comes next:
            # keep any readable text, never fail on a block we do not know.
            text = _readable_text(block)
            if text:
                texts.append(text)
    turn: dict[str, Any] = {"role": role, "content": BLOCK_JOINER.join(texts)}
    if calls:
        turn["tool_calls"] = calls
    if reasoning:
        turn["reasoning_content"] = BLOCK_JOINER.join(reasoning)
    if results and not texts:
        return results
    return results + [turn]


def _typed_blocks(content: Any, where: str) -> Iterator[tuple[str, dict[str, Any], str]]:
    """(path, block, block type) for each block of a content list, each checked to be an object
    with a type."""
    check_type(content, list, where)
    for i, block in enumerate(content):
        path = f"{where}[{i}]"
        check_type(block, dict, path)
        kind = field(block, "type", str, path, required=True)
        if kind in BLOCK_FIELDS:
            unknown_fields(block, BLOCK_FIELDS[kind], path)
        yield path, block, kind


def _require_role(role: str, wanted: str, kind: str, path: str) -> None:
    if role != wanted:
        raise InvalidRequestError(f"'{path}' is a {kind} block, which belongs in a {wanted} message, "
                                  f"not a {role} message", param=f"{path}.type")


def _history_call(block: dict[str, Any], path: str) -> dict[str, Any]:
    # Templates take arguments as a dict (they serialise them themselves).
    return {"id": field(block, "id", str, path, default=""), "type": "function",
            "function": {"name": field(block, "name", str, path, required=True),
                         "arguments": field(block, "input", dict, path, default={})}}


def _tool_result(block: dict[str, Any], path: str) -> dict[str, Any]:
    text = _result_text(block.get("content"), f"{path}.content")
    if field(block, "is_error", bool, path, default=False):
        text = "Error: " + text
    return {"role": "tool", "tool_call_id": field(block, "tool_use_id", str, path, required=True),
            "content": text}


def _result_text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for path, block, kind in _typed_blocks(content, where):
        if kind in TEXT_ONLY_BLOCKS:  # a tool's image (a screenshot it took): a note in its result
            texts.append(media_placeholder(kind))
            continue
        text = _readable_text(block)
        if text:
            texts.append(text)
    return BLOCK_JOINER.join(texts)


def _readable_text(block: dict[str, Any]) -> str:
    """The text a block carries (its own, or its nested content's), or "" when it has none."""
    text = block.get("text")
    if isinstance(text, str):
        return text
    content = block.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return BLOCK_JOINER.join(t for b in content if isinstance(b, dict) and (t := _readable_text(b)))
    return ""


def _merge(turns: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Consecutive turns of one role become one (tool results stay apart: each answers its own call)."""
    merged: list[dict[str, Any]] = []
    for turn in turns:
        previous = merged[-1] if merged else None
        if previous is None or previous["role"] != turn["role"] or turn["role"] == "tool":
            merged.append(dict(turn))
            continue
        previous["content"] = BLOCK_JOINER.join(t for t in (previous["content"], turn["content"]) if t)
        if turn.get("tool_calls"):
            previous["tool_calls"] = previous.get("tool_calls", []) + turn["tool_calls"]
        if turn.get("reasoning_content"):
            previous["reasoning_content"] = BLOCK_JOINER.join(
                t for t in (previous.get("reasoning_content", ""), turn["reasoning_content"]) if t)
    return merged


# --- tools ----------------------------------------------------------------------------------

def _tool(tool: Any, i: int) -> dict[str, Any] | None:
    """A custom tool as a template function tool; None for server tools (web_search_20250305,
    bash_20250124, ...), which only Anthropic's servers can run."""
    where = f"tools[{i}]"
    check_type(tool, dict, where)
    kind = field(tool, "type", str, where, default="custom")
    if kind != "custom":
        return None
    function: dict[str, Any] = {"name": field(tool, "name", str, where, required=True)}
    description = field(tool, "description", str, where)
    if description:
        function["description"] = description
    function["parameters"] = field(tool, "input_schema", dict, where, required=True)
    if field(tool, "strict", bool, where):
        function["strict"] = True  # calls the model chooses to make keep to the schema too
    return {"type": "function", "function": function}


def _tool_choice(body: dict[str, Any]) -> ToolChoice:
    """Anthropic's tool_choice, parallel calls included, as the neutral one."""
    choice = field(body, "tool_choice", dict)
    if choice is None:
        return ToolChoice()
    kind = field(choice, "type", str, "tool_choice", required=True)
    if kind not in TOOL_CHOICES:
        raise InvalidRequestError(f"'tool_choice.type' must be one of {', '.join(TOOL_CHOICES)}, got {kind!r}",
                                  param="tool_choice.type")
    parallel = not field(choice, "disable_parallel_tool_use", bool, "tool_choice", default=False)
    if kind == "tool":
        return ToolChoice(NAMED, (field(choice, "name", str, "tool_choice", required=True),), parallel=parallel)
    return ToolChoice({"auto": AUTO, "any": REQUIRED, "none": NONE}[kind], parallel=parallel)


# --- rendering ------------------------------------------------------------------------------

def _usage(usage: Usage) -> dict[str, Any]:
    # Anthropic's input_tokens is only the uncached part; the three input fields add up to the prompt.
    return {"input_tokens": usage.prompt_tokens - usage.cached_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": usage.cached_tokens, "output_tokens": usage.completion_tokens,
            **usage_extras(usage)}


def _signature(thinking: str) -> str:
    return base64.b64encode(hmac.new(_SIGNING_KEY, thinking.encode(), hashlib.sha256).digest()).decode()


def _shown_thinking(request: NeutralRequest, thinking: str) -> str:
    # display "omitted" still returns the block (with its signature), only without the text.
    echo = request.echo if isinstance(request.echo, AnthropicEcho) else AnthropicEcho()
    return "" if echo.thinking_display == "omitted" else thinking


def _stop_fields(finish: Finish) -> dict[str, Any]:
    reason = STOP_REASONS.get(finish.reason, "end_turn")
    return {"stop_reason": reason, "stop_sequence": finish.stop_sequence if reason == "stop_sequence" else None}


def render(request: NeutralRequest, view: ModelView, completion: Completion) -> dict[str, Any]:
    finish = completion.finish
    assert finish is not None
    content: list[dict[str, Any]] = []
    if completion.reasoning_text:
        content.append({"type": "thinking", "thinking": _shown_thinking(request, completion.reasoning_text),
                        "signature": _signature(completion.reasoning_text)})
    if completion.content:
        content.append({"type": "text", "text": completion.content})
    content += [{"type": "tool_use", "id": TOOL_USE_ID_PREFIX + call.call_id, "name": call.name,
                 "input": json.loads(call.arguments_json)} for call in completion.calls]
    return {"id": new_id("msg_"), "type": "message", "role": "assistant", "model": request.model,
            "content": content, **_stop_fields(finish), "usage": _usage(finish.usage)}


async def stream(request: NeutralRequest, view: ModelView, events: AsyncIterator[Event]) -> AsyncIterator[bytes]:
    """The §1.6 sequence: message_start, ping, one content block at a time (thinking, then text,
    each opened at its first delta), message_delta with the totals, message_stop."""
    open_kind: str | None = None  # the block being streamed: "thinking" | "text" | "tool_use" | None
    index = -1
    thinking: list[str] = []

    def emit(name: str, data: dict[str, Any]) -> bytes:
        return sse.event({"type": name, **data}, name)

    def close_block() -> list[bytes]:
        nonlocal open_kind
        out = []
        if open_kind == "thinking":
            out.append(emit("content_block_delta", {"index": index, "delta": {
                "type": "signature_delta", "signature": _signature("".join(thinking))}}))
            thinking.clear()
        if open_kind is not None:
            out.append(emit("content_block_stop", {"index": index}))
        open_kind = None
        return out

    def open_block(kind: str, block: dict[str, Any] | None = None) -> list[bytes]:
        nonlocal open_kind, index
        out = close_block()
        index += 1
        open_kind = kind
        if block is None:
            block = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else {"type": "text", "text": ""}
        out.append(emit("content_block_start", {"index": index, "content_block": block}))
        return out

    try:
        async for event in events:
            if isinstance(event, Started):
                # The cache split is only known at the end (the worker picks a KV slot after
                # accepting), so message_start counts the whole prompt as input and
                # message_delta's cumulative usage, which clients take over, corrects it.
                start_usage = _usage(Usage(prompt_tokens=event.prompt_tokens, cartridges=event.cartridges))
                start_usage["output_tokens"] = 1
                yield emit("message_start", {"message": {
                    "id": new_id("msg_"), "type": "message", "role": "assistant", "model": request.model,
                    "content": [], "stop_reason": None, "stop_sequence": None, "usage": start_usage}})
                yield emit("ping", {})
            elif isinstance(event, ReasoningDelta):
                if open_kind != "thinking":
                    for chunk in open_block("thinking"):
                        yield chunk
                thinking.append(event.text)
                shown = _shown_thinking(request, event.text)
                if shown:
                    yield emit("content_block_delta", {"index": index, "delta": {
                        "type": "thinking_delta", "thinking": shown}})
            elif isinstance(event, TextDelta):
                if open_kind != "text":
                    for chunk in open_block("text"):
                        yield chunk
                yield emit("content_block_delta", {"index": index, "delta": {"type": "text_delta", "text": event.text}})
            elif isinstance(event, ToolCallStart):
                block = {"type": "tool_use", "id": TOOL_USE_ID_PREFIX + event.call_id, "name": event.name, "input": {}}
                for chunk in open_block("tool_use", block):
                    yield chunk
            elif isinstance(event, ToolCallArgumentsDelta):
                yield emit("content_block_delta", {"index": index, "delta": {
                    "type": "input_json_delta", "partial_json": event.json_fragment}})
            elif isinstance(event, ToolCallAbandoned):
                # a call that did not finish as one ends where it stopped; its text follows
                for chunk in close_block():
                    yield chunk
            elif isinstance(event, Ping):
                yield emit("ping", {})
            elif isinstance(event, Finish):
                if event.reason == "error":
                    yield sse.event(sse_error_payload(ANTHROPIC, LmserveError(event.error or "generation failed")),
                                    "error")
                    return
                for chunk in close_block():
                    yield chunk
                yield emit("message_delta", {"delta": _stop_fields(event), "usage": _usage(event.usage)})
                yield emit("message_stop", {})
    except LmserveError as exc:
        yield sse.event(sse_error_payload(ANTHROPIC, exc), "error")
