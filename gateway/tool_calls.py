"""What a request's tools become on this model, once for every dialect: what the template is
shown, whether and how the reply is read for calls, and the grammar of a forced call.

The model's convention (``shared/conventions/``, named in its capabilities) says how its calls
are written and read; ``ToolPlan.parser`` reads the reply's text stream (after the reasoning split
and stop strings) into neutral events, which the dialects render natively.

Decisions a client may notice:

- A model without a tool convention calls nothing of its own accord, but a call the client
  forces is made anyway: the model is told the generic JSON call format and held to it.
- With parallel calls off, the reply ends after its first call (see ``ToolPlan.limit``).
- A forced call (tool_choice required, a named tool, Anthropic any / tool) is a grammar: the
  model's own call blocks of the allowed tools on a model with a convention; on one without,
  the generic JSON call format (told to the model in the system message, one call). It streams
  as it is written, as a convention's calls do: announced once its name is known and its
  arguments have begun, its arguments in fragments; the whole reply still decides, and one
  that is not a call after all is abandoned and comes back as text. A forced freeform tool's
  input streams the same way, from its first character.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any

from gateway import lark_regex
from gateway.neutral import CUSTOM, NAMED, NONE, NeutralRequest, TextDelta
from gateway.prompting import ModelView
from shared.conventions.call_streams import JsonCallReader, escaped
from shared.conventions.calls import (
    CallSyntax,
    ParsedEvent,
    ToolCallParser,
    argument_deltas,
    call_events,
    finish_started,
    json_call_schema,
    parse_json_call,
    value_begun,
)
from shared.conventions.events import ToolCallAbandoned, ToolCallStart
from shared.errors import InvalidRequestError
from shared.protocol import Tags

CUSTOM_INPUT = "input"  # the one argument a freeform (custom) tool is called with

# How a reply is read back, beside a convention's own call blocks (ToolPlan.call_format is then
# the convention's name): one generic JSON call object, or the whole reply as the input of one
# freeform tool.
JSON_CALL, RAW_INPUT = "json", "input"


@dataclass(frozen=True)
class ToolPlan:
    declared: list[dict[str, Any]]  # the tools the chat template is shown
    parse: bool  # scan the reply for calls
    limit: int | None  # calls after which the reply ends; None: no limit
    grammar: dict[str, str] | None = None  # a forced call's constraint on the reply
    instruction: str | None = None  # the generic call format, told to a model without a convention
    call_format: str = ""  # the convention's name, JSON_CALL or RAW_INPUT; "": no calls are read
    forced_name: str | None = None  # RAW_INPUT: the freeform tool the reply is the input of
    call_tags: Tags | None = None  # a convention's call blocks: their tags
    syntax: CallSyntax | None = None  # a convention's call blocks: what one holds

    def prompt_messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The conversation as rendered: with the instruction added to the system message (or as
        one), since the model was never taught the call format it is held to."""
        if self.instruction is None:
            return messages
        if messages and messages[0].get("role") == "system":
            first = messages[0]
            return [{**first, "content": f"{first.get('content') or ''}\n\n{self.instruction}".lstrip()},
                    *messages[1:]]
        return [{"role": "system", "content": self.instruction}, *messages]

    @property
    def reads_blocks(self) -> bool:
        """The reply's calls are the convention's call blocks."""
        return self.parse and self.syntax is not None

    def parser(self) -> ToolCallParser | WholeReplyCall | None:
        if not self.parse:
            return None
        if self.call_tags is not None and self.syntax is not None:
            return ToolCallParser(self.call_tags, self.limit, self.syntax)
        return WholeReplyCall(self.forced_name)


