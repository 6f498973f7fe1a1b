"""OpenAI Responses (``POST /v1/responses``), stateless: wire JSON <-> neutral request/events.

Decisions a client may notice:

- Stateless. ``store`` true or false is accepted and nothing is ever kept, so
  ``previous_response_id``, ``conversation`` and stored ``prompt`` templates are refused with a 400
  that names the field; callers (Codex included) re-send the whole history in ``input``.
- Reasoning. ``reasoning.effort`` none|minimal turns the model's reasoning channel off, the other
  values turn it on. Codex sends an effort on every request, so on a model without a reasoning
  channel an enabling effort is a no-op here (Chat Completions rejects it) and the response
  reports ``"reasoning": {"effort": null, "summary": null}``. Summaries are never written: what
  the model thinks comes back raw, as ``reasoning_text`` content of a ``reasoning`` item, and
  ``summary`` is always null in the echo.
- Tools. Function tools reach the chat template; members of ``namespace`` tools are flattened into
  the same list (the member's own name, qualified as ``namespace.member`` only on a clash), and a
  call of one is answered as ``{name: member, namespace}``. ``custom`` (freeform) tools are shown
  to the model as a function of one string, ``input``; a call of one comes back as a
  ``custom_tool_call`` item with that input; a tool with a grammar holds that input to it
  (gateway/tool_calls.py). Hosted tools (web_search, file_search, mcp, ...)
  cannot run here and are skipped without failing.
- ``text.format`` json_object / json_schema (strict or not) hold the reply to JSON / the schema;
  a forced ``custom`` tool (tool_choice ``{type: custom, name}``) holds the whole reply to the
  tool's Lark or regex grammar and returns it as that tool's ``custom_tool_call`` input.
- ``truncation`` is accepted but the prompt is never cut: one beyond the context budget is a 400
  with code ``context_length_exceeded``.
- Top-level fields are checked strictly (an unknown one is a 400); inside input items only the
  fields we read are checked, since clients add item fields (ids, status, phase) freely.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from typing import Any

from gateway import sse
from gateway.dialects.common import (
    chat_template_kwargs,
    EFFORT_OFF,
    GRAMMAR_FIELD,
    GRAMMAR_SYNTAXES,
    grammar_extension,
    json_format_grammar,
    logprob_entries,
    max_tokens_field,
    new_id,
    one_constraint,
    openai_tool_choice,
    reasoning_from_effort,
)
from gateway.dialects import RESPONSES
from gateway.errors import error_body
from gateway.generation import Completion, prepare
from gateway.neutral import (
    Event,
    Finish,
    LogprobsDelta,
    NeutralRequest,
    Ping,
    ReasoningDelta,
    TextDelta,
    ToolCallAbandoned,
    ToolCallArgumentsDelta,
    ToolCallEnd,
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
    "model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "top_logprobs",
    "reasoning", "text", "tools", "tool_choice", "parallel_tool_calls", "stream", "store", "include",
    "prompt_cache_key", "metadata", "truncation", "background", "grammar", "ignore_eos", "chat_template_kwargs",
}
IGNORED = {
    "user", "safety_identifier", "client_metadata", "service_tier", "stream_options",
    "prompt_cache_retention", "prompt_cache_options", "max_tool_calls", "context_management",
}
REJECTED = {"previous_response_id", "conversation", "prompt"}  # they need state we never keep
# what POST /v1/responses/input_tokens takes beside a Responses body's fields (the SDK sends it)
INPUT_TOKENS_IGNORED = {"personality"}

TEXT_PARTS = ("input_text", "output_text")
SKIPPED_ITEMS = {"item_reference", "compaction", "compaction_trigger"}
LOGPROBS_INCLUDE = "message.output_text.logprobs"
INCOMPLETE_REASONS = {"length", "context"}  # both mean the output budget ran out
CUSTOM_INPUT = "input"
CUSTOM_TOOL_PARAMETERS = {"type": "object", "properties": {CUSTOM_INPUT: {"type": "string"}},
                          "required": [CUSTOM_INPUT]}


# --- parsing --------------------------------------------------------------------------------

@dataclass
class _ToolSet:
    """What the tools of a request become: template tools, plus what the template cannot show."""

    # (namespace or None, function definition in the chat-template shape), in request order
    declared: list[tuple[str | None, dict[str, Any]]] = dataclass_field(default_factory=list)
    custom: list[dict[str, Any]] = dataclass_field(default_factory=list)

    def add(self, tool: Any, where: str, namespace: str | None = None) -> None:
        check_type(tool, dict, where)
        kind = field(tool, "type", str, where, required=True)
        if kind == "function":
            field(tool, "name", str, where, required=True)
            self.declared.append((namespace, {key: tool[key] for key in ("name", "description", "parameters", "strict")
                                              if tool.get(key) is not None}))
        elif kind == "custom":
            name = field(tool, "name", str, where, required=True)
            self.custom.append({**tool, "namespace": namespace} if namespace else dict(tool))
            # The model calls a freeform tool like a function of one string, its input.
            function: dict[str, Any] = {"name": name, "parameters": CUSTOM_TOOL_PARAMETERS}
            if tool.get("description"):
                function["description"] = tool["description"]
            self.declared.append((namespace, function))
        elif kind == "namespace" and namespace is None:
            outer = field(tool, "name", str, where, required=True)
            for j, member in enumerate(field(tool, "tools", list, where, required=True)):
                self.add(member, f"{where}.tools[{j}]", namespace=outer)
        elif kind == "namespace":
            raise InvalidRequestError(f"'{where}' nests a namespace inside a namespace", param=f"{where}.type")
        # Any other type is a hosted tool (web_search, file_search, mcp, ...): nothing here runs it.

    def flat_name(self, name: str, namespace: str | None) -> str:
        """The name the model sees: a namespace member keeps its own name unless another tool
        has it too (then ``namespace.name``), so calls can be mapped back unambiguously."""
        if namespace is None or sum(1 for _, f in self.declared if f["name"] == name) == 1:
            return name
        return f"{namespace}.{name}"

    def template_tools(self) -> list[dict[str, Any]]:
        return [{"type": "function", "function": {**function, "name": self.flat_name(function["name"], namespace)}}
                for namespace, function in self.declared]

    def namespaced(self) -> dict[str, dict[str, str]]:
        """Flattened name -> {namespace, name}, for returning a call inside its namespace."""
        return {self.flat_name(function["name"], namespace): {"namespace": namespace, "name": function["name"]}
                for namespace, function in self.declared if namespace is not None}

    def forced_custom_grammar(self, tool_choice: Any) -> dict[str, str] | None:
        """The grammar of the freeform tool a tool_choice forces ({type: custom, name}), if that
        tool has one."""
        if not isinstance(tool_choice, dict) or tool_choice.get("type") != "custom":
            return None
        name = field(tool_choice, "name", str, "tool_choice", required=True)
        tool = next((t for t in self.custom if self.flat_name(t["name"], t.get("namespace")) == name), None)
        if tool is None:
            raise InvalidRequestError(f"tool_choice names the custom tool {name!r}, which is not among "
                                      f"the request's tools", param="tool_choice.name")
        return _custom_grammar(tool)

    def input_grammars(self) -> dict[str, dict[str, str]]:
        """Flattened name -> the grammar of a freeform tool's input, for those that have one."""
        grammars = {self.flat_name(tool["name"], tool.get("namespace")): _custom_grammar(tool) for tool in self.custom}
        return {name: grammar for name, grammar in grammars.items() if grammar is not None}

    def custom_names(self) -> list[str]:
        """Flattened names of the freeform tools, whose calls come back as custom_tool_call items."""
        return [self.flat_name(tool["name"], tool.get("namespace")) for tool in self.custom]


