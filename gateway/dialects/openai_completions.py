"""OpenAI text completions (``POST /v1/completions``, the API before chat): a prompt continued as
it is, with no template, so base models (Gemma 3 270M) are served and benchmark clients that
send raw prompts are answered.

One prompt and one choice per request (``n`` and ``best_of`` 1). ``logprobs`` is the legacy
integer (0 to 5 alternatives) and comes back in the legacy shape (tokens, token_logprobs,
top_logprobs, text_offset). ``echo`` puts the prompt's text before the completion; with
``logprobs`` too, the prompt's tokens are scored and come first in the logprobs (the first one's
logprob null), and ``max_tokens: 0`` scores a text without continuing it (how evaluation
harnesses ask for log-likelihoods). ``suffix``
makes the request a fill-in-the-middle one (``ModelView.text_prompt_ids`` lays it out): the
completion is the text between the prompt and the suffix. It needs a model whose vocabulary has
the FIM tokens (``Tokenizer.fim_ids``); elsewhere it is refused rather than ignored.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from gateway import sse
from gateway.dialects import COMPLETIONS
from gateway.dialects.common import (
    grammar_extension,
    max_tokens_field,
    new_id,
    openai_sampling,
    stop_list,
)
from gateway.errors import sse_error_payload
from gateway.generation import Completion
from gateway.neutral import (
    Event,
    Finish,
    LogprobsDelta,
    NeutralRequest,
    Ping,
    PromptLogprobs,
    TextDelta,
    TokenLogprob,
    Usage,
    usage_extras,
)
from gateway.prompting import ModelView
from gateway.request_fields import cartridges_field, speculation_field, check_type, field, number_in, unknown_fields
from shared.errors import InvalidRequestError, LmserveError

HONORED = {
    "cartridges",
    "speculation",
    "model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "logprobs", "n",
    "best_of", "stream", "stream_options", "echo", "suffix", "ignore_eos", "grammar",
}
IGNORED = {"user", "metadata"}
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for this endpoint
FINISH_REASONS = {"stop": "stop", "stop_sequence": "stop", "length": "length", "context": "length"}


@dataclass(frozen=True)
class CompletionsEcho:
    prompt_text: str | None  # echo: the prompt's text, put before the completion
    logprobs: int | None  # the legacy integer: None for no logprobs
    include_usage: bool = False


def parse(body: dict[str, Any], view: ModelView, headers: Any) -> NeutralRequest:
    unknown_fields(body, HONORED | IGNORED)
    for key in ("n", "best_of"):
        if field(body, key, int, default=1) != 1:
            raise InvalidRequestError(f"'{key}' must be 1: this server returns one completion per request", param=key)
    suffix = field(body, "suffix", str)
    if view.tokenizer.fim_ids is None:
        if suffix:
            raise InvalidRequestError("'suffix' (fill-in-the-middle) needs a model with FIM tokens, and this one "
                                      "has none", param="suffix")
        suffix = None  # an empty one asks for nothing
    prompt = _prompt(body.get("prompt"))
    logprobs = number_in(body, "logprobs", 0, 5, integer=True, default=None)
    echo = bool(field(body, "echo", bool, default=False))
    stream_options = field(body, "stream_options", dict, default={})
    sampling = openai_sampling(body, view, logprobs is not None, logprobs or 0)
    # max_tokens 0 with echo: the prompt alone, scored (its logprobs computed either way)
    scoring_only = echo and field(body, "max_tokens", int) == 0
    max_tokens = 0 if scoring_only else max_tokens_field(body, "max_tokens", context=view.context_budget)
    return NeutralRequest(
        dialect=COMPLETIONS,
        model=field(body, "model", str, default=view.model_id),
        messages=[],
        prompt=prompt,
        suffix=suffix,
        max_tokens=DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
        sampling=sampling,
        stop=stop_list(body.get("stop"), "stop", limit=4),
        stream=bool(field(body, "stream", bool, default=False)),
        ignore_eos=bool(field(body, "ignore_eos", bool, default=False)),
        cartridges=cartridges_field(body),
        speculate=speculation_field(body),
        grammar=grammar_extension(body),
        prompt_logprobs=(logprobs or 0) if echo and (logprobs is not None or scoring_only) else None,
        echo=CompletionsEcho(
            (prompt if isinstance(prompt, str) else view.tokenizer.decode(prompt, skip_special=True)) if echo else None,
            logprobs, bool(field(stream_options, "include_usage", bool, "stream_options", default=False))),
    )


def _prompt(value: Any) -> str | list[int]:
    """A string, a list of token ids, or a list holding one of either."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    if isinstance(value, str):
        return value
    check_type(value, list, "prompt")
    if value and all(isinstance(v, str) for v in value):
        raise InvalidRequestError(f"'prompt' holds {len(value)} prompts; this server completes one per request",
                                  param="prompt")
    for i, token in enumerate(value):
        check_type(token, int, f"prompt[{i}]")
    return value


