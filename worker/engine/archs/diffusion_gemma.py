"""diffusion-gemma (DiffusionGemma, e.g. diffusiongemma-26B-A4B-it): block text diffusion on the
Gemma 4 26B-A4B backbone.

The model writes a block ("canvas") of ``diffusion.canvas_length`` tokens at once, refining it
over several denoising passes (``worker/diffusion.py`` runs them), then the next block.

- The encoder is gemma4 as it is (``forward``): causal over the prompt, a sliding window on
  sliding layers, each layer's output times ``enc_layer_output_scale``. Its KV is the prompt's,
  kept in the sequence's cache; a finished block is read by it too and appended.
- The decoder (``denoise``) runs the same layers over the canvas alone, at the positions after
  the cache's, each layer's output times ``layer_output_scale``. Canvas rows see every canvas
  row (both ways) and, through the cache read but never written, every earlier position on
  global layers and the last window − 1 on sliding ones.
- Canvas rows enter as RMSNorm (no weight) of the scaled embedding plus a self-conditioning
  signal: a GELU-tanh gated FFN (``self_cond_gate``/``up``/``down``) of the RMS-normed (weight
  ``self_cond_pre_norm``) expected embedding under the previous pass's distribution
  (probabilities · E · √n_embd); none on the first pass.
- Logits from the tied head with gemma4's soft cap. Row i's logits are canvas token i's (no
  shift).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from shared.errors import ModelLoadError
from worker.engine import ops
from worker.engine.archs.gemma4 import Gemma4Model
from worker.engine.gguf_file import GGUFFile
from worker.engine.kv_cache import KVCache
from worker.engine.model import NORM, ForwardPass, HParams, LayerTensor
from worker.engine.weights import DenseWeight

SOFT_EMBEDDING_ROWS = 16384  # embedding rows dequantized at once for the expected embedding
NEGLIGIBLE = 1e-9  # a token no canvas row gives this much probability is left out of it


@dataclass(frozen=True)
class DiffusionSettings:
    """The sampler's settings the file carries (``diffusion.*``; defaults are the runtime's)."""

    canvas_length: int = 256
    max_steps: int = 48
    t_min: float = 0.4
    t_max: float = 0.8
    entropy_bound: float = 0.1
    stability_threshold: int = 1
    confidence_threshold: float = 0.005


class DiffusionGemmaModel(Gemma4Model):
    architecture = "diffusion-gemma"
    diffusion = True  # the scheduler writes its replies a block at a time (``denoise``)

    def read_hparams(self, gguf: GGUFFile) -> HParams:
        hp = super().read_hparams(gguf)
        meta = gguf.metadata
        defaults = DiffusionSettings()
        self.settings = DiffusionSettings(
            canvas_length=int(meta.get("diffusion.canvas_length", defaults.canvas_length)),
            max_steps=int(meta.get("diffusion.eb_max_steps", defaults.max_steps)),
            t_min=float(meta.get("diffusion.eb_t_min", defaults.t_min)),
            t_max=float(meta.get("diffusion.eb_t_max", defaults.t_max)),
            entropy_bound=float(meta.get("diffusion.eb_entropy_bound", defaults.entropy_bound)),
            stability_threshold=int(meta.get("diffusion.eb_stability_threshold", defaults.stability_threshold)),
            confidence_threshold=float(meta.get("diffusion.eb_confidence_threshold",
                                                defaults.confidence_threshold)))
        settings = self.settings
        if (settings.canvas_length < 1 or settings.max_steps < 1 or not 0 < settings.t_min <= settings.t_max
                or settings.entropy_bound < 0 or settings.stability_threshold < 0):
            raise ModelLoadError(f"{gguf.path}: its diffusion settings cannot run ({settings}): a canvas and "
                                 f"steps of at least 1, temperatures 0 < t_min <= t_max, bounds >= 0")
        return hp

    @classmethod
    def layer_tensors(cls, hp: HParams, i: int) -> list[LayerTensor]:
        return super().layer_tensors(hp, i) + [
            LayerTensor("enc_output_scale", "enc_layer_output_scale.weight", (1,), NORM, optional=True)]

    @classmethod
    def global_tensors(cls, hp: HParams) -> list[LayerTensor]:
        d, f = hp.n_embd, hp.n_ff
        return super().global_tensors(hp) + [LayerTensor("sc_pre_norm", "self_cond_pre_norm.weight", (d,), NORM),
                                             LayerTensor("sc_gate", "self_cond_gate.weight", (f, d)),
                                             LayerTensor("sc_up", "self_cond_up.weight", (f, d)),
                                             LayerTensor("sc_down", "self_cond_down.weight", (d, f))]

    def output_scale(self, layer: dict[str, Any], fp: ForwardPass) -> np.ndarray | None:
        return layer.get("output_scale" if fp.canvas else "enc_output_scale")

    # --- the decoder's pass ----------------------------------------------------------------------

    def denoise(self, canvases: list[tuple[KVCache, list[int], np.ndarray | None]]) -> list[np.ndarray]:
        """One decoder pass over each sequence's canvas, in one weight pass for all of them:
        (cache, canvas ids, the previous pass's probabilities [C, vocab] or None) -> logits
        [C, vocab] per sequence. The caches are read, not written."""
        spans, positions, ids, signals = [], [], [], []
        row = 0
        for cache, canvas, probs in canvases:
            spans.append((row, row + len(canvas)))
            positions.append(np.arange(cache.length, cache.length + len(canvas)))
            ids.extend(canvas)
            signals.append(np.zeros((len(canvas), self.hp.n_embd), np.float32) if probs is None
                           else self.soft_embedding(probs))
            row += len(canvas)
        row_positions = np.concatenate(positions)
        fp = ForwardPass([c for c, _, _ in canvases], spans, self.layer_rope_tables(row_positions), row_positions,
                         canvas=True)
        x = self.embed(np.asarray(ids, dtype=np.int64)) + self.self_conditioning(np.concatenate(signals))
        x = ops.rms_norm(x, None, self.hp.rms_eps)
        for i in range(self.hp.n_layer):
            x = self.block(i, x, fp)
        logits = self.logits(x)
        return [logits[start:end] for start, end in spans]

    def soft_embedding(self, probs: np.ndarray) -> np.ndarray:
        """The expected scaled embedding under each row's distribution: probs [C, vocab] · E · √d.
        A quantized table is read only in the rows of tokens some canvas row gives weight to
        (a probability of at least NEGLIGIBLE: at most vocab × NEGLIGIBLE of a row's mass is
        left out), a block of them at a time."""
        scale = np.float32(np.sqrt(self.hp.n_embd))
        table = self.token_embd
        if isinstance(table, DenseWeight):
            return (probs.astype(np.float32) @ table.values) * scale
        out = np.zeros((probs.shape[0], self.hp.n_embd), dtype=np.float32)
        weighted = np.nonzero(probs.max(axis=0) >= NEGLIGIBLE)[0]
        for start in range(0, len(weighted), SOFT_EMBEDDING_ROWS):
            ids = weighted[start:start + SOFT_EMBEDDING_ROWS]
            out += probs[:, ids].astype(np.float32) @ table.rows(ids)
        return out * scale

    def self_conditioning(self, signal: np.ndarray) -> np.ndarray:
        m = ops.rms_norm(signal, self.sc_pre_norm, self.hp.rms_eps)
        return ops.gated_ffn(m, self.sc_gate, self.sc_up, self.sc_down, "gelu_tanh")