def _custom_grammar(tool: dict[str, Any]) -> dict[str, str] | None:
    """A freeform tool's grammar (format {type: grammar, syntax: lark | regex, definition}) as
    the worker takes it, or None for free text."""
    tool_format = field(tool, "format", dict, "tools[].custom", default={"type": "text"})
    if field(tool_format, "type", str, "tools[].custom.format", default="text") != "grammar":
        return None
    syntax = field(tool_format, "syntax", str, "tools[].custom.format", required=True)
    if syntax not in GRAMMAR_SYNTAXES:
        raise InvalidRequestError(f"the custom tool {tool['name']!r} has a grammar of syntax {syntax!r}; "
                                  f"this server takes {', '.join(GRAMMAR_SYNTAXES)}", param="tools")
    return {"kind": syntax, "source": field(tool_format, "definition", str, "tools[].custom.format", required=True)}


@dataclass(frozen=True)
class ResponsesEcho:
    """What the reply echoes of its request and how its calls are named back."""

    fields: dict[str, Any]  # the request's settings, as the response object repeats them
    namespaced_tools: dict[str, dict[str, str]]  # the model's name of a namespace member -> its place
    custom_tool_names: list[str]  # the model's names of the freeform tools


def _echo(request: NeutralRequest) -> ResponsesEcho:
    if not isinstance(request.echo, ResponsesEcho):
        raise TypeError("a Responses reply needs the request its parse made")
    return request.echo


