"""What more than one dialect needs when reading requests: reasoning knobs, stop lists,
sampling fields. (Wire shapes stay in each dialect's own module.)"""

from __future__ import annotations

import json
import secrets
from typing import Any

from gateway.neutral import AUTO, CUSTOM, NAMED, NONE, REQUIRED, TokenLogprob, ToolChoice
from gateway.prompting import ModelView
from gateway.request_fields import check_type, field, number_in
from shared.chat_template import SERVER_VARIABLES
from shared.errors import InvalidRequestError
from shared.sampling_params import SamplingParams

EFFORT_OFF = ("none", "minimal")
EFFORT_ON = ("low", "medium", "high", "xhigh", "max", "default")


def new_id(prefix: str, length: int = 24) -> str:
    return prefix + secrets.token_hex(length // 2)


def reasoning_from_effort(effort: str | None, view: ModelView, param: str, reject_unsupported: bool) -> bool:
    """An OpenAI-style effort value to reasoning on/off.

    Off values are always fine. On values enable the model's reasoning channel; on a model
    without one they are rejected (reject_unsupported) or quietly ignored.
    """
    if effort is None or effort in EFFORT_OFF:
        return False
    if effort not in EFFORT_ON:
        raise InvalidRequestError(
            f"'{param}' must be one of {', '.join(EFFORT_OFF + EFFORT_ON)}, got {effort!r}", param=param)
    if view.has_reasoning_channel:
        return True
    if reject_unsupported:
        raise InvalidRequestError(
            f"the model {view.model_id} has no reasoning channel, so '{param}' {effort!r} cannot be "
            f"honoured; send 'none' or leave it out", param=param)
    return False


def chat_template_kwargs(body: dict[str, Any], view: ModelView, reasoning: bool) -> tuple[dict[str, Any], bool]:
    """``chat_template_kwargs`` (vLLM's and llama-server's field: ``{"enable_thinking": false}``
    for Qwen3) checked against the variables the model's template reads, and the request's
    reasoning as they leave it: the template's reasoning switch, set here, decides it."""
    kwargs = field(body, "chat_template_kwargs", dict, default={})
    if not kwargs:
        return {}, reasoning
    template = view.template
    reads = template.reads - SERVER_VARIABLES if template is not None else frozenset()
    for key in sorted(kwargs):
        param = f"chat_template_kwargs.{key}"
        if key in SERVER_VARIABLES:
            raise InvalidRequestError(f"'{param}' is a variable the server sets itself "
                                      f"({', '.join(sorted(SERVER_VARIABLES))}); it cannot come from a request",
                                      param=param)
        if key not in reads:
            raise InvalidRequestError(
                f"'{param}': the model's chat template never reads {key!r}; it reads "
                + (", ".join(sorted(reads)) if reads else "no variable a request may set"), param=param)
    switch = view.convention.reasoning_switch
    if isinstance(kwargs.get(switch), bool):
        reasoning = kwargs[switch] and view.has_reasoning_channel
    return kwargs, reasoning


def openai_sampling(body: dict[str, Any], view: ModelView, logprobs: bool, top_logprobs: int) -> SamplingParams:
    """The sampling fields OpenAI's Chat Completions and text completions share (and the
    extensions both take: top_k, min_p, repetition_penalty); those the body leaves out take
    the model's defaults (its MODEL_CARD's, shared.sampling_params.SamplingDefaults)."""
    return view.card.sampling.params(
        temperature=number_in(body, "temperature", 0, 2),
        top_p=number_in(body, "top_p", 0, 1),
        top_k=number_in(body, "top_k", 0, 1 << 20, integer=True),
        min_p=number_in(body, "min_p", 0, 1),
        seed=field(body, "seed", int),
        presence_penalty=number_in(body, "presence_penalty", -2, 2, default=0.0),
        frequency_penalty=number_in(body, "frequency_penalty", -2, 2, default=0.0),
        repetition_penalty=number_in(body, "repetition_penalty", 0.01, 10),
        logit_bias=logit_bias_field(body, view), logprobs=logprobs, top_logprobs=top_logprobs)


def logit_bias_field(body: dict[str, Any], view: ModelView) -> dict[int, float]:
    """OpenAI's ``logit_bias``: token id (as a string) -> a bias from -100 to 100."""
    bias: dict[int, float] = {}
    for key, value in field(body, "logit_bias", dict, default={}).items():
        if not (key.isascii() and key.isdigit() and len(key) <= 9 and int(key) < view.tokenizer.vocab_size):
            raise InvalidRequestError(f"'logit_bias' keys must be token ids of this model (0 to "
                                      f"{view.tokenizer.vocab_size - 1}), got {key[:40]!r}", param="logit_bias")
        check_type(value, float, f"logit_bias.{key}")
        if not -100 <= value <= 100:
            raise InvalidRequestError(f"'logit_bias.{key}' must be between -100 and 100", param="logit_bias")
        bias[int(key)] = float(value)
    return bias


def stop_list(value: Any, param: str, limit: int = 16) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    check_type(value, list, param)
    if len(value) > limit:
        raise InvalidRequestError(f"'{param}' takes at most {limit} sequences, got {len(value)}", param=param)
    for i, item in enumerate(value):
        check_type(item, str, f"{param}[{i}]")
    return [s for s in value if s]


INT64_MAX = (1 << 63) - 1


def max_tokens_field(body: dict[str, Any], *keys: str, context: int | None = None) -> int | None:
    """The first of ``keys`` the body holds: an integer from 1 up. With ``context`` (the
    OpenAI dialects, whose API refuses a reply length beyond what the model can write), one
    above the model's context budget is a 400; below it, generation caps it at the room the
    prompt leaves (gateway/generation.py). Past 64 bits it is a 400 in every dialect."""
    for key in keys:
        if isinstance(body.get(key), float):  # 1e50 or 16.0: named by its value, not as "a number"
            raise InvalidRequestError(f"'{key}' must be an integer, got {body[key]:g}", param=key)
        value = field(body, key, int)
        if value is None:
            continue
        if value < 1:
            raise InvalidRequestError(f"'{key}' must be at least 1, got {value}", param=key)
        if context is not None and value > context:
            raise InvalidRequestError(
                f"'{key}' is {_shown(value)}; this model's context is {context} tokens, prompt and reply "
                f"together, so a reply has at most {context}", param=key, code="invalid_value")
        if value > INT64_MAX:
            raise InvalidRequestError(f"'{key}' is {_shown(value)}, beyond the 64-bit integers this server "
                                      f"takes; a reply stops at the end of the context anyway", param=key)
        return value
    return None


def _shown(value: int) -> str:
    digits = str(value)
    return digits if len(digits) <= 24 else f"a number of {len(digits)} digits"


def logprob_entries(items: list[TokenLogprob]) -> list[dict[str, Any]]:
    """OpenAI's logprobs entries (Chat and Responses share the shape)."""
    return [{"token": item.token, "logprob": item.logprob, "bytes": item.bytes,
             "top_logprobs": [{"token": t, "logprob": lp, "bytes": b} for t, lp, b in item.top]}
            for item in items]


# --- constrained output ---------------------------------------------------------------------

GRAMMAR_FIELD = "grammar"  # this server's extension, the same in every dialect (docs/API.md)
GRAMMAR_SYNTAXES = ("regex", "lark")


def grammar_extension(body: dict[str, Any]) -> dict[str, str] | None:
    """The top-level ``grammar`` extension, ``{"type": "regex" | "lark", "definition": text}``, as
    the worker's grammar; whether it compiles is the worker's check (a 400 before any token)."""
    value = field(body, GRAMMAR_FIELD, dict)
    if value is None:
        return None
    syntax = field(value, "type", str, GRAMMAR_FIELD, required=True)
    if syntax not in GRAMMAR_SYNTAXES:
        raise InvalidRequestError(f"'{GRAMMAR_FIELD}.type' must be one of {', '.join(GRAMMAR_SYNTAXES)}, "
                                  f"got {syntax!r}", param=f"{GRAMMAR_FIELD}.type")
    return {"kind": syntax, "source": field(value, "definition", str, GRAMMAR_FIELD, required=True)}


def json_format_grammar(kind: str, schema: Any, param: str) -> dict[str, str] | None:
    """A JSON output format (``json_object`` or ``json_schema`` with its schema) as the worker's
    grammar; ``text`` is no constraint at all."""
    if kind == "text":
        return None
    if kind == "json_object":
        return {"kind": "json_object", "source": ""}
    if kind != "json_schema":
        raise InvalidRequestError(f"'{param}.type' must be text, json_object or json_schema, got {kind!r}",
                                  param=f"{param}.type")
    check_type(schema, dict, f"{param}.schema")
    return {"kind": "json_schema", "source": json.dumps(schema)}


def one_constraint(*candidates: tuple[str, dict[str, str] | None]) -> dict[str, str] | None:
    """The reply's one grammar: two fields that each constrain it cannot both hold."""
    given = [(name, grammar) for name, grammar in candidates if grammar is not None]
    if len(given) > 1:
        raise InvalidRequestError(f"'{given[0][0]}' and '{given[1][0]}' both constrain the reply's format; "
                                  f"send one of them", param=given[1][0])
    return given[0][1] if given else None


def openai_tool_choice(choice: Any, parallel: bool = True) -> ToolChoice:
    """An OpenAI tool_choice, in Chat's shapes or Responses', as the neutral one: "none",
    "required", a function (``{type: function, function: {name}}`` or ``{type: function, name}``),
    a freeform tool (``{type: custom, name}``) or allowed tools (Chat nests their mode and list
    under ``allowed_tools``, Responses keeps them flat). Any other value leaves the model free."""
    if isinstance(choice, str):
        return ToolChoice({"none": NONE, "required": REQUIRED}.get(choice, AUTO), parallel=parallel)
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "allowed_tools":
        nested = choice.get("allowed_tools")
        allowed = nested if isinstance(nested, dict) else choice
        if allowed.get("mode") != "required":
            return ToolChoice(parallel=parallel)
        names = tuple(entry.get("name") or (entry.get("function") or {}).get("name")
                      for entry in allowed.get("tools") or [] if isinstance(entry, dict))
        return ToolChoice(REQUIRED, names, parallel=parallel)
    if kind in ("function", "tool"):
        function = choice.get("function")
        return ToolChoice(NAMED, (choice.get("name") or (function.get("name") if isinstance(function, dict) else None),),
                          parallel=parallel)
    if kind == "custom":
        return ToolChoice(NAMED, (choice.get("name"),), CUSTOM, parallel)
    return ToolChoice(REQUIRED if kind == "any" else AUTO, parallel=parallel)