def plan(view: ModelView, request: NeutralRequest) -> ToolPlan:
    """How a request's tools are handled on this model.

    Without a tool convention the model calls nothing of its own accord: its declarations are
    dropped, so a client that always sends tools still gets plain chat. A call the client insists
    on is made anyway: the model is told the generic JSON call format and held to it by a grammar.
    With a convention, a forced call is held to the convention's call blocks by a Lark grammar.
    Under ``tool_choice`` auto the model writes text or calls as it likes, but when a tool's
    arguments are a contract (a freeform tool's grammar, ``strict: true``) a grammar lets the text
    run free and holds every call to its schema, where the convention binds such calls; a
    requested reply format takes precedence over that. With ``tool_choice`` none the tools are
    not shown, so the model has no call to make.
    """
    choice = request.tool_choice
    if choice.mode == NAMED and choice.kind == CUSTOM:
        return _forced_custom(request, choice.tools[0] if choice.tools else None)
    forced = forced_tools(request)
    if forced is not None and request.grammar is not None:
        raise InvalidRequestError("tool_choice forces a tool call and the request also constrains the "
                                  "reply's format; send one of them", param="tool_choice")
    tags = view.tool_call_tags
    if tags is None:
        if forced is None:
            return ToolPlan([], False, None)
        schema = ({"anyOf": [call_schema(request, tool, whitespace=False) for tool in forced]}
                  if len(forced) > 1 else call_schema(request, forced[0], whitespace=False))
        return ToolPlan([], True, 1, grammar={"kind": "json_schema", "source": json.dumps(schema)},
                        instruction=_json_call_instruction(request, forced), call_format=JSON_CALL)
    if not request.tools or choice.mode == NONE:
        return ToolPlan([], False, None)
    convention = view.convention
    limit = None if choice.parallel else 1
    grammar = None
    if forced is not None:
        grammar = {"kind": "lark", "source": calls_lark(view, request, forced, limit is None)}
    elif (convention.binds_chosen_calls and request.grammar is None
          and any(_binding_in_auto(request, tool["function"]) for tool in request.tools)):
        grammar = {"kind": "lark", "source": calls_lark(view, request, request.tools, limit is None, optional=True)}
    return ToolPlan(request.tools, True, limit, grammar=grammar, call_tags=tags, call_format=convention.name,
                    syntax=convention.call_syntax(request.tools, forced))


def forced_tools(request: NeutralRequest) -> list[dict[str, Any]] | None:
    """The tools one of which the reply must call, or None when no call is forced."""
    choice = request.tool_choice
    if not choice.forces_call:
        return None
    if not request.tools:
        raise InvalidRequestError("tool_choice forces a tool call, but the request has no tools",
                                  param="tool_choice")
    if choice.tools is None:
        return request.tools
    by_name = {tool["function"]["name"]: tool for tool in request.tools}
    names = list(choice.tools)
    unknown = [name for name in names if name not in by_name]
    if unknown or not names:
        raise InvalidRequestError(f"tool_choice names {unknown or 'no tool'}, which is not among the "
                                  f"request's tools ({', '.join(by_name)})", param="tool_choice")
    return [by_name[name] for name in dict.fromkeys(names)]


def _input_pattern(request: NeutralRequest, name: str) -> str | None:
    """The regex a freeform tool's input is held to inside a call: a regex grammar as it is, a
    Lark grammar rewritten as a regex where it is regular (gateway/lark_regex.py). A tool whose
    grammar cannot be rewritten (or that has none) is left free: a call's arguments are JSON,
    and only a regular language can sit inside a JSON string of the call's schema."""
    grammar = request.tool_input_grammars.get(name)
    if grammar is None:
        return None
    return grammar["source"] if grammar["kind"] == "regex" else lark_regex.to_regex(grammar["source"])


def _arguments_schema(request: NeutralRequest, function: dict[str, Any]) -> dict[str, Any]:
    """The arguments' contract: a freeform tool's one input held to its grammar's regex, the
    tool's schema where the client made it one (Anthropic's input_schema always, OpenAI's
    parameters with strict: true), else any object."""
    pattern = _input_pattern(request, function["name"])
    if pattern is not None:
        return {"type": "object", "properties": {CUSTOM_INPUT: {"type": "string", "pattern": f"^(?:{pattern})$"}},
                "required": [CUSTOM_INPUT], "additionalProperties": False}
    parameters = function.get("parameters")
    binding = request.tool_schemas_bind or function.get("strict") is True
    return parameters if binding and isinstance(parameters, dict) else {"type": "object"}


def _binding_in_auto(request: NeutralRequest, function: dict[str, Any]) -> bool:
    """Whether a call the model may choose to make must still keep to a contract."""
    return _input_pattern(request, function["name"]) is not None or function.get("strict") is True


def call_schema(request: NeutralRequest, tool: dict[str, Any], whitespace: bool = True) -> dict[str, Any]:
    """The JSON schema of one generic call to ``tool``: ``{"name": ..., "arguments": {...}}``."""
    function = tool["function"]
    return json_call_schema(function["name"], _arguments_schema(request, function), whitespace)


