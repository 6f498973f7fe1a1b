"""Reasoning budgets where tokens are chosen (worker/reasoning_budget.py), the scripted sampler
giving way to a forced close, and the sampling defaults a model file recommends."""

from __future__ import annotations

import numpy as np
import pytest
from gemma4_vocab import gemma4_vocab_metadata
from inkling_vocab import inkling_vocab_metadata

from shared.conventions import gemma4, hermes, inkling, nanochat
from shared.errors import InvalidRequestError
from shared.tokenizer import Tokenizer
from shared.sampling_params import SamplingDefaults, SamplingParams
from worker.model_facts import sampling_defaults
from worker.reasoning_budget import ReasoningBudget, ReasoningMarkers
from worker.scripted import ScriptedReplies, ScriptedReply

OPEN, CLOSE, WORD, OTHER = 7, 8, 1, 2
MARKERS = ReasoningMarkers((OPEN,), (CLOSE,))


def write(budget: ReasoningBudget, tokens: list[int]) -> list[int]:
    """What a stream that would write ``tokens`` (then words) writes under the budget."""
    out = []
    for wanted in tokens:
        token = budget.forced() or wanted
        budget.took(token)
        out.append(token)
    return out


def test_a_block_the_reply_opens_is_closed_at_the_budget_and_the_reply_goes_on():
    budget = ReasoningBudget(MARKERS, 4, prompt=[OTHER, OTHER])
    written = write(budget, [OTHER, OPEN] + [WORD] * 10)
    # the close is the block's fourth token; after it the reply samples freely again
    assert written == [OTHER, OPEN, WORD, WORD, WORD, CLOSE] + [WORD] * 6
    assert not budget.inside and budget.forced() is None


def test_a_prompt_that_opens_the_block_counts_from_the_first_token():
    assert write(ReasoningBudget(MARKERS, 2, prompt=[OTHER, OPEN, WORD]), [WORD] * 4) == [WORD, CLOSE, WORD, WORD]
    # a block the history opened and closed is not open
    assert write(ReasoningBudget(MARKERS, 2, prompt=[OPEN, WORD, CLOSE, OTHER]), [WORD] * 4) == [WORD] * 4


def test_a_block_closed_within_its_budget_is_left_alone_and_a_new_block_counts_afresh():
    budget = ReasoningBudget(MARKERS, 3, prompt=[])
    assert write(budget, [OPEN, WORD, CLOSE, WORD, OPEN, WORD, WORD, WORD, WORD]) == \
        [OPEN, WORD, CLOSE, WORD, OPEN, WORD, WORD, CLOSE, WORD]


def test_a_close_of_several_tokens_is_forced_whole_within_the_budget():
    markers = ReasoningMarkers((OPEN, OTHER), (CLOSE, OTHER))  # Gemma 4's thought channel opens in two tokens
    written = write(ReasoningBudget(markers, 5, prompt=[]), [OPEN, OTHER] + [WORD] * 8)
    assert written == [OPEN, OTHER, WORD, WORD, WORD, CLOSE, OTHER, WORD, WORD, WORD]


def test_markers_are_the_conventions_own_tokens_or_none(qwen_tokenizer, smollm_tokenizer):
    think = ReasoningMarkers.of(qwen_tokenizer, hermes.HERMES)
    assert think == ReasoningMarkers((qwen_tokenizer.piece_to_id("<think>"),), (qwen_tokenizer.piece_to_id("</think>"),))
    fresh = Tokenizer.from_spec(qwen_tokenizer.to_spec())
    assert ReasoningMarkers.of(fresh, hermes.HERMES) == think
    assert not fresh.has_encoder  # added tokens are looked up: a worker builds no encoder for them
    assert ReasoningMarkers.of(smollm_tokenizer, hermes.HERMES) is None  # <think> is no token of its vocabulary
    assert ReasoningMarkers.of(qwen_tokenizer, nanochat.NANOCHAT) is None  # a convention without reasoning
    gemma = Tokenizer.from_gguf_metadata(gemma4_vocab_metadata())
    opens = tuple(gemma.encode(gemma4.THOUGHT.open, add_special=False))  # <|channel> and "thought"'s tokens
    assert ReasoningMarkers.of(gemma, gemma4.GEMMA4) == ReasoningMarkers(opens, (gemma.piece_to_id(gemma4.THOUGHT.close),))
    assert opens[0] == gemma.piece_to_id(gemma4.CHANNEL) and len(opens) > 1
    blocks = Tokenizer.from_gguf_metadata(inkling_vocab_metadata())
    assert ReasoningMarkers.of(blocks, inkling.INKLING) == ReasoningMarkers(
        (blocks.piece_to_id(inkling.THINKING),), (blocks.piece_to_id(inkling.END),))


def test_a_forced_close_skips_the_scripts_reasoning_to_its_answer(qwen_tokenizer):
    ids = lambda text: tuple(qwen_tokenizer.encode(text, add_special=False))  # noqa: E731
    reply = ids("<think>\nlong long long long\n</think>\n\nAnswer.")
    script = ScriptedReplies([ScriptedReply(reply)], end_id=0, tokenizer=qwen_tokenizer)
    sampler = script.sampler(SamplingParams(), [1])
    logits = np.zeros(qwen_tokenizer.vocab_size, dtype=np.float32)
    said = [sampler.sample(logits).token_id for _ in range(3)]
    close = qwen_tokenizer.piece_to_id("</think>")
    said.append(sampler.force(logits, close).token_id)
    while (token := sampler.sample(logits).token_id) != 0:
        said.append(token)
    assert qwen_tokenizer.decode(said) == "<think>\nlong</think>\n\nAnswer."


def test_a_files_recommended_sampling_is_read_and_bad_values_are_no_recommendation():
    metadata = {"general.sampling.temp": 0.6, "general.sampling.top_k": 20, "general.sampling.top_p": 0.0,
                "general.sampling.min_p": "high", "general.sampling.penalty_repeat": 1.1}
    assert sampling_defaults(metadata) == SamplingDefaults(temperature=0.6, top_k=20, repetition_penalty=1.1)
    assert sampling_defaults({}) == SamplingDefaults()


def test_a_request_field_wins_over_the_flags_which_win_over_the_file():
    file = SamplingDefaults(temperature=0.6, top_k=20, top_p=0.95)
    flags = SamplingDefaults(top_k=1)
    defaults = flags.over(file)
    assert defaults == SamplingDefaults(temperature=0.6, top_k=1, top_p=0.95)
    # unset (None) takes the default; a value equal to the API's default is still the request's
    assert defaults.params(temperature=None, top_k=0) == SamplingParams(temperature=0.6, top_k=0, top_p=0.95)
    assert defaults.params(temperature=1.0).temperature == 1.0
    assert SamplingDefaults().params() == SamplingParams()
    assert defaults.params(top_p=0).top_p == pytest.approx(1e-9)  # top_p 0: greedy, not an error
    with pytest.raises(InvalidRequestError):
        defaults.params(temperature=-1)