def parse(body: dict[str, Any], view: ModelView, headers: Any) -> NeutralRequest:
    unknown_fields(body, HONORED | IGNORED | REJECTED)
    for key in sorted(REJECTED):
        if body.get(key) is not None:
            raise InvalidRequestError(
                f"'{key}' needs server-side state, and this server is stateless: send the whole "
                f"conversation in 'input' instead", param=key)
    if field(body, "background", bool, default=False):
        raise InvalidRequestError("'background': true needs stored responses; this server is stateless",
                                  param="background")
    text = field(body, "text", dict, default={})
    text_format = field(text, "format", dict, "text", default={"type": "text"})
    format_kind = field(text_format, "type", str, "text.format", required=True)
    format_grammar = json_format_grammar(
        format_kind, field(text_format, "schema", dict, "text.format", required=format_kind == "json_schema"),
        "text.format")
    field(text, "verbosity", str, "text")
    truncation = field(body, "truncation", str, default="disabled")
    if truncation not in ("auto", "disabled"):
        raise InvalidRequestError(f"'truncation' must be auto or disabled, got {truncation!r}", param="truncation")

    tools = _ToolSet()
    raw_tools = field(body, "tools", list, default=[])
    for i, tool in enumerate(raw_tools):
        tools.add(tool, f"tools[{i}]")
    items = _input_items(body.get("input"))
    # Tools that arrive inside the input must be known before any call in the history names them.
    for i, item in enumerate(items):
        if isinstance(item, dict) and item.get("type") == "additional_tools":
            for j, tool in enumerate(field(item, "tools", list, f"input[{i}]", required=True)):
                tools.add(tool, f"input[{i}].tools[{j}]")

    messages: list[dict[str, Any]] = []
    instructions = field(body, "instructions", str)
    if instructions:
        messages.append({"role": "system", "content": instructions})
    messages += _history(items, tools)
    if not messages:
        raise InvalidRequestError("'input' is empty and there are no 'instructions': nothing to answer",
                                  param="input")

    include = field(body, "include", list, default=[])
    for i, entry in enumerate(include):
        check_type(entry, str, f"include[{i}]")
    top_logprobs = number_in(body, "top_logprobs", 0, 20, integer=True, default=0)
    # what the body leaves out takes the model's defaults; the reply echoes the values sampled with
    sampling = view.card.sampling.params(temperature=number_in(body, "temperature", 0, 2),
                                         top_p=number_in(body, "top_p", 0, 1),
                                         logprobs=LOGPROBS_INCLUDE in include or top_logprobs > 0,
                                         top_logprobs=top_logprobs)
    temperature, top_p = sampling.temperature, sampling.top_p

    reasoning_knobs = field(body, "reasoning", dict, default={})
    effort = field(reasoning_knobs, "effort", str, "reasoning")
    field(reasoning_knobs, "summary", str, "reasoning")
    reasoning = reasoning_from_effort(effort, view, "reasoning.effort", reject_unsupported=False)
    template_kwargs, reasoning = chat_template_kwargs(body, view, reasoning)
    honoured_effort = effort if reasoning or effort in EFFORT_OFF else None

    tool_choice = body.get("tool_choice", "auto")
    check_type(tool_choice, (str, dict), "tool_choice")
    grammar = one_constraint(("text.format", format_grammar), (GRAMMAR_FIELD, grammar_extension(body)),
                             ("tool_choice", tools.forced_custom_grammar(tool_choice)))
    metadata = field(body, "metadata", dict, default={})
    field(body, "client_metadata", dict)
    max_output_tokens = max_tokens_field(body, "max_output_tokens", context=view.context_budget)
    parallel = bool(field(body, "parallel_tool_calls", bool, default=True))
    cache_key = field(body, "prompt_cache_key", str)
    echo = {
        "instructions": instructions, "metadata": metadata, "max_output_tokens": max_output_tokens,
        "store": bool(field(body, "store", bool, default=False)), "temperature": temperature,
        "top_p": top_p, "top_logprobs": top_logprobs, "truncation": truncation,
        "text": {**text, "format": text_format}, "tools": raw_tools, "tool_choice": tool_choice,
        "parallel_tool_calls": parallel, "prompt_cache_key": cache_key,
        "reasoning": {"effort": honoured_effort, "summary": None},
        "user": field(body, "user", str), "safety_identifier": field(body, "safety_identifier", str),
    }
    return NeutralRequest(
        dialect=RESPONSES,
        model=field(body, "model", str, default=view.model_id),
        messages=messages,
        max_tokens=max_output_tokens,
        sampling=sampling,
        tools=tools.template_tools(),
        tool_choice=openai_tool_choice(tool_choice, parallel),
        reasoning=reasoning,
        template_kwargs=template_kwargs,
        reasoning_effort=effort if reasoning else None,
        stream=bool(field(body, "stream", bool, default=False)),
        ignore_eos=bool(field(body, "ignore_eos", bool, default=False)),
        cache_hint=cache_key,
        cartridges=cartridges_field(body),
        speculate=speculation_field(body),
        grammar=grammar,
        tool_input_grammars=tools.input_grammars(),
        echo=ResponsesEcho(echo, tools.namespaced(), tools.custom_names()),
    )


