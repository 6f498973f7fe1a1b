"""Choosing the next token from logits: penalties, biases, truncation, temperature, logprobs.

The order follows common practice: logit bias, then penalties, then the grammar mask; the
reported logprobs come from that distribution (before temperature and truncation); then
top-k, top-p, min-p and temperature shape the distribution the token is drawn from.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from shared.sampling_params import SamplingParams
from worker.engine import ops


LIKELY_SHARE = np.float32(1e-4)  # below this share of the best token's probability, a token is unlikely


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]]  # most likely alternatives, best first


class Sampler:
    """One per sequence: it remembers the generated tokens for the penalties and owns the RNG."""

    def __init__(self, params: SamplingParams, prompt_tokens: list[int] | None = None):
        self.params = params
        # any 64-bit seed, negative ones included, names one reproducible stream
        self.rng = np.random.default_rng(None if params.seed is None else params.seed % 2**64)
        self.recent: list[int] = list(prompt_tokens or [])[-params.repetition_window:]
        self.generated = Counter()

    @property
    def greedy(self) -> bool:
        """Whether the token is always the largest biased logit's and nothing else of the logits
        is reported (no penalty or logprobs): a pass may give the choice instead of the logits
        (``take``), the bias (``bias``) added where ``adjusted_logits`` adds it."""
        p = self.params
        return (p.temperature == 0 and p.repetition_penalty == 1.0 and not p.presence_penalty
                and not p.frequency_penalty and not p.logprobs and not p.top_logprobs)

    @property
    def bias(self) -> tuple[np.ndarray, np.ndarray]:
        """The logit bias as token ids and float32 values (empty where there is none)."""
        bias = self.params.logit_bias
        return (np.fromiter(bias.keys(), dtype=np.int64, count=len(bias)),
                np.fromiter(bias.values(), dtype=np.float32, count=len(bias)))

    def take(self, token_id: int) -> SampledToken:
        """A greedy choice made from the logits elsewhere (``greedy``), as ``sample`` makes it."""
        self.accept(token_id)
        return SampledToken(token_id, 0.0, [])

    def accept(self, token_id: int) -> None:
        self.generated[token_id] += 1
        self.recent.append(token_id)
        if len(self.recent) > self.params.repetition_window:
            del self.recent[0]

    def adjusted_logits(self, logits: np.ndarray, allowed: np.ndarray | None = None) -> np.ndarray:
        """Logits after bias, penalties and the optional boolean mask of allowed tokens."""
        p = self.params
        out = logits.astype(np.float32, copy=True)
        if p.logit_bias:
            ids, values = self.bias
            keep = (ids >= 0) & (ids < out.shape[0])
            out[ids[keep]] += values[keep]
        if p.repetition_penalty != 1.0 and self.recent:
            ids = np.unique(np.asarray(self.recent, dtype=np.int64))
            vals = out[ids]
            out[ids] = np.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and self.generated:
            ids = np.fromiter(self.generated.keys(), dtype=np.int64)
            counts = np.fromiter(self.generated.values(), dtype=np.float32)
            out[ids] -= p.presence_penalty + p.frequency_penalty * counts
        if allowed is not None:
            out = np.where(allowed, out, np.float32(-np.inf))
        return out

    def sample(self, logits: np.ndarray, allowed: np.ndarray | None = None) -> SampledToken:
        p = self.params
        scores = self.adjusted_logits(logits, allowed)
        if p.temperature == 0:
            token = int(np.argmax(scores))
        else:
            token = self._draw(scores)
        logprob, top = self.logprobs(scores, token)
        self.accept(token)
        return SampledToken(token, logprob, top)

    def force(self, logits: np.ndarray, token: int, allowed: np.ndarray | None = None) -> SampledToken:
        """``token`` chosen without a draw (a reasoning budget closing its block): its logprobs
        come from the logits all the same, and the penalties remember it."""
        logprob, top = self.logprobs(self.adjusted_logits(logits, allowed), token)
        self.accept(token)
        return SampledToken(token, logprob, top)

    def _draw(self, scores: np.ndarray) -> int:
        p = self.params
        n = scores.shape[0]
        if 0 < p.top_k < n:
            candidates = np.argpartition(-scores, p.top_k - 1)[:p.top_k]
            candidates = candidates[np.isfinite(scores[candidates])]
        else:
            candidates = np.flatnonzero(np.isfinite(scores))
        if candidates.size == 0:
            return int(np.argmax(scores))
        if p.top_p < 1.0 or p.min_p > 0:
            candidates = truncated(candidates, scores[candidates], p.top_p, p.min_p)
        values = scores[candidates].astype(np.float64)
        # softmax(log(p) / T) over the survivors is softmax(logits / T) over them
        total = np.cumsum(ops.softmax(values / p.temperature))
        pick = int(np.searchsorted(total, self.rng.random() * total[-1], side="right"))
        return int(candidates[min(pick, candidates.size - 1)])

    def logprobs(self, scores: np.ndarray, token: int) -> tuple[float, list[tuple[int, float]]]:
        """The chosen token's logprob and the likeliest alternatives, as far as the params ask
        (a scripted sampler reports these for tokens it did not draw)."""
        p = self.params
        if not p.logprobs and not p.top_logprobs:
            return 0.0, []
        logp = ops.log_softmax(scores.astype(np.float64))
        top: list[tuple[int, float]] = []
        if p.top_logprobs:
            ids = np.argpartition(-logp, p.top_logprobs - 1)[:p.top_logprobs]
            ids = ids[np.argsort(-logp[ids], kind="stable")]
            top = [(int(i), float(logp[i])) for i in ids]
        return float(logp[token]), top


def truncated(candidates: np.ndarray, values: np.ndarray, top_p: float, min_p: float) -> np.ndarray:
    """The candidates (token ids with float32 logits ``values``) that top-p and min-p keep,
    judged by their probabilities before temperature.

    Both keep only the most likely tokens, so the work runs on the tokens within LIKELY_SHARE
    of the best one (a few hundred of a 50k-150k vocabulary) with the whole vocabulary's total
    as the denominator; every candidate is taken only when those cannot hold the nucleus (a
    flat distribution) or min-p reaches below them."""
    best = values.max()
    weights = np.exp(values - best)  # float32 over the whole vocabulary: tens of µs
    total = weights.sum(dtype=np.float64)
    likely = weights >= LIKELY_SHARE
    if (min_p == 0 or min_p >= LIKELY_SHARE) and (
            top_p >= 1.0 or weights[likely].sum(dtype=np.float64) >= top_p * total):
        candidates, values = candidates[likely], values[likely]
    probs = np.exp(values.astype(np.float64) - best) / total
    if top_p < 1.0:
        kept = nucleus(probs, top_p)
        candidates, probs = candidates[kept], probs[kept]
    if min_p > 0:
        candidates = candidates[probs >= min_p * probs.max()]
    return candidates


def nucleus(probs: np.ndarray, top_p: float) -> np.ndarray:
    """Indices of the most likely entries whose probabilities first sum to top_p, best first.

    Only as many entries as the nucleus needs are sorted: the top 64, then the top 1,024, and
    the whole vocabulary only for a very flat distribution (a full sort costs milliseconds per
    token on a 50k-150k vocabulary, in every stream of every step).
    """
    for size in (64, 1024):
        if size >= probs.size:
            break
        top = np.argpartition(-probs, size - 1)[:size]
        top = top[np.argsort(-probs[top])]
        total = np.cumsum(probs[top])
        if total[-1] >= top_p:
            return top[:int(np.searchsorted(total, top_p)) + 1]
    order = np.argsort(-probs)  # SIMD-sorted: equal probabilities may come in any order
    total = np.cumsum(probs[order])
    return order[:int(np.searchsorted(total, top_p)) + 1]
