"""One request's path through the gateway: prompt ids out, neutral events back.

Renders and tokenizes the prompt, asks the worker, and turns its token stream into text:
incremental detokenization, the reasoning split (the model's convention's splitter,
shared/conventions/), stop strings (which end the request in the worker at once), tool calls
(gateway/tool_calls.py), logprobs, and keep-alive pings while nothing new arrives (a long
prefill).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

from gateway import tool_calls
from gateway.neutral import (
    Event,
    Finish,
    LogprobsDelta,
    NeutralRequest,
    Placement,
    Ping,
    PromptLogprobs,
    ReasoningDelta,
    Started,
    TextDelta,
    TokenLogprob,
    ToolCallEnd,
    Usage,
)
from gateway.flags import PING_INTERVAL
from gateway.prompting import ModelView
from gateway.stop_strings import StopStringMatcher
from gateway.worker_pool import WorkerPool, affinity_key
from shared.errors import ShuttingDownError, WorkerUnavailableError
from shared.conventions.reasoning import Splitter
from shared.protocol import Accepted, Finished, FinishReason, Generate, Grammar, Tokens

# The gateway's own aborts (a stop string, a client gone) end the reply before the worker's
# FINISHED arrives, so an abort the worker reports is one this reply did not ask for: a cut.
WORKER_REASONS = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.CONTEXT: "context",
                  FinishReason.ERROR: "error", FinishReason.ABORT: "error"}


def prepare(view: ModelView, request: NeutralRequest) -> tuple[tool_calls.ToolPlan, list[int]]:
    """How the request's tools are handled and the prompt ids that follow: what a generation
    runs, and what the token counting endpoints count."""
    tools = tool_calls.plan(view, request)
    if request.prompt is not None:
        return tools, view.text_prompt_ids(request.prompt, request.suffix)
    return tools, view.prompt_ids(tools.prompt_messages(request.messages), tools.declared, request.reasoning,
                                  request.prefill, request.reasoning_effort, request.template_kwargs)


@dataclass(frozen=True)
class ReplyLimits:
    """The server's limits on every reply (--max-request-seconds, --max-output-tokens; 0: none)."""
    max_seconds: float = 0.0  # from the worker's acceptance on, the reply is cut with a length finish
    max_output_tokens: int = 0  # a request's max tokens is capped to it; one that names none gets it


# An effort word -> (tokens, share of the reply's max tokens): the reasoning budget is the smaller,
# so a reply whose thinking is cut still has room for its answer. Other words (xhigh, max,
# default) set no budget; none and minimal turn reasoning off.
EFFORT_BUDGETS = {"low": (1024, 0.25), "medium": (4096, 0.5), "high": (16384, 0.75)}


def reasoning_budget(request: NeutralRequest, max_tokens: int) -> int | None:
    """The most reasoning tokens the reply may write: Anthropic's thinking.budget_tokens as it
    is, else the effort's budget (EFFORT_BUDGETS); None without reasoning or a budget."""
    if not request.reasoning:
        return None
    if request.reasoning_budget is not None:
        return request.reasoning_budget
    if request.reasoning_effort not in EFFORT_BUDGETS:
        return None
    tokens, share = EFFORT_BUDGETS[request.reasoning_effort]
    return max(1, min(tokens, int(max_tokens * share)))


QUERY_TOKENS = 512  # of a message, what a fleet's retrieval reads at most (its last ones)


def _retrieval(view: ModelView, request: NeutralRequest, prompt: list[int]) -> dict:
    """For a worker serving a fleet: the conversation's key, under which its choice of
    cartridges is kept, and the ids of its last user message, which make the choice (a text
    completion's: its prompt's last ids)."""
    last = next((m.get("content") for m in reversed(request.messages)
                 if m.get("role") == "user" and isinstance(m.get("content"), str) and m.get("content")), None)
    query = (view.tokenizer.encode(last, add_special=False, parse_special=False) if last is not None
             else [] if request.messages else prompt)
    return {"conversation": affinity_key(request, prompt), "query": query[-QUERY_TOKENS:]}