def call_functions(request: NeutralRequest, tools: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """The tools a grammar may call, each as its name and its arguments' contract."""
    return [(tool["function"]["name"], _arguments_schema(request, tool["function"])) for tool in tools]


def calls_lark(view: ModelView, request: NeutralRequest, tools: list[dict[str, Any]], parallel: bool,
               optional: bool = False) -> str:
    """The grammar of calls of these tools in the model's own convention."""
    return view.convention.calls_lark(view.tokenizer, call_functions(request, tools), parallel, optional,
                                      thinking=request.grammar_after_reasoning)
def _json_call_instruction(request: NeutralRequest, tools: list[dict[str, Any]]) -> str:
    lines = [("Answer with a call of one of the tools below and nothing else: a single JSON object "
              '{"name": <the tool\'s name>, "arguments": {<its arguments>}}.'), "Tools:"]
    for tool in tools:
        function = tool["function"]
        description = f": {function['description']}." if function.get("description") else "."
        lines.append(f"- {function['name']}{description} Arguments schema: "
                     f"{json.dumps(_arguments_schema(request, function), ensure_ascii=False)}")
    return "\n".join(lines)


def _forced_custom(request: NeutralRequest, name: str | None) -> ToolPlan:
    """A forced freeform tool: the whole reply is its input, held to the tool's own grammar
    (which the dialect put in ``request.grammar``) when it has one."""
    tool = next((t["function"] for t in request.tools if t["function"]["name"] == name), None)
    if tool is None:
        raise InvalidRequestError(f"tool_choice names the custom tool {name!r}, which is not among the "
                                  f"request's tools", param="tool_choice")
    description = f" ({tool['description']})" if tool.get("description") else ""
    instruction = (f"Answer with nothing but the input for the tool {name}{description}: no "
                   f"explanation, no quotes, no markup around it.")
    return ToolPlan([], True, 1, grammar=request.grammar, instruction=instruction, call_format=RAW_INPUT,
                    forced_name=name)


class WholeReplyCall:
    """The whole reply is one call: a generic JSON call object, or (with ``name``) the raw input
    of that freeform tool. It streams as it is written; the grammar made it whole, so the whole
    reply is read again once it ends, and one that is not a call after all is abandoned and comes
    back as the text it is."""

    def __init__(self, name: str | None = None):
        self.name = name
        self.text = ""
        self.completed = 0
        self.done = False  # the grammar ends the reply; nothing needs cutting off
        self.reader = JsonCallReader() if name is None else None
        self.input_json = ""  # a freeform tool's arguments as written so far
        self.started: ToolCallStart | None = None
        self.sent = 0  # characters of the arguments JSON sent

    def arguments(self) -> str | None:
        """The arguments JSON written so far, once the call can be announced; else None."""
        if self.reader is None:
            return self.input_json or None
        reader = self.reader
        if self.started is None and not (reader.ready and value_begun(reader.arguments)):
            return None
        return None if reader.broken else reader.arguments

    def push(self, text: str) -> list[ParsedEvent]:
        self.text += text
        if self.reader is not None:
            self.reader.feed(text)
        elif text:
            self.input_json = (self.input_json or json.dumps({CUSTOM_INPUT: ""})[:-2]) + escaped(text)
        arguments = self.arguments()
        if arguments is None:
            return []
        out: list[ParsedEvent] = []
        if self.started is None:
            self.started = ToolCallStart(0, secrets.token_hex(12), self.name or self.reader.name)
            out.append(self.started)
        if len(arguments) > self.sent:
            out += argument_deltas(0, arguments[self.sent:], self.sent)
            self.sent = len(arguments)
        return out

    def flush(self) -> list[ParsedEvent]:
        text, self.text = self.text, ""
        call = (self.name, {CUSTOM_INPUT: text}) if self.name is not None else parse_json_call(text.strip())
        started, self.started = self.started, None
        if call is None:
            abandoned = [ToolCallAbandoned(0, started.call_id)] if started is not None else []
            return abandoned + ([TextDelta(text)] if text else [])
        self.completed += 1
        if started is None:
            return call_events(0, *call)
        sent = (self.input_json if self.reader is None else self.reader.arguments)[:self.sent]
        return finish_started(started, sent, *call)
