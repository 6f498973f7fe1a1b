"""Tool calls in the model's reply, in the model's own convention, once for every dialect.

A model with the Hermes convention (Qwen3 and its kin) writes among its text
``<tool_call>\\n{"name": "get_weather", "arguments": {"city": "Paris"}}\\n</tool_call>``, one
block per call; a Gemma 4 model writes ``<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>``
(gateway/gemma4_calls.py); an Inkling model writes a block,
``get_weather<|content_invoke_tool_json|>{"name":"get_weather","args":{"city":"Paris"}}<|end_message|>``
(gateway/inkling_blocks.py, whose reader hands each call block on whole); a nanochat model calls its calculator,
``<|python_start|>2+2<|python_end|>``, which comes back as a call of the request's calculator
tool (``calculator_call``). The worker names the model's call tags and format in its
capabilities. ``ToolCallParser`` reads the reply's text stream (after the reasoning split and
stop strings) and turns each block into neutral events; the dialects render those natively.

Decisions a client may notice:

- A call is announced only once its closing tag has arrived and its JSON holds a name and an
  object of arguments. A call still open when the reply ends, bad JSON, or a missing name comes
  back as the text the model wrote, so a stream never carries half a call and never fails on one.
- ``</tool_call>`` inside a JSON string does not close the call. A raw line break cannot be part
  of a JSON string, so one ends the string for this purpose: a call with an unterminated string
  is still closed by its tag (and returned as text) instead of swallowing the rest of the reply.
  (Gemma 4's strings, between ``<|"|>`` quotes, may hold line breaks.)
- The whitespace a model writes around its calls (the line break before a call, between calls,
  after the last one) is layout, not text: it is dropped, so no dialect shows an empty text part.
- Arguments are re-serialized (``json.dumps``, non-ASCII kept) and handed out in several
  fragments, each cut where the text so far is a prefix a partial-JSON reader accepts (Anthropic's
  SDK parses the accumulated fragments after every delta).
- With parallel calls off, the reply ends after its first call (see ``ToolPlan.limit``).
- A forced call (tool_choice required, a named tool, Anthropic any / tool) is a grammar: the
  model's own call blocks of the allowed tools on a model with a convention; on one without,
  the generic JSON call format (told to the model in the system message, one call, read when
  the reply ends).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gateway import gemma4_calls, inkling_blocks, lark_regex, qwen_xml_calls
from gateway.neutral import (
    NeutralRequest,
    TextDelta,
    ToolCallArgumentsDelta,
    ToolCallEnd,
    ToolCallStart,
)
from gateway.prompting import ModelView
from gateway.stop_strings import partial_suffix
from shared.errors import InvalidRequestError
from shared.protocol import Tags

FRAGMENT_CHARS = 12  # about three tokens of JSON per arguments delta

ParsedEvent = TextDelta | ToolCallStart | ToolCallArgumentsDelta | ToolCallEnd


# --- what a request's tools become --------------------------------------------------------------

# The bound on JSON whitespace in a forced call (the worker uses the same one for JSON schemas):
# a small model left free to write whitespace can loop on it forever inside a call.
CALL_WHITESPACE = {"whitespace_pattern": r"[ \n]{0,2}"}
CUSTOM_INPUT = "input"  # the one argument a freeform (custom) tool is called with

# How a reply is read back: Hermes blocks, Gemma 4's call blocks, one generic JSON call object,
# or the whole reply as the input of one freeform tool.
HERMES, GEMMA4, NANOCHAT, JSON_CALL, RAW_INPUT = "hermes", "gemma4", "nanochat", "json", "input"
QWEN_XML = "qwen_xml"  # Hermes's tags around <function=…> and <parameter=…> blocks
INKLING = inkling_blocks.INKLING  # blocks of a kind each; a call's is JSON with name and args
CALCULATOR_NAMES = ("python", "calculator")  # nanochat's one tool: the name its calls get by default
CALCULATOR_ARGUMENT = "code"
CALCULATOR_CODE_CHARS = 256  # a forced calculator call's code: one line, an expression


@dataclass(frozen=True)
class ToolPlan:
    declared: list[dict[str, Any]]  # the tools the chat template is shown
    parse: bool  # scan the reply for calls
    limit: int | None  # calls after which the reply ends; None: no limit
    grammar: dict[str, str] | None = None  # a forced call's constraint on the reply
    instruction: str | None = None  # the generic call format, told to a model without a convention
    call_format: str = HERMES
    forced_name: str | None = None  # RAW_INPUT: the freeform tool the reply is the input of
    call_tags: Tags | None = None  # HERMES, GEMMA4, NANOCHAT: the model's call tags
    syntax: CallSyntax | None = None  # what a call block holds, where not the format's own

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

    def parser(self) -> ToolCallParser | WholeReplyCall | None:
        if not self.parse:
            return None
        if self.call_format == JSON_CALL:
            return WholeReplyCall()
        if self.call_format == RAW_INPUT:
            return WholeReplyCall(self.forced_name)
        return ToolCallParser(self.call_tags, self.limit, self.syntax or SYNTAXES[self.call_format])


def plan(view: ModelView, request: NeutralRequest) -> ToolPlan:
    """How a request's tools are handled on this model.

    Without a tool convention the model calls nothing of its own accord: its declarations are
    dropped, so a client that always sends tools still gets plain chat. A call the client insists
    on is made anyway: the model is told the generic JSON call format and held to it by a grammar.
    With a convention, a forced call is held to the Hermes blocks by a Lark grammar. Under
    ``tool_choice`` auto the model writes text or calls as it likes, but when a tool's arguments
    are a contract (a freeform tool's grammar, ``strict: true``) a grammar lets the text run free
    and holds every call to its schema; a requested reply format takes precedence over that.
    With ``tool_choice`` none the tools are not shown, so the model has no call to make.
    """
    choice = request.tool_choice
    if isinstance(choice, dict) and choice.get("type") == "custom":
        return _forced_custom(request, choice)
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
    if not request.tools or request.tool_choice == "none":
        return ToolPlan([], False, None)
    limit = None if request.parallel_tool_calls else 1
    form = view.tool_call_format if view.tool_call_format in (GEMMA4, NANOCHAT, QWEN_XML, INKLING) else HERMES
    if form == NANOCHAT:
        name, argument = calculator_call(forced or request.tools)
        syntax = CallSyntax(None, None, False, lambda raw: (name, {argument: raw}) if raw.strip() else None)
        grammar = None
        if forced is not None:
            grammar = {"kind": "lark", "source": calls_lark(view, request, forced, limit is None)}
        return ToolPlan(request.tools, True, limit, grammar=grammar, call_tags=tags, call_format=form, syntax=syntax)
    # a tag-style call's values are read by their tools' schemas (a string stays text)
    syntax = _qwen_xml_syntax(request.tools) if form == QWEN_XML else None
    if forced is not None:
        return ToolPlan(request.tools, True, limit, call_tags=tags, call_format=form, syntax=syntax,
                        grammar={"kind": "lark", "source": calls_lark(view, request, forced, limit is None)})
    if request.grammar is None and any(_binding_in_auto(request, tool["function"]) for tool in request.tools):
        return ToolPlan(request.tools, True, limit, call_tags=tags, call_format=form, syntax=syntax,
                        grammar={"kind": "lark", "source": calls_lark(view, request, request.tools, limit is None,
                                                                      optional=True)})
    return ToolPlan(request.tools, True, limit, call_tags=tags, call_format=form, syntax=syntax)


def _qwen_xml_syntax(tools: list[dict[str, Any]]) -> CallSyntax:
    schemas = {tool["function"]["name"]: tool["function"].get("parameters") for tool in tools}
    return CallSyntax(None, None, False, lambda raw: qwen_xml_calls.parse_call(raw, schemas))


def forces_call(tool_choice: Any) -> bool:
    """Whether a tool_choice (Chat's, Responses' or Anthropic's mapped one) demands a call."""
    if isinstance(tool_choice, str):
        return tool_choice == "required"
    if not isinstance(tool_choice, dict):
        return False
    kind = tool_choice.get("type")
    if kind == "allowed_tools":
        # Chat nests the mode, Responses keeps it flat.
        nested = tool_choice.get("allowed_tools")
        mode = nested.get("mode") if isinstance(nested, dict) else tool_choice.get("mode")
        return mode == "required"
    return kind in ("function", "custom", "tool", "any")


def forced_tools(request: NeutralRequest) -> list[dict[str, Any]] | None:
    """The tools one of which the reply must call, or None when no call is forced."""
    choice = request.tool_choice
    if not forces_call(choice):
        return None
    if not request.tools:
        raise InvalidRequestError("tool_choice forces a tool call, but the request has no tools",
                                  param="tool_choice")
    by_name = {tool["function"]["name"]: tool for tool in request.tools}
    if not isinstance(choice, dict) or choice.get("type") == "any":
        return request.tools
    if choice.get("type") == "allowed_tools":
        nested = choice.get("allowed_tools")
        listed = (nested if isinstance(nested, dict) else choice).get("tools") or []
        names = [entry.get("name") or (entry.get("function") or {}).get("name")
                 for entry in listed if isinstance(entry, dict)]
    else:
        function = choice.get("function")
        names = [choice.get("name") or (function.get("name") if isinstance(function, dict) else None)]
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
    schema: dict[str, Any] = {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, "arguments": _arguments_schema(request, function)},
        "required": ["name", "arguments"], "additionalProperties": False}
    if whitespace:  # a %json block inside Lark takes its options from the schema itself
        schema["x-guidance"] = CALL_WHITESPACE
    return schema


def calls_lark(view: ModelView, request: NeutralRequest, tools: list[dict[str, Any]], parallel: bool,
               optional: bool = False) -> str:
    """The grammar of calls of these tools in the model's own convention."""
    tags = view.tool_call_tags
    assert tags is not None
    if view.tool_call_format == NANOCHAT:
        ids = [view.tokenizer.piece_to_id(text) for text in (tags.open, tags.close)]
        calls = "tc*" if parallel else "tc?"
        start = f"start: TEXT {calls}\nTEXT: /(.|\\n)*/" if optional else f"start: tc{'+' if parallel else ''}"
        return f"{start}\ntc: <[{ids[0]}]> CODE <[{ids[1]}]>\nCODE: /[^\\n]{{1,{CALCULATOR_CODE_CHARS}}}/\n"
    if view.tool_call_format in (QWEN_XML, INKLING):
        functions = [(tool["function"]["name"], _arguments_schema(request, tool["function"])) for tool in tools]
        if view.tool_call_format == QWEN_XML:
            return qwen_xml_calls.lark(functions, tags.open, tags.close, parallel, optional,
                                       lead=request.grammar_after_reasoning)
        grammar = inkling_blocks.lark(view.tokenizer, functions, parallel, optional, thinking=request.reasoning)
        if grammar is None:
            raise InvalidRequestError("this model's vocabulary lacks its block tokens; tool_choice cannot force a call")
        return grammar
    if view.tool_call_format != GEMMA4:
        return hermes_lark(request, tools, tags, parallel, optional)
    ids = [view.tokenizer.piece_to_id(text) for text in (tags.open, tags.close, gemma4_calls.QUOTE)]
    if None in ids:
        raise InvalidRequestError("this model's vocabulary lacks its call tokens; tool_choice cannot force a call")
    functions = [(tool["function"]["name"], _arguments_schema(request, tool["function"])) for tool in tools]
    return gemma4_calls.lark(functions, *ids, parallel=parallel, optional=optional,
                             lead=request.grammar_after_reasoning)


def calculator_call(tools: list[dict[str, Any]]) -> tuple[str, str]:
    """The tool a nanochat calculator call is a call of, and the argument its code goes in: the
    request's one tool, else its tool named like a calculator, else ``python``; the argument is
    that tool's first required property (or first property), else ``code``."""
    functions = [tool["function"] for tool in tools]
    chosen = functions[0] if len(functions) == 1 else next(
        (f for f in functions if f["name"] in CALCULATOR_NAMES), None)
    if chosen is None:
        return CALCULATOR_NAMES[0], CALCULATOR_ARGUMENT
    parameters = chosen.get("parameters") if isinstance(chosen.get("parameters"), dict) else {}
    properties = list(parameters.get("properties") or {})
    required = [name for name in parameters.get("required") or [] if name in properties]
    return chosen["name"], (required or properties or [CALCULATOR_ARGUMENT])[0]


def hermes_lark(request: NeutralRequest, tools: list[dict[str, Any]], tags: Tags, parallel: bool,
                optional: bool = False) -> str:
    """A Lark grammar for one or more Hermes call blocks of these tools (``optional``: text, which
    the calls may follow, and no call at all is fine too).

    The tags are special tokens of the model's vocabulary, so the grammar names them as tokens
    (a string literal would never match them), and free text, which cannot hold a special token,
    ends where a call opens. After a reasoning block the model's own layout, up to two line
    breaks, may come before the first call.
    """
    alternatives = " | ".join(f"fn_{i}" for i in range(len(tools)))
    functions = "\n".join(f"fn_{i}: %json {json.dumps(call_schema(request, tool))}" for i, tool in enumerate(tools))
    call = f'tc: {tags.open} "\\n" ({alternatives}) "\\n" {tags.close}\n'
    if optional:
        # after the last call only layout: the reply ends there (Hermes models stop after calls)
        start = 'start: TEXT (tc ("\\n" tc)* "\\n"?)?\n' if parallel else 'start: TEXT (tc "\\n"?)?\n'
        return f"{start}TEXT: /(.|\\n)*/\n{call}{functions}\n"
    lead = '"\\n"? "\\n"? ' if request.grammar_after_reasoning else ""
    more = ' ("\\n" tc)*' if parallel else ""
    return f"start: {lead}tc{more}\n{call}{functions}\n"


def _json_call_instruction(request: NeutralRequest, tools: list[dict[str, Any]]) -> str:
    lines = [("Answer with a call of one of the tools below and nothing else: a single JSON object "
              '{"name": <the tool\'s name>, "arguments": {<its arguments>}}.'), "Tools:"]
    for tool in tools:
        function = tool["function"]
        description = f": {function['description']}." if function.get("description") else "."
        lines.append(f"- {function['name']}{description} Arguments schema: "
                     f"{json.dumps(_arguments_schema(request, function), ensure_ascii=False)}")
    return "\n".join(lines)


def _forced_custom(request: NeutralRequest, choice: dict[str, Any]) -> ToolPlan:
    """A forced freeform tool: the whole reply is its input, held to the tool's own grammar
    (which the dialect put in ``request.grammar``) when it has one."""
    name = choice.get("name")
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
    of that freeform tool. The grammar made it whole, so it is read once the reply ends; a reply
    that is not a call after all comes back as the text it is."""

    def __init__(self, name: str | None = None):
        self.name = name
        self.text = ""
        self.completed = 0
        self.done = False  # the grammar ends the reply; nothing needs cutting off

    def push(self, text: str) -> list[ParsedEvent]:
        self.text += text
        return []

    def flush(self) -> list[ParsedEvent]:
        text, self.text = self.text, ""
        call = (self.name, {CUSTOM_INPUT: text}) if self.name is not None else parse_call(text.strip())
        if call is None:
            return [TextDelta(text)] if text else []
        self.completed += 1
        return call_events(0, *call)


# --- the stream parser --------------------------------------------------------------------------

@dataclass(frozen=True)
class CallSyntax:
    """What a call block holds: where its strings start and end (a tag inside a string does
    not close the call) and how its body is read."""

    quote: str | None  # None: the body has no strings
    escape: str | None  # the character that escapes the next one inside a string
    newline_ends_string: bool
    parse: Callable[[str], tuple[str, dict[str, Any]] | None]
    tags_are_text: bool = True  # False: the tags are control tokens, never shown (Inkling's)


class ToolCallParser:
    """Feed the reply's text pieces; get back text and tool-call events (see the module doc)."""

    def __init__(self, tags: Tags, limit: int | None = None, syntax: CallSyntax | None = None):
        self.tags = tags
        self.limit = limit
        self.syntax = syntax or SYNTAXES[HERMES]
        self.completed = 0
        self.inside = False
        # Outside a call: text held back because it may start a call tag, or is whitespace that
        # may precede one. Inside: the call's text so far, and how far it has been scanned.
        self.held = ""
        self.body = ""
        self.scanned = 0
        self.in_string = False
        self.escaped = False
        self.gap = ""  # whitespace dropped before the open call, given back if it is not a call
        self.after_call = False  # whitespace right after a call is layout too

    @property
    def done(self) -> bool:
        """The reply has all the calls it may have; whatever follows is dropped."""
        return self.limit is not None and self.completed >= self.limit

    def push(self, text: str) -> list[ParsedEvent]:
        out: list[ParsedEvent] = []
        while text and not self.done:
            text = self._read_call(text, out) if self.inside else self._read_text(text, out)
        return out

    def flush(self) -> list[ParsedEvent]:
        """End of the reply: a call still open, or held-back text, is text after all."""
        out: list[ParsedEvent] = []
        if not self.done:
            if self.inside:
                self._text(self.gap + self._as_text(self.body, closed=False), out)
            else:
                self._text(self.held, out)
        self.inside, self.held, self.body, self.gap = False, "", "", ""
        return out

    def _read_text(self, text: str, out: list[ParsedEvent]) -> str:
        buffer, self.held = self.held + text, ""
        at = buffer.find(self.tags.open)
        if at == -1:
            keep = partial_suffix(buffer, (self.tags.open,))
            released = buffer[:len(buffer) - keep]
            body = released.rstrip()
            self.held = released[len(body):] + buffer[len(buffer) - keep:]
            self._text(body, out)
            return ""
        before = buffer[:at]
        body = before.rstrip()
        self._text(body, out)
        self._open(gap=before[len(body):])
        return buffer[at + len(self.tags.open):]

    def _open(self, gap: str) -> None:
        self.inside, self.gap = True, gap
        self.body, self.scanned, self.in_string, self.escaped = "", 0, False, False

    def _read_call(self, text: str, out: list[ParsedEvent]) -> str:
        self.body += text
        body, syntax = self.body, self.syntax
        for i in range(self.scanned, len(body)):
            char = body[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == syntax.escape:
                    self.escaped = True
                elif (char == "\n" and syntax.newline_ends_string) or body.endswith(syntax.quote, 0, i + 1):
                    self.in_string = False
                continue
            if syntax.quote is not None and body.endswith(syntax.quote, 0, i + 1):
                self.in_string = True
            elif char == ">" and body.endswith(self.tags.close, 0, i + 1):  # tags end with ">"
                self.inside = False
                self._close(body[:i + 1 - len(self.tags.close)], out)
                return body[i + 1:]
            elif char == ">" and body.endswith(self.tags.open, 0, i + 1):
                # A new call opens before this one closed: this one was never finished.
                self._text(self.gap + self._as_text(body[:i + 1 - len(self.tags.open)], closed=False), out)
                self._open(gap="")
                return body[i + 1:]
        self.scanned = len(body)
        return ""

    def _close(self, raw: str, out: list[ParsedEvent]) -> None:
        call = self.syntax.parse(raw)
        if call is None:
            self._text(self.gap + self._as_text(raw, closed=True), out)
            self.gap = ""
            return
        out.extend(call_events(self.completed, *call))
        self.completed += 1
        self.after_call, self.gap = True, ""

    def _as_text(self, raw: str, closed: bool) -> str:
        """A block that is not a call, as the text the model wrote."""
        if not self.syntax.tags_are_text:
            return raw
        return self.tags.open + raw + (self.tags.close if closed else "")

    def _text(self, text: str, out: list[ParsedEvent]) -> None:
        if self.after_call:
            text = text.lstrip()
        if text:
            self.after_call = False
            out.append(TextDelta(text))


def call_events(index: int, name: str, arguments: dict[str, Any]) -> list[ParsedEvent]:
    """One whole call as the neutral events every dialect renders."""
    call_id = secrets.token_hex(12)
    arguments_json = json.dumps(arguments, ensure_ascii=False)
    return [ToolCallStart(index, call_id, name),
            *(ToolCallArgumentsDelta(index, piece) for piece in json_fragments(arguments_json)),
            ToolCallEnd(index, call_id, name, arguments_json)]


def parse_call(raw: str, arguments_key: str = "arguments") -> tuple[str, dict[str, Any]] | None:
    """(name, arguments) of one call's JSON, or None when it is not a well-formed call; the
    arguments are under ``arguments_key`` (Inkling's calls: ``args``)."""
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: nested past any real arguments
        return None
    if not isinstance(value, dict):
        return None
    name = value.get("name")
    if not isinstance(name, str) or not name.strip():
        return None
    arguments = value.get(arguments_key, {})
    if isinstance(arguments, str):
        # Some models write the arguments object as a JSON string.
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except (ValueError, RecursionError):
            return None
    if not isinstance(arguments, dict):
        return None
    return name, arguments


def json_fragments(text: str, size: int = FRAGMENT_CHARS) -> list[str]:
    """Serialized JSON cut into pieces of about ``size`` characters.

    A cut falls inside a string (never inside an escape sequence) or after punctuation or
    whitespace outside strings (never inside a number or a literal), so every join of the first
    pieces is a JSON prefix that partial-JSON readers accept.
    """
    pieces: list[str] = []
    start = 0
    in_string = False
    escape_left = 0  # characters of an escape sequence still to come
    for i, char in enumerate(text):
        if i - start >= size and escape_left == 0 and (in_string or text[i - 1] in "{[,: "):
            pieces.append(text[start:i])
            start = i
        if escape_left:
            escape_left = 4 if escape_left == -1 and char == "u" else max(escape_left - 1, 0)
        elif in_string and char == "\\":
            escape_left = -1  # the escaped character decides the length
        elif char == '"':
            in_string = not in_string
    pieces.append(text[start:])
    return [piece for piece in pieces if piece]


SYNTAXES = {HERMES: CallSyntax('"', "\\", True, parse_call),
            GEMMA4: CallSyntax(gemma4_calls.QUOTE, None, False, gemma4_calls.parse_call),
            # the block reader ends a call block at its marker, strings or not
            INKLING: CallSyntax(None, None, False, lambda raw: parse_call(raw, "args"), tags_are_text=False)}
