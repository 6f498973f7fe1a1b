"""One request's path through the gateway: prompt ids out, neutral events back.

Renders and tokenizes the prompt, asks the worker, and turns its token stream into text:
incremental detokenization, the reasoning split, stop strings (which end the request in the
worker at once), logprobs, and keep-alive pings while nothing new arrives (a long prefill).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from gateway.neutral import (
    Event,
    Finish,
    LogprobsDelta,
    NeutralRequest,
    Ping,
    ReasoningDelta,
    Started,
    TextDelta,
    TokenLogprob,
    Usage,
)
from gateway.prompting import THINK_CLOSE, THINK_OPEN, ModelView
from gateway.stop_strings import StopStringMatcher
from shared.errors import WorkerUnavailableError
from shared.protocol import Accepted, Finished, Generate, Tokens
from shared.worker_client import WorkerClient

WORKER_REASONS = {"stop": "stop", "length": "length", "context": "context", "error": "error",
                  "abort": "stop_sequence"}


class ReasoningSplitter:
    """Routes text between ``<think>`` and ``</think>`` to reasoning, the rest to content."""

    def __init__(self, inside: bool = False):
        self.inside = inside
        self.held = ""
        self.closed_once = False

    def push(self, text: str) -> list[TextDelta | ReasoningDelta]:
        out: list[TextDelta | ReasoningDelta] = []
        buffer = self.held + text
        self.held = ""
        while buffer:
            tag = THINK_CLOSE if self.inside else THINK_OPEN
            position = buffer.find(tag)
            if position == -1:
                keep = next((n for n in range(min(len(tag) - 1, len(buffer)), 0, -1)
                             if tag.startswith(buffer[-n:])), 0)
                emit, self.held = buffer[:len(buffer) - keep], buffer[len(buffer) - keep:]
                buffer = ""
            else:
                emit, buffer = buffer[:position], buffer[position + len(tag):]
            if emit:
                if not self.inside and self.closed_once and not out:
                    emit = emit.lstrip("\n")  # the blank line a model puts after </think>
                if emit:
                    out.append(ReasoningDelta(emit) if self.inside else TextDelta(emit))
            if position != -1:
                if self.inside:
                    self.closed_once = True
                self.inside = not self.inside
        return out

    def flush(self) -> list[TextDelta | ReasoningDelta]:
        held, self.held = self.held, ""
        if not held:
            return []
        return [ReasoningDelta(held) if self.inside else TextDelta(held)]


async def generate(view: ModelView, client: WorkerClient, request: NeutralRequest,
                   ping_interval: float = 10.0) -> AsyncIterator[Event]:
    """Yield Started, then content events and Pings, then one Finish.

    Errors raised before Started (busy, rejected, prompt too long, worker down) come out as
    exceptions, so the caller can still answer with an HTTP error status.
    """
    prompt = view.prompt_ids(request.messages, request.tools, request.reasoning, request.prefill)
    view.check_fits(len(prompt))
    room = view.context_budget - len(prompt)
    max_tokens = min(request.max_tokens, room) if request.max_tokens else room
    worker_request = Generate(client.new_request_id(), prompt, request.sampling.to_wire(), max_tokens,
                              cache_hint=request.cache_hint)
    tokenizer = view.tokenizer
    decoder = tokenizer.incremental_decoder(skip_special=True)
    # When reasoning is on, a template may open the think block in the prompt already.
    splitter = ReasoningSplitter(inside=request.reasoning and request.prefill == ""
                                 and view.render([], reasoning=True).rstrip().endswith(THINK_OPEN)
                                 if view.has_reasoning_channel and request.reasoning else False)
    stops = StopStringMatcher(request.stop)
    usage = Usage(prompt_tokens=len(prompt))
    reasoning_tokens = 0
    stream = client.generate(worker_request)
    pending: asyncio.Task | None = None
    try:
        pending = asyncio.ensure_future(stream.__anext__())
        while True:
            done, _ = await asyncio.wait({pending}, timeout=ping_interval)
            if not done:
                yield Ping()
                continue
            try:
                message = pending.result()
            except StopAsyncIteration:
                raise WorkerUnavailableError("the worker ended the stream without finishing it")
            pending = None
            if isinstance(message, Accepted):
                yield Started(len(prompt))
            elif isinstance(message, Tokens):
                if message.cached_tokens is not None:
                    usage.cached_tokens = message.cached_tokens
                usage.completion_tokens += len(message.ids)
                if splitter.inside:
                    reasoning_tokens += len(message.ids)
                if request.sampling.logprobs or request.sampling.top_logprobs:
                    yield LogprobsDelta(_logprob_items(tokenizer, message))
                text = decoder.push_many(message.ids)
                for event in _route(splitter, stops, text):
                    yield event
                if stops.fired is not None:
                    usage.reasoning_tokens = reasoning_tokens
                    yield Finish("stop_sequence", usage, stop_sequence=stops.fired)
                    return  # closing the worker stream sends ABORT
            elif isinstance(message, Finished):
                for event in _route(splitter, stops, decoder.flush(), final=True):
                    yield event
                usage.cached_tokens = message.cached_tokens
                usage.prompt_tokens = message.prompt_tokens or usage.prompt_tokens
                usage.completion_tokens = message.completion_tokens
                usage.reasoning_tokens = reasoning_tokens
                yield Finish(WORKER_REASONS.get(message.reason, "error"), usage, error=message.error)
                return
            pending = asyncio.ensure_future(stream.__anext__())
    finally:
        # Closing the worker stream sends ABORT. A task still waiting on it is cancelled (which
        # closes it); otherwise close it here. Neither step suspends, so this also completes
        # while our caller is being cancelled because the client went away.
        if pending is not None and not pending.done():
            pending.cancel()
        else:
            await stream.aclose()


def _route(splitter: ReasoningSplitter, stops: StopStringMatcher, text: str, final: bool = False):
    pieces = splitter.push(text) + (splitter.flush() if final else [])
    for piece in pieces:
        if isinstance(piece, TextDelta):
            released = stops.push(piece.text)
            if final:
                released += stops.flush()
            if released:
                yield TextDelta(released)
            if stops.fired is not None:
                return
        else:
            yield piece
    if final and not pieces:
        tail = stops.flush()
        if tail:
            yield TextDelta(tail)


def _logprob_items(tokenizer, message: Tokens) -> list[TokenLogprob]:
    items = []
    for position, token_id in enumerate(message.ids):
        raw = tokenizer.token_bytes(token_id)
        top = []
        if message.top_logprobs:
            for alt_id, alt_logprob in message.top_logprobs[position]:
                alt_raw = tokenizer.token_bytes(int(alt_id))
                top.append((alt_raw.decode("utf-8", errors="replace"), float(alt_logprob), list(alt_raw)))
        logprob = message.logprobs[position] if message.logprobs else 0.0
        items.append(TokenLogprob(raw.decode("utf-8", errors="replace"), logprob, list(raw), top))
    return items


class Completion:
    """A whole (non-streamed) answer gathered from the events."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.reasoning: list[str] = []
        self.logprobs: list[TokenLogprob] = []
        self.prompt_tokens = 0
        self.finish: Finish | None = None

    @property
    def content(self) -> str:
        return "".join(self.text)

    @property
    def reasoning_text(self) -> str:
        return "".join(self.reasoning)

    def add(self, event: Event) -> None:
        if isinstance(event, TextDelta):
            self.text.append(event.text)
        elif isinstance(event, ReasoningDelta):
            self.reasoning.append(event.text)
        elif isinstance(event, LogprobsDelta):
            self.logprobs.extend(event.items)
        elif isinstance(event, Started):
            self.prompt_tokens = event.prompt_tokens
        elif isinstance(event, Finish):
            self.finish = event


async def collect(events: AsyncIterator[Event]) -> Completion:
    completion = Completion()
    async for event in events:
        completion.add(event)
    if completion.finish is None:
        raise WorkerUnavailableError("the answer ended without a finish")
    return completion
