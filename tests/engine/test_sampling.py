"""Choosing tokens: greedy, temperature, truncation, penalties, biases, masks, logprobs."""

from __future__ import annotations

import numpy as np
import pytest

from shared.errors import InvalidRequestError
from shared.sampling_params import SamplingParams
from worker.engine.sampling import Sampler

LOGITS = np.log(np.array([0.1, 0.2, 0.3, 0.4, 1e-9], dtype=np.float32))  # probabilities of 5 tokens


def _draws(params: SamplingParams, n: int = 4000, logits=LOGITS, allowed: np.ndarray | None = None) -> np.ndarray:
    sampler = Sampler(params)
    counts = np.zeros(len(logits))
    for _ in range(n):
        sampler.generated.clear()
        counts[sampler.sample(logits, allowed).token_id] += 1
    return counts / n


def test_greedy_takes_the_argmax():
    assert Sampler(SamplingParams(temperature=0)).sample(LOGITS).token_id == 3


def test_temperature_one_follows_the_distribution():
    freq = _draws(SamplingParams(temperature=1.0, seed=1))
    np.testing.assert_allclose(freq, [0.1, 0.2, 0.3, 0.4, 0.0], atol=0.03)


def test_low_temperature_sharpens():
    freq = _draws(SamplingParams(temperature=0.25, seed=2))
    expected = np.array([0.1, 0.2, 0.3, 0.4]) ** 4
    np.testing.assert_allclose(freq[:4], expected / expected.sum(), atol=0.03)


def test_top_k_top_p_min_p_truncate():
    assert set(np.nonzero(_draws(SamplingParams(top_k=2, seed=3), 800))[0]) == {2, 3}
    # top_p 0.65: 0.4 + 0.3 reaches it, so tokens 3 and 2 remain
    assert set(np.nonzero(_draws(SamplingParams(top_p=0.65, seed=4), 800))[0]) == {2, 3}
    # min_p 0.6: keep tokens with p >= 0.6 * 0.4
    assert set(np.nonzero(_draws(SamplingParams(min_p=0.6, seed=5), 800))[0]) == {2, 3}


def test_seed_makes_draws_reproducible():
    a = [Sampler(SamplingParams(seed=9)).sample(LOGITS).token_id for _ in range(5)]
    sampler_1, sampler_2 = Sampler(SamplingParams(seed=42)), Sampler(SamplingParams(seed=42))
    assert [sampler_1.sample(LOGITS).token_id for _ in range(30)] == [sampler_2.sample(LOGITS).token_id for _ in range(30)]
    assert len(set(a)) == 1  # a fresh sampler with the same seed draws the same first token


def test_logit_bias_forbids_and_forces():
    assert Sampler(SamplingParams(temperature=0, logit_bias={3: -100})).sample(LOGITS).token_id == 2
    assert Sampler(SamplingParams(temperature=0, logit_bias={4: 100})).sample(LOGITS).token_id == 4


def test_presence_and_frequency_penalties_apply_to_generated_tokens():
    sampler = Sampler(SamplingParams(temperature=0, presence_penalty=0.1, frequency_penalty=0.1))
    sampler.accept(3)
    sampler.accept(3)
    adjusted = sampler.adjusted_logits(LOGITS)
    assert adjusted[3] == pytest.approx(LOGITS[3] - 0.1 - 0.2)
    assert adjusted[2] == pytest.approx(LOGITS[2])


def test_repetition_penalty_covers_the_prompt():
    logits = np.array([2.0, -2.0, 1.0], dtype=np.float32)
    sampler = Sampler(SamplingParams(repetition_penalty=2.0), prompt_tokens=[0, 1])
    np.testing.assert_allclose(sampler.adjusted_logits(logits), [1.0, -4.0, 1.0])


def test_mask_limits_the_choice():
    allowed = np.array([True, True, False, False, False])
    assert Sampler(SamplingParams(temperature=0)).sample(LOGITS, allowed).token_id == 1
    # the two likeliest tokens are masked out: draws keep to the allowed two, in their 1:2 ratio
    freq = _draws(SamplingParams(seed=6), 1500, allowed=allowed)
    np.testing.assert_allclose(freq, [1 / 3, 2 / 3, 0, 0, 0], atol=0.05)


def test_logprobs_report_the_model_distribution():
    sampled = Sampler(SamplingParams(temperature=0, logprobs=True, top_logprobs=3)).sample(LOGITS)
    assert sampled.logprob == pytest.approx(np.log(0.4), abs=1e-5)
    assert [t for t, _ in sampled.top_logprobs] == [3, 2, 1]
    assert [lp for _, lp in sampled.top_logprobs] == pytest.approx(np.log([0.4, 0.3, 0.2]), abs=1e-5)


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-1),
                                 dict(min_p=2), dict(presence_penalty=3), dict(top_logprobs=21)])
def test_invalid_params_are_rejected(bad):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**bad)


def test_params_survive_the_wire():
    params = SamplingParams(temperature=0.5, top_k=7, seed=3, logit_bias={5: -1.5}, top_logprobs=2, logprobs=True)
    assert SamplingParams.from_wire(params.to_wire()) == params


@pytest.mark.parametrize("flatness", [0.5, 3.0, 30.0])  # nucleus within 64, within 1,024, beyond
def test_nucleus_matches_a_full_sort(flatness):
    from worker.engine.sampling import nucleus
    rng = np.random.default_rng(int(flatness * 10))
    probs = np.exp(rng.standard_normal(50_000) * flatness / 3.0 - np.arange(50_000) / (1000.0 * flatness))
    probs /= probs.sum()
    for top_p in (0.1, 0.5, 0.9, 0.99):
        order = np.argsort(-probs, kind="stable")
        expected = order[:int(np.searchsorted(np.cumsum(probs[order]), top_p)) + 1]
        got = nucleus(probs, top_p)
        assert set(got.tolist()) == set(expected.tolist()), (flatness, top_p, len(got), len(expected))