async def generate(view: ModelView, workers: WorkerPool, request: NeutralRequest,
                   prepared: tuple[tool_calls.ToolPlan, list[int]], ping_interval: float = PING_INTERVAL,
                   cut: asyncio.Event | None = None, limits: ReplyLimits = ReplyLimits()) -> AsyncIterator[Event]:
    """Yield Started, then content events and Pings, then one Finish.

    Errors raised before Started (busy, rejected, prompt too long, worker down) come out as
    exceptions, so the caller can still answer with an HTTP error status. When ``cut`` is set
    (the gateway's drain timeout ran out) the reply ends with ShuttingDownError, which each
    dialect renders as its own error event, and the worker is told to stop. ``limits`` cut a
    reply as its max tokens would (a length finish, usage.truncated saying which limit).
    """
    tools, prompt = prepared  # prepare(view, request), done off the event loop by the caller
    view.check_fits(len(prompt))
    room = view.context_budget - len(prompt)
    max_tokens = min(request.max_tokens, room) if request.max_tokens else room
    capped = 0 < limits.max_output_tokens < max_tokens
    if capped:
        max_tokens = limits.max_output_tokens
    if request.max_tokens == 0 and request.prompt_logprobs is not None:
        max_tokens = 0  # the prompt scored, nothing generated
    convention = view.convention
    chat = request.prompt is None
    # A forced call's grammar, or the format the client asked for (plan refuses both at once).
    grammar = tools.grammar or request.grammar
    # A convention's forced call grammar may hold the whole reply, its reasoning included
    after_reasoning = request.grammar_after_reasoning and not (convention.grammar_holds_reasoning
                                                               and tools.grammar is not None)
    worker_request = Generate(workers.new_request_id(), prompt, request.sampling, max_tokens,
                              grammar=Grammar(**grammar) if grammar is not None else None,
                              grammar_after_reasoning=grammar is not None and after_reasoning,
                              cache_hint=request.cache_hint, stop_ids=[] if request.ignore_eos else None,
                              cartridge_ids=list(request.cartridges), namespace=request.tenant,
                              speculate=request.speculate,
                              reasoning_budget=reasoning_budget(request, max_tokens) if chat else None,
                              **(_retrieval(view, request, prompt) if view.card.capabilities.fleet else {}),
                              prompt_logprobs=-1 if request.prompt_logprobs is None else request.prompt_logprobs)
    tokenizer = view.tokenizer
    # a convention whose markers are control tokens keeps them in the text, for its splitter
    decoder = tokenizer.incremental_decoder(skip_special=True,
                                            keep=convention.kept_ids(tokenizer) if chat else frozenset())
    reply = ReplyText(
        # A text completion is continued as it is; otherwise, when reasoning is on, a template
        # may open the reasoning block in the prompt already.
        convention.splitter(
            starts_inside=lambda: (request.prefill == "" and _prompt_opens_reasoning(view)
                                   if view.has_reasoning_channel and request.reasoning else False),
            model_calls=view.tool_call_tags is not None, reads_calls=tools.reads_blocks,
            prefilled=request.prefill != "") if chat else PlainText(),
        StopStringMatcher(request.stop),
        tools.parser())
    usage = Usage(prompt_tokens=len(prompt))
    reasoning_tokens = 0
    placement = Placement()
    stream = workers.generate(worker_request, affinity_key(request, prompt), placement)
    pending: asyncio.Task | None = None
    cutting = asyncio.ensure_future(cut.wait()) if cut is not None else None
    loop = asyncio.get_running_loop()
    deadline: float | None = None  # set when the worker accepts: --max-request-seconds from then
    try:
        pending = asyncio.ensure_future(stream.__anext__())
        while True:
            if deadline is not None and loop.time() >= deadline:
                for event in reply.push(decoder.flush()) + reply.finish():
                    yield event
                usage.reasoning_tokens, usage.truncated = reasoning_tokens, "deadline"
                yield Finish("length", usage)  # closing the worker stream (finally) sends ABORT
                return
            waiting = {pending} if cutting is None else {pending, cutting}
            wait = ping_interval if deadline is None else max(0.0, min(ping_interval, deadline - loop.time()))
            done, _ = await asyncio.wait(waiting, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
            if pending not in done and cutting in done:
                raise ShuttingDownError("the server is shutting down and its drain timeout has passed: "
                                        "this reply was cut; send the request again")
            if not done and deadline is not None and loop.time() >= deadline:
                continue
            if not done:
                yield Ping()
                continue
            try:
                message = pending.result()
            except StopAsyncIteration:
                raise WorkerUnavailableError("the worker ended the stream without finishing it")
            pending = None
            if isinstance(message, Accepted):
                usage.cartridges = list(message.cartridges)
                if limits.max_seconds:
                    deadline = loop.time() + limits.max_seconds
                yield Started(len(prompt), placement, list(message.cartridges))
            elif isinstance(message, Tokens):
                if message.cached_tokens is not None:
                    usage.cached_tokens = message.cached_tokens
                if message.prompt_logprobs is not None:
                    yield PromptLogprobs(_prompt_logprob_items(tokenizer, prompt, message.prompt_logprobs))
                    if not message.ids:
                        pending = asyncio.ensure_future(stream.__anext__())
                        continue
                usage.completion_tokens += len(message.ids)
                if reply.splitter.inside:
                    reasoning_tokens += len(message.ids)
                if request.sampling.logprobs or request.sampling.top_logprobs:
                    yield LogprobsDelta(_logprob_items(tokenizer, message))
                for event in reply.push(decoder.push_many(message.ids)):
                    yield event
                if reply.ended:
                    # A stop string, or the one call allowed without parallel calls: the reply
                    # ends here, and closing the worker stream (finally) sends ABORT.
                    usage.reasoning_tokens = reasoning_tokens
                    fired = reply.stops.fired
                    yield Finish(reply.reason("stop_sequence" if fired is not None else "stop"), usage,
                                 stop_sequence=fired)
                    return
            elif isinstance(message, Finished):
                for event in reply.push(decoder.flush()) + reply.finish():
                    yield event
                usage.cached_tokens = message.cached_tokens
                usage.prompt_tokens = message.prompt_tokens or usage.prompt_tokens
                usage.completion_tokens = message.completion_tokens
                usage.reasoning_tokens = reasoning_tokens
                usage.drafted_tokens, usage.accepted_tokens = message.drafted_tokens, message.accepted_tokens
                reason = WORKER_REASONS.get(message.reason, "error")
                if capped and message.reason == FinishReason.LENGTH:
                    usage.truncated = "max_output_tokens"
                error = message.error
                if message.reason == FinishReason.ABORT:
                    error = f"the worker cut this reply before it finished: {error or 'aborted'}"
                yield Finish(reason if reason == "error" else reply.reason(reason), usage, error=error)
                return
            pending = asyncio.ensure_future(stream.__anext__())
    finally:
        if cutting is not None:
            cutting.cancel()
        # Closing the worker stream sends ABORT. A task still waiting on it is cancelled (which
        # closes it); otherwise close it here. Neither step suspends, so this also completes
        # while our caller is being cancelled because the client went away.
        if pending is not None and not pending.done():
            pending.cancel()
        else:
            await stream.aclose()


def _prompt_opens_reasoning(view: ModelView) -> bool:
    # Some templates (Qwen3-2507 thinking and later) write <think> into the generation prompt,
    # so the reply starts inside the block. A one-message conversation is enough to see it.
    probe = view.render([{"role": "user", "content": "?"}], reasoning=True)
    return probe.rstrip().endswith(view.reasoning_tags.open)


class PlainText:
    """The splitter of a text completion: everything is content."""

    inside = False

    def push(self, text: str) -> list[TextDelta | ReasoningDelta]:
        return [TextDelta(text)] if text else []

    def flush(self) -> list[TextDelta | ReasoningDelta]:
        return []


class ReplyText:
    """The reply's text on its way to events: the reasoning split, then stop strings on what is
    not reasoning, then tool-call parsing on what the stop strings release.

    Never an empty success: a reply the model wrote something in that shows nothing (markers
    alone, an empty reasoning block, a call block that reads as nothing) ends with the text the
    model wrote, as text. A stop string that fired at once is the exception: it asked for
    nothing to be shown."""

    def __init__(self, splitter: Splitter,
                 stops: StopStringMatcher, parser: tool_calls.ToolCallParser | tool_calls.WholeReplyCall | None):
        self.splitter = splitter
        self.stops = stops
        self.parser = parser
        self.written: list[str] = []  # the reply's text as decoded, markers it keeps included
        self.shown = False  # text, reasoning or a finished call has come out

    @property
    def ended(self) -> bool:
        """Nothing more may be shown: a stop string fired, or the calls allowed are all made."""
        return self.stops.fired is not None or (self.parser is not None and self.parser.done)

    def push(self, text: str) -> list[Event]:
        self.written.append(text)
        out: list[Event] = []
        for piece in self.splitter.push(text):
            if self.ended:
                break
            out += self._piece(piece)
        return self._seen(out)

    def finish(self) -> list[Event]:
        """The reply is over: release what every stage held back."""
        out: list[Event] = []
        for piece in self.splitter.flush():
            if not self.ended:
                out += self._piece(piece)
        if not self.ended:
            out += self._content(self.stops.flush())
            if self.parser is not None:
                out += self.parser.flush()
        self._seen(out)
        written = "".join(self.written)
        if not self.shown and self.stops.fired is None and written.strip():
            out.append(TextDelta(written))
            self.shown = True
        return out

    def _seen(self, events: list[Event]) -> list[Event]:
        self.shown = self.shown or any(
            isinstance(event, ToolCallEnd) or (isinstance(event, (TextDelta, ReasoningDelta)) and event.text.strip())
            for event in events)
        return events

    def reason(self, reason: str) -> str:
        """A reply that made calls ended to have them run, unless it was cut short."""
        made_calls = self.parser is not None and self.parser.completed > 0
        return "tool_calls" if made_calls and reason in ("stop", "stop_sequence") else reason

    def _piece(self, piece: TextDelta | ReasoningDelta) -> list[Event]:
        if isinstance(piece, ReasoningDelta):
            return [piece]
        out = self._content(self.stops.push(piece.text))
        if self.stops.fired is not None and self.parser is not None:
            out += self.parser.flush()  # no more text will come: a call still open is text
        return out

    def _content(self, text: str) -> list[Event]:
        if not text:
            return []
        if self.parser is None:
            return [TextDelta(text)]
        return list(self.parser.push(text))


def _prompt_logprob_items(tokenizer, prompt: list[int], scores: list[list]) -> list[TokenLogprob]:
    """The prompt's tokens with their scores. Each token's text is what it adds to the prompt
    decoded as a whole (control tokens none, a token ending inside a character none until the
    character is whole), so the texts join into the echoed prompt and their offsets fall on it."""
    decoder = tokenizer.incremental_decoder(skip_special=True)
    items = []
    for token_id, (logprob, top) in zip(prompt, scores):
        alternatives = []
        for alt, alt_logprob in top:
            raw = tokenizer.token_bytes(int(alt))
            alternatives.append((raw.decode("utf-8", errors="replace"), float(alt_logprob), list(raw)))
        items.append(TokenLogprob(decoder.push(token_id), logprob, list(tokenizer.token_bytes(token_id)),
                                  alternatives))
    if items:
        items[-1].token += decoder.flush()
    return items


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
        self.prompt_logprobs: list[TokenLogprob] | None = None
        self.calls: list[ToolCallEnd] = []
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
        elif isinstance(event, PromptLogprobs):
            self.prompt_logprobs = event.items
        elif isinstance(event, ToolCallEnd):
            self.calls.append(event)
        elif isinstance(event, Started):
            self.prompt_tokens = event.prompt_tokens
        elif isinstance(event, Finish):
            self.finish = event