def _input_items(value: Any) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    return check_type(value, (str, list), "input")


def _history(items: list[Any], tools: _ToolSet) -> list[dict[str, Any]]:
    """Input items as chat-template messages.

    A turn of the model arrives as several items (reasoning, message, function_call, ...); they
    fold into one assistant message, the way the template expects a turn.
    """
    messages: list[dict[str, Any]] = []
    pending_reasoning: list[str] = []
    # The assistant message that later items of the same turn still extend, if any.
    turn: dict[str, Any] | None = None

    def assistant_turn() -> dict[str, Any]:
        nonlocal turn
        if turn is None:
            turn = {"role": "assistant", "content": ""}
            messages.append(turn)
        if pending_reasoning:
            joined = "\n".join(filter(None, [turn.get("reasoning_content"), *pending_reasoning]))
            turn["reasoning_content"] = joined
            pending_reasoning.clear()
        return turn

    asking = last_user_index(items)
    for i, item in enumerate(items):
        where = f"input[{i}]"
        check_type(item, dict, where)
        kind = field(item, "type", str, where, default="message")
        if kind == "message":
            role = field(item, "role", str, where, required=True)
            content = text_of_parts(item.get("content"), f"{where}.content", TEXT_PARTS,
                                    current_turn=i == asking)
            if role == "assistant":
                turn = None  # a second message item starts a new assistant message
                assistant_turn()["content"] = content
                continue
            if role not in ("user", "system", "developer"):
                raise InvalidRequestError(
                    f"'{where}.role' must be user, assistant, system or developer, got {role!r}",
                    param=f"{where}.role")
            _settle(pending_reasoning, messages)
            turn = None
            messages.append({"role": "system" if role == "developer" else role, "content": content})
        elif kind in ("function_call", "custom_tool_call"):
            name = field(item, "name", str, where, required=True)
            call_id = field(item, "call_id", str, where, required=True)
            name = tools.flat_name(name, field(item, "namespace", str, where))
            if kind == "function_call":
                arguments: Any = _arguments(field(item, "arguments", str, where, default="{}"))
            else:
                # shown as the model was told to call it: a function of one string
                arguments = {CUSTOM_INPUT: field(item, "input", str, where, default="")}
            assistant_turn().setdefault("tool_calls", []).append(
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            _settle(pending_reasoning, messages)
            turn = None
            messages.append({"role": "tool", "tool_call_id": field(item, "call_id", str, where, required=True),
                             "content": text_of_parts(item.get("output"), f"{where}.output", TEXT_PARTS)})
        elif kind == "reasoning":
            text = _reasoning_text(item, where)
            if text:
                pending_reasoning.append(text)
        elif kind == "additional_tools" or kind in SKIPPED_ITEMS:
            continue  # additional_tools were merged before the history was read
        else:
            raise InvalidRequestError(
                f"'{where}.type' {kind!r} cannot be replayed on this server; it reads message, "
                f"function_call, function_call_output, custom_tool_call(_output), reasoning and "
                f"additional_tools items", param=f"{where}.type")
    _settle(pending_reasoning, messages)
    return messages


def _settle(pending_reasoning: list[str], messages: list[dict[str, Any]]) -> None:
    """Reasoning with no assistant item after it belongs to the assistant turn before it."""
    if not pending_reasoning:
        return
    previous = next((m for m in reversed(messages) if m["role"] == "assistant"), None)
    if previous is not None:
        previous["reasoning_content"] = "\n".join(
            filter(None, [previous.get("reasoning_content"), *pending_reasoning]))
    pending_reasoning.clear()


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    # Raw reasoning is what the model wrote; a summary is the next best record of it.
    content = field(item, "content", list, where, default=[])
    text = text_of_parts(content, f"{where}.content", ("reasoning_text",))
    if text:
        return text
    pieces = []
    for j, part in enumerate(field(item, "summary", list, where, default=[])):
        check_type(part, dict, f"{where}.summary[{j}]")
        pieces.append(field(part, "text", str, f"{where}.summary[{j}]", required=True))
    return "\n".join(pieces)


def _arguments(arguments: str) -> Any:
    try:
        return json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        return arguments  # the template shows it verbatim


def input_tokens(body: dict[str, Any], view: ModelView, headers: Any) -> int:
    """``POST /v1/responses/input_tokens``: the prompt length a Responses request with this body
    would run (the same parse, the same rendering), what its ``usage.input_tokens`` reports."""
    field(body, "personality", str)  # a style preset of OpenAI's models: nothing here to apply
    request = {key: value for key, value in body.items() if key not in INPUT_TOKENS_IGNORED}
    return len(prepare(view, parse(request, view, headers))[1])


# --- rendering ------------------------------------------------------------------------------

def _usage(usage: Usage) -> dict[str, Any]:
    return {"input_tokens": usage.prompt_tokens,
            # Only reuse is measured; the current SDK schema requires the write count anyway.
            "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens, **usage_extras(usage)}


def _failure(error: LmserveError) -> dict[str, Any]:
    envelope = error_body(RESPONSES, error)["error"]
    return {"code": envelope["code"] or envelope["type"], "message": envelope["message"]}


def _part(kind: str, text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    if kind == "reasoning":
        return {"type": "reasoning_text", "text": text}
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def _item(kind: str, item_id: str, status: str, parts: list[dict[str, Any]]) -> dict[str, Any]:
    if kind == "reasoning":
        return {"id": item_id, "type": "reasoning", "summary": [], "content": parts, "status": status}
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": parts}


def _call_item(request: NeutralRequest, call_id: str, name: str, arguments_json: str | None,
               status: str) -> dict[str, Any]:
    """A call as its output item (arguments_json None: not known yet). A namespace member is
    answered under its own name with its namespace, a freeform tool as a custom_tool_call."""
    echo = _echo(request)
    place = echo.namespaced_tools.get(name)
    item: dict[str, Any]
    if name in echo.custom_tool_names:
        item = {"id": "ctc_" + call_id, "type": "custom_tool_call", "call_id": "call_" + call_id,
                "name": name, "input": "" if arguments_json is None else _custom_input(arguments_json)}
    else:
        item = {"id": "fc_" + call_id, "type": "function_call", "call_id": "call_" + call_id, "name": name,
                "arguments": arguments_json or "", "status": status}
    if place is not None:
        item.update(name=place["name"], namespace=place["namespace"])
    return item


def _custom_input(arguments_json: str) -> str:
    arguments = json.loads(arguments_json)
    text = arguments.get(CUSTOM_INPUT)
    # A model that ignored the one-string shape still gets its call through, as the JSON it wrote.
    return text if isinstance(text, str) and len(arguments) == 1 else arguments_json


def _terminal_status(finish: Finish) -> str:
    if finish.reason == "error":
        return "failed"
    return "incomplete" if finish.reason in INCOMPLETE_REASONS else "completed"


def _response(request: NeutralRequest, response_id: str, created_at: int, status: str,
              output: list[dict[str, Any]], usage: Usage | None = None,
              error: dict[str, Any] | None = None) -> dict[str, Any]:
    echo = _echo(request).fields
    finished = status in ("completed", "incomplete", "failed")
    return {
        "id": response_id, "object": "response", "created_at": created_at,
        "completed_at": int(time.time()) if finished else None,
        "status": status, "background": False, "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "model": request.model, "output": output, "previous_response_id": None,
        "service_tier": "default", "usage": _usage(usage) if usage else None, **echo,
    }


def render(request: NeutralRequest, view: ModelView, completion: Completion) -> dict[str, Any]:
    finish = completion.finish
    assert finish is not None
    status = _terminal_status(finish)
    item_status = "incomplete" if status == "incomplete" else "completed"
    output = []
    if completion.reasoning_text:
        output.append(_item("reasoning", new_id("rs_"), item_status,
                            [_part("reasoning", completion.reasoning_text)]))
    if completion.content or not (output or completion.calls):
        logprobs = logprob_entries(completion.logprobs) if request.sampling.logprobs else []
        output.append(_item("message", new_id("msg_"), item_status,
                            [_part("message", completion.content, logprobs)]))
    output += [_call_item(request, call.call_id, call.name, call.arguments_json, "completed")
               for call in completion.calls]
    return _response(request, new_id("resp_"), int(time.time()), status, output, finish.usage)


@dataclass
class _OpenItem:
    kind: str  # "reasoning" | "message"
    item_id: str
    index: int
    text: list[str] = dataclass_field(default_factory=list)
    logprobs: list[dict[str, Any]] = dataclass_field(default_factory=list)


class _ResponseStream:
    """One response's SSE events: numbering, and the added/delta/done life of each output item."""

    def __init__(self, request: NeutralRequest):
        self.request = request
        self.response_id = new_id("resp_")
        self.created_at = int(time.time())
        self.sequence = 0
        self.output: list[dict[str, Any]] = []
        self.open: _OpenItem | None = None
        self.calls: dict[int, tuple[int, dict[str, Any]]] = {}  # call index -> (output index, added item)
        self.inputs: dict[int, tuple[str, str]] = {}  # a freeform call's index -> (its JSON so far, input sent)
        self.added = 0  # output items added, an abandoned call's included: the next one's output_index

    def event(self, kind: str, **payload: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.sequence, **payload}
        self.sequence += 1
        return sse.event(data, kind)

    def lifecycle(self, kind: str, status: str, usage: Usage | None = None,
                  error: dict[str, Any] | None = None) -> bytes:
        return self.event(kind, response=_response(self.request, self.response_id, self.created_at,
                                                   status, list(self.output), usage, error))

    def delta(self, kind: str, text: str, logprobs: list[dict[str, Any]]) -> list[bytes]:
        out = []
        if self.open is not None and self.open.kind != kind:
            out += self.close("completed")
        if self.open is None:
            out += self.start(kind)
        item = self.open
        assert item is not None
        item.text.append(text)
        where = {"item_id": item.item_id, "output_index": item.index, "content_index": 0}
        if kind == "reasoning":
            out.append(self.event("response.reasoning_text.delta", **where, delta=text))
        else:
            item.logprobs += logprobs
            out.append(self.event("response.output_text.delta", **where, delta=text, logprobs=logprobs))
        return out

    def start(self, kind: str) -> list[bytes]:
        item = self.open = _OpenItem(kind, new_id("rs_" if kind == "reasoning" else "msg_"), self.added)
        self.added += 1
        return [self.event("response.output_item.added", output_index=item.index,
                           item=_item(kind, item.item_id, "in_progress", [])),
                self.event("response.content_part.added", item_id=item.item_id, output_index=item.index,
                           content_index=0, part=_part(kind, ""))]

    def close(self, status: str) -> list[bytes]:
        item, self.open = self.open, None
        if item is None:
            return []
        text = "".join(item.text)
        part = _part(item.kind, text, item.logprobs)
        where = {"item_id": item.item_id, "output_index": item.index, "content_index": 0}
        done = _item(item.kind, item.item_id, status, [part])
        self.output.append(done)
        if item.kind == "reasoning":
            text_done = self.event("response.reasoning_text.done", **where, text=text)
        else:
            text_done = self.event("response.output_text.done", **where, text=text, logprobs=item.logprobs)
        return [text_done, self.event("response.content_part.done", **where, part=part),
                self.event("response.output_item.done", output_index=item.index, item=done)]

    def call_start(self, call: ToolCallStart) -> list[bytes]:
        # A call streams alone (start, fragments, end or abandon in a row): the next item in order.
        out = self.close("completed")
        item = _call_item(self.request, call.call_id, call.name, None, "in_progress")
        self.calls[call.index] = (self.added, item)
        self.added += 1
        return out + [self.event("response.output_item.added", output_index=self.calls[call.index][0], item=item)]

    def call_delta(self, delta: ToolCallArgumentsDelta) -> list[bytes]:
        index, started = self.calls[delta.index]
        if started["type"] != "function_call":
            written, sent = self.inputs.get(delta.index, ("", ""))
            written += delta.json_fragment
            text = _input_so_far(written)
            self.inputs[delta.index] = (written, text if text is not None else sent)
            if text is None or len(text) <= len(sent):
                return []
            return [self.event("response.custom_tool_call_input.delta", item_id=started["id"], output_index=index,
                               delta=text[len(sent):])]
        started["arguments"] += delta.json_fragment
        return [self.event("response.function_call_arguments.delta", item_id=started["id"], output_index=index,
                           delta=delta.json_fragment)]

    def call_end(self, call: ToolCallEnd) -> list[bytes]:
        index, started = self.calls[call.index]
        item = _call_item(self.request, call.call_id, call.name, call.arguments_json, "completed")
        where = {"item_id": started["id"], "output_index": index}
        if item["type"] == "function_call":
            out = [self.event("response.function_call_arguments.done", **where, arguments=item["arguments"],
                              name=item["name"])]
        else:
            sent = self.inputs.pop(call.index, ("", ""))[1]
            rest = item["input"][len(sent):] if item["input"].startswith(sent) else item["input"]
            out = [self.event("response.custom_tool_call_input.delta", **where, delta=rest)] if rest else []
            out.append(self.event("response.custom_tool_call_input.done", **where, input=item["input"]))
        self.output.append(item)
        return out + [self.event("response.output_item.done", output_index=index, item=item)]

    def call_abandon(self, call: ToolCallAbandoned) -> list[bytes]:
        """A call that did not finish as one: its item ends incomplete and stays out of the
        response's output (its text follows as a message, as the whole reply has it)."""
        index, started = self.calls.pop(call.index)
        self.inputs.pop(call.index, None)
        done = {**started, "status": "incomplete"} if started["type"] == "function_call" else started
        return [self.event("response.output_item.done", output_index=index, item=done)]

    def finish(self, finish: Finish) -> list[bytes]:
        status = _terminal_status(finish)
        item_status = "completed" if status == "completed" else "incomplete"
        out = self.close(item_status)
        if not self.output and status != "failed":
            # Codex builds its history from output items, so an answer is never itemless.
            out += self.start("message") + self.close(item_status)
        if status == "failed":
            error = _failure(LmserveError(finish.error or "generation failed"))
            return out + [self.lifecycle("response.failed", status, finish.usage, error)]
        return out + [self.lifecycle(f"response.{status}", status, finish.usage)]

    def fail(self, error: LmserveError) -> list[bytes]:
        return self.close("incomplete") + [self.lifecycle("response.failed", "failed", error=_failure(error))]


async def stream(request: NeutralRequest, view: ModelView, events: AsyncIterator[Event]) -> AsyncIterator[bytes]:
    response = _ResponseStream(request)
    # Both go out before the first worker event, so a long prefill never looks like a dead stream.
    yield response.lifecycle("response.created", "in_progress")
    yield response.lifecycle("response.in_progress", "in_progress")
    logprobs: list[dict[str, Any]] = []  # they arrive just before the text of the same tokens
    try:
        async for event in events:
            chunks: list[bytes] = []
            if isinstance(event, TextDelta):
                chunks = response.delta("message", event.text, logprobs)
                logprobs = []
            elif isinstance(event, ReasoningDelta):
                chunks = response.delta("reasoning", event.text, [])
            elif isinstance(event, ToolCallStart):
                chunks = response.call_start(event)
            elif isinstance(event, ToolCallArgumentsDelta):
                chunks = response.call_delta(event)
            elif isinstance(event, ToolCallEnd):
                chunks = response.call_end(event)
            elif isinstance(event, ToolCallAbandoned):
                chunks = response.call_abandon(event)
            elif isinstance(event, LogprobsDelta) and request.sampling.logprobs:
                logprobs += logprob_entries(event.items)
            elif isinstance(event, Ping):
                chunks = [sse.comment()]
            elif isinstance(event, Finish):
                for chunk in response.finish(event):
                    yield chunk
                return
            for chunk in chunks:
                yield chunk
    except LmserveError as exc:
        for chunk in response.fail(exc):
            yield chunk
        return
    for chunk in response.fail(LmserveError("the answer ended without a finish")):
        yield chunk


def _input_so_far(written: str) -> str | None:
    """A freeform call's input as far as the fragments of its arguments (``{"input": "…``, cut
    never inside an escape) have written it; None before its string has begun."""
    try:
        return json.loads(written)[CUSTOM_INPUT]
    except (ValueError, KeyError, TypeError):
        pass
    opener = json.dumps({CUSTOM_INPUT: ""})[:-2]
    if not written.startswith(opener):
        return None
    try:
        return json.loads('"' + written[len(opener):] + '"')
    except ValueError:
        return None
