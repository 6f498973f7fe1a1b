"""Writing a reply a block at a time on a text-diffusion model (diffusion-gemma).

A block starts as a canvas of random tokens. Each denoising pass (``DiffusionGemmaModel.denoise``)
gives logits for every canvas position; ``CanvasWriter.advance`` then

- divides them by the step's temperature, t = t_min + (t_max − t_min)·s/S for s = S … 1 (the
  model's schedule, times the request's temperature);
- draws a token per position from that distribution (the most likely one at temperature 0),
  and accepts the positions of lowest entropy while the entropies of those accepted before
  sum to at most the entropy bound; every other position gets a fresh random token;
- keeps the distribution for the next pass's self-conditioning;
- is done when the most likely canvas has not changed for ``stability_threshold`` passes and
  the mean entropy is below ``confidence_threshold``, or after S passes.

The block written is the most likely canvas of the last pass. The scheduler sends it (cut at
the first end-of-turn token or at ``max_tokens``), has the encoder read it into the cache, and
starts the next block unless the reply ended.

Randomness comes from the request's seed; a request at temperature 0 without one is seeded
with 0, so it is repeatable like a greedy autoregressive one.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from shared.sampling_params import SamplingParams
from worker.engine.archs.diffusion_gemma import DiffusionSettings

GREEDY_SEED = 0


class CanvasWriter:
    """One block's denoising state: the canvas, the previous pass's distribution, the passes
    left, and the recent most likely canvases."""

    def __init__(self, settings: DiffusionSettings, n_vocab: int, length: int, params: SamplingParams,
                 rng: np.random.Generator):
        self.settings = settings
        self.n_vocab = n_vocab
        self.temperature = params.temperature
        self.rng = rng
        self.canvas = rng.integers(0, n_vocab, length)
        self.probs: np.ndarray | None = None  # the last pass's distribution (self-conditioning)
        self.best: np.ndarray | None = None  # the last pass's most likely canvas
        self.steps_left = settings.max_steps
        self.recent: deque[np.ndarray] = deque(maxlen=max(settings.stability_threshold, 1))
        self.done = False
        self.passes = 0

    @staticmethod
    def rng_for(params: SamplingParams) -> np.random.Generator:
        seed = params.seed if params.seed is not None else GREEDY_SEED if params.temperature == 0 else None
        return np.random.default_rng(None if seed is None else seed % (1 << 64))

    def step_temperature(self) -> float:
        s = self.settings
        return s.t_min + (s.t_max - s.t_min) * self.steps_left / s.max_steps

    def advance(self, logits: np.ndarray) -> None:
        """Take one pass's logits [C, vocab] into the canvas."""
        settings = self.settings
        scaled = logits.astype(np.float64) / (self.step_temperature() * (self.temperature or 1.0))
        scaled -= scaled.max(axis=-1, keepdims=True)
        probs = np.exp(scaled)
        probs /= probs.sum(axis=-1, keepdims=True)
        with np.errstate(divide="ignore", invalid="ignore"):
            entropy = -np.where(probs > 0, probs * np.log(probs), 0.0).sum(axis=-1)
        best = scaled.argmax(axis=-1)
        if self.temperature == 0:
            drawn = best
        else:  # one draw per position by inverting its cumulative distribution
            cumulative = np.cumsum(probs, axis=-1)
            drawn = (cumulative < self.rng.random((len(probs), 1)) * cumulative[:, -1:]).sum(axis=-1)
            drawn = np.minimum(drawn, self.n_vocab - 1)
        order = np.argsort(entropy, kind="stable")
        before = np.cumsum(entropy[order]) - entropy[order]  # entropy of the positions accepted before
        accepted = np.zeros(len(entropy), dtype=bool)
        accepted[order[before <= settings.entropy_bound]] = True
        fresh = self.rng.integers(0, self.n_vocab, len(entropy))
        self.canvas = np.where(accepted, drawn, fresh)
        stable = (settings.stability_threshold == 0
                  or (len(self.recent) == settings.stability_threshold
                      and all(np.array_equal(held, best) for held in self.recent)))
        self.recent.append(best)
        self.probs = probs.astype(np.float32)
        self.best = best
        self.steps_left -= 1
        self.passes += 1
        self.done = self.steps_left == 0 or (stable and float(entropy.mean()) < settings.confidence_threshold)

    def written(self) -> list[int]:
        """The block as written: the most likely canvas of the last pass."""
        if self.best is None:
            raise RuntimeError("no denoising pass has run yet")
        return [int(t) for t in self.best]