def _echo(request: NeutralRequest) -> CompletionsEcho:
    assert isinstance(request.echo, CompletionsEcho)
    return request.echo


def _usage(usage: Usage) -> dict[str, Any]:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}, **usage_extras(usage)}


def _legacy_logprobs(items: list[TokenLogprob], offset: int) -> dict[str, Any]:
    """The pre-chat shape: parallel lists, and each position's alternatives as {token: logprob}
    (null for a prompt's first token, which has no logprob)."""
    offsets = []
    for item in items:
        offsets.append(offset)
        offset += len(item.token)
    return {"tokens": [item.token for item in items], "token_logprobs": [item.logprob for item in items],
            "top_logprobs": [None if item.logprob is None else {token: logprob for token, logprob, _ in item.top}
                             for item in items],
            "text_offset": offsets}


def render(request: NeutralRequest, view: ModelView, completion: Completion) -> dict[str, Any]:
    finish = completion.finish
    assert finish is not None
    echo = _echo(request)
    head = echo.prompt_text or ""
    scored = completion.prompt_logprobs
    if scored is not None:  # the echo is the scored tokens' text, so the offsets fall on it
        head = "".join(item.token for item in scored)
    logprobs = None
    if echo.logprobs is not None:
        logprobs = _legacy_logprobs((scored or []) + completion.logprobs, 0 if scored is not None else len(head))
    return {"id": new_id("cmpl-"), "object": "text_completion", "created": int(time.time()),
            "model": request.model, "system_fingerprint": view.card.fingerprint[:16],
            "choices": [{"text": head + completion.content, "index": 0, "logprobs": logprobs,
                         "finish_reason": FINISH_REASONS.get(finish.reason, "stop")}],
            "usage": _usage(finish.usage)}


async def stream(request: NeutralRequest, view: ModelView, events: AsyncIterator[Event]) -> AsyncIterator[bytes]:
    echo = _echo(request)
    base = {"id": new_id("cmpl-"), "object": "text_completion", "created": int(time.time()),
            "model": request.model, "system_fingerprint": view.card.fingerprint[:16]}
    offset = 0

    def chunk(text: str, finish_reason: str | None = None, logprobs: Any = None) -> bytes:
        return sse.event({**base, "choices": [{"text": text, "index": 0, "logprobs": logprobs,
                                               "finish_reason": finish_reason}]})

    try:
        if echo.prompt_text and request.prompt_logprobs is None:
            yield chunk(echo.prompt_text)
            offset = len(echo.prompt_text)
        async for event in events:
            if isinstance(event, PromptLogprobs):  # the echo, with its tokens' scores
                text = "".join(item.token for item in event.items)
                yield chunk(text, logprobs=_legacy_logprobs(event.items, 0) if echo.logprobs is not None else None)
                offset = len(text)
            elif isinstance(event, TextDelta):
                yield chunk(event.text)
            elif isinstance(event, LogprobsDelta) and echo.logprobs is not None:
                legacy = _legacy_logprobs(event.items, offset)
                offset += sum(len(item.token) for item in event.items)
                yield chunk("", logprobs=legacy)
            elif isinstance(event, Ping):
                yield sse.comment()
            elif isinstance(event, Finish):
                if event.reason == "error":
                    yield sse.event(sse_error_payload(COMPLETIONS, LmserveError(event.error or "generation failed")))
                    return
                yield chunk("", FINISH_REASONS.get(event.reason, "stop"))
                if echo.include_usage:
                    yield sse.event({**base, "choices": [], "usage": _usage(event.usage)})
    except LmserveError as exc:
        yield sse.event(sse_error_payload(COMPLETIONS, exc))
        return
    yield sse.event("[DONE]")

