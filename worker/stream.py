"""One request as the worker runs it: a ``Stream``, opened from a checked GENERATE.

The wire decoder (``shared/protocol.py``) has already checked every field's type; what is
checked here is what only this worker knows: its vocabulary, its context budget, its cartridges,
whether it has grammars, and what a text-diffusion model cannot do.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shared.errors import InvalidRequestError
from shared.protocol import Finished, FinishReason, Generate, Message, PromptLogprob
from shared.sampling_params import SamplingParams
from worker.cartridges.cartridge import Cartridge
from worker.cartridges.choice import CartridgeChoice
from worker.diffusion import CanvasWriter, check_request as check_diffusion
from worker.engine import Engine
from worker.engine.sampling import Sampler
from worker.kv_slots import Slot
from worker.scoring import MAX_PROMPT_ALTERNATIVES
from worker.reasoning_budget import ReasoningBudget
from worker.scripted import ScriptedReplies
from worker.speculation import StreamSpeculation

Send = Callable[[bytes, Message], None]  # a message to a gateway (thread-safe; the server's)


@dataclass
class Stream:
    gateway: bytes
    request: Generate
    params: SamplingParams
    sampler: Sampler
    stop_ids: set[int]
    slot: Slot | None = None
    pending: list[int] = field(default_factory=list)  # prompt tokens not yet in the cache
    next_token: int | None = None  # sampled, sent, not yet fed to the model
    cached: int = 0
    completion: int = 0
    aborted: str | None = None  # why the stream was aborted, once it is
    done: bool = False  # finished: its FINISHED is sent, its slot given back
    matcher: Any = None  # an llguidance matcher when the request carries a grammar
    grammar_active: bool = False  # False while a reasoning block must end first
    # with prompt_logprobs: each prompt token's [logprob, alternatives] so far (None: not asked)
    scores: list[PromptLogprob] | None = None
    cartridge: Cartridge | None = None  # the KV prefix it is served behind
    retrieve: bool = False  # a fleet chooses its cartridge before it is queued
    # on a text-diffusion model: the block being denoised (None while a prompt or block is read)
    writer: CanvasWriter | None = None
    rng: np.random.Generator | None = None  # a text-diffusion stream's canvases and draws
    spec: StreamSpeculation | None = None  # its speculative decoding, once it decodes with drafts
    budget: ReasoningBudget | None = None  # its reasoning budget's count, once it decodes with one

    @property
    def prefix(self) -> int:
        return self.cartridge.tokens if self.cartridge is not None else 0

    @property
    def key(self) -> tuple[bytes, str]:
        return self.gateway, self.request.request_id

    @property
    def held(self) -> list[int]:
        """The tokens its cache holds once its prompt is read: the cartridge's pseudo-ids (if
        any), then the prompt."""
        prompt = self.request.prompt
        return prompt if self.cartridge is None else self.cartridge.pseudo_ids + list(prompt)

    def behind_prefix(self, cached: int) -> int:
        """Tokens its slot holds for it (of ``cached``), once a slot without its cartridge has
        been given the cartridge."""
        return cached if self.cartridge is None else self.cartridge.under(self.slot.cache, cached)

    def finished(self, reason: FinishReason, error: str | None) -> Finished:
        spec = self.spec
        return Finished(self.request.request_id, reason, len(self.request.prompt), self.cached, self.completion,
                        error, spec.drafted if spec else 0, spec.accepted if spec else 0)

    def end_reason(self, stopped: bool, ctx: int) -> FinishReason | None:
        """Why the reply is over (it stopped, reached max_tokens or filled the context), or None."""
        if stopped:
            return FinishReason.STOP
        if self.completion >= self.request.max_tokens:
            return FinishReason.LENGTH
        if self.prefix + len(self.request.prompt) + self.completion >= ctx:
            return FinishReason.CONTEXT
        return None


def open_stream(gateway: bytes, request: Generate, engine: Engine, ctx: int, cartridges: CartridgeChoice,
                grammars: bool, script: ScriptedReplies | None = None) -> Stream:
    """A stream for the request, or InvalidRequestError saying what to change."""
    prompt = request.prompt
    n_vocab = engine.model.hp.n_vocab
    if not prompt:
        raise InvalidRequestError("the prompt is empty: at least one token is needed")
    ids = np.asarray(prompt)
    if ids.min() < 0 or ids.max() >= n_vocab:
        raise InvalidRequestError(f"prompt token ids must lie in 0..{n_vocab - 1}")
    if not -1 <= request.prompt_logprobs <= MAX_PROMPT_ALTERNATIVES:
        raise InvalidRequestError(f"prompt_logprobs must lie in 0..{MAX_PROMPT_ALTERNATIVES} (or -1: none)")
    if engine.model.diffusion:
        check_diffusion(request)
    # a prompt may be scored and nothing generated (how evaluation harnesses score text)
    if request.max_tokens < (0 if request.prompt_logprobs >= 0 else 1):
        raise InvalidRequestError("max_tokens must be at least 1")
    cartridge = cartridges.named(request)
    retrieve = cartridge is None and cartridges.left_to_fleet(request)
    # a fleet's choice is made later, on the engine thread: its largest is what must fit
    prefix = cartridge.tokens if cartridge is not None else cartridges.prefix if retrieve else 0
    room = ctx - prefix
    if len(prompt) >= room:
        held = f", {prefix} of them the cartridge's" if prefix else ""
        raise InvalidRequestError(
            f"prompt is too long: {len(prompt)} tokens > {room - 1} maximum "
            f"(the context budget --ctx is {ctx} tokens{held}, prompt and completion together)")
    if (cartridge is not None or retrieve) and request.prompt_logprobs >= 0:
        raise InvalidRequestError("a prompt is not scored behind a cartridge (prompt_logprobs)")
    if request.reasoning_budget is not None and request.reasoning_budget < 1:
        raise InvalidRequestError("reasoning_budget must be at least 1 token (or none)")
    if request.grammar is not None and not grammars:
        raise InvalidRequestError("constrained decoding (grammar) is not available in this worker")
    params = request.sampling
    stop_ids = set(request.stop_ids) if request.stop_ids is not None else set(engine.tokenizer.stop_ids)
    sampler = script.sampler(params, prompt) if script is not None else Sampler(params, prompt)
    return Stream(gateway, request, params, sampler, stop_ids,
                  scores=[PromptLogprob(None, [])] if request.prompt_logprobs >= 0 else None, cartridge=cartridge,
                  retrieve=retrieve, rng=CanvasWriter.rng_for(params) if engine.model.diffusion else None)


Finish = Callable[[Stream, FinishReason, "str | None"], None]  # end a stream: FINISHED, its slot back
