"""Writing a reply a block at a time on a text-diffusion model (diffusion-gemma).

A block starts as a canvas of random tokens. Each denoising pass (``DiffusionGemmaModel.denoise``)
gives logits for every canvas position; ``CanvasWriter.advance`` then

- divides them by the step's temperature, t = t_min + (t_max − t_min)·s/S for s = S … 1 (the
  model's schedule);
- draws a token per position from that distribution, sharpened or flattened by the request's
  temperature (the most likely one at temperature 0), and accepts the positions of lowest
  entropy (of the schedule's distribution) while the entropies of those accepted before sum to
  at most the entropy bound; every other position gets a fresh random token;
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

from shared.errors import InvalidRequestError
from shared.protocol import Generate
from shared.sampling_params import SamplingParams
from worker.engine.archs.diffusion_gemma import DiffusionSettings

GREEDY_SEED = 0
DRAW_ROWS = 16  # positions drawn at once (each a cumulative distribution over the vocabulary)


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
        """Take one pass's logits [C, vocab] into the canvas. Float32 and two [C, vocab] arrays
        at most: a real canvas's logits are 256 × 262,144."""
        settings = self.settings
        scaled = logits.astype(np.float32) / np.float32(self.step_temperature())  # the schedule's logits
        scaled -= scaled.max(axis=-1, keepdims=True)
        best = scaled.argmax(axis=-1)
        drawn = best if self.temperature == 0 else self._draw(scaled)
        probs = np.exp(scaled)
        totals = probs.sum(axis=-1)
        # H = ln Z − Σ p·s over the shifted logits s, with p = e^s / Z
        entropy = np.log(totals) - np.einsum("ij,ij->i", probs, scaled) / totals
        del scaled
        probs /= totals[:, None]
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
        self.probs = probs
        self.best = best
        self.steps_left -= 1
        self.passes += 1
        self.done = self.steps_left == 0 or (stable and float(entropy.mean()) < settings.confidence_threshold)

    def _draw(self, scaled: np.ndarray) -> np.ndarray:
        """One token per position from softmax(scaled / the request's temperature), by inverting
        the cumulative distribution, a block of positions at a time."""
        drawn = np.empty(len(scaled), dtype=np.int64)
        for start in range(0, len(scaled), DRAW_ROWS):
            part = scaled[start:start + DRAW_ROWS] / np.float32(self.temperature)
            np.exp(part - part.max(axis=-1, keepdims=True), out=part)
            np.cumsum(part, axis=-1, out=part)
            threshold = self.rng.random((len(part), 1)) * part[:, -1:]
            drawn[start:start + len(part)] = np.minimum((part < threshold).sum(axis=-1), self.n_vocab - 1)
        return drawn

    def written(self) -> list[int]:
        """The block as written: the most likely canvas of the last pass."""
        if self.best is None:
            raise RuntimeError("no denoising pass has run yet")
        return [int(t) for t in self.best]


def check_request(request: Generate) -> None:
    """InvalidRequestError for what a text-diffusion model cannot do: its tokens are not drawn
    one by one from a next-token distribution, so there is nothing to constrain token by token or
    to report log-probabilities of."""
    params = request.sampling
    unsupported = [what for what, asked in (
        ("constrained output (a grammar, JSON schema or forced tool call)", request.grammar is not None),
        ("log-probabilities", params.logprobs or params.top_logprobs > 0 or request.prompt_logprobs >= 0),
        ("cartridges", bool(request.cartridge_ids))) if asked]
    if unsupported:
        raise InvalidRequestError(f"this model writes its replies a block at a time (text diffusion): "
                                  f"{', '.join(unsupported)} cannot be served on it")
