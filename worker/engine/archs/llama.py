"""llama (SmolLM2, Llama 2/3 and their fine-tunes).

- pre-norm blocks: RMSNorm -> attention -> residual, RMSNorm -> SwiGLU -> residual
- grouped-query attention, RoPE over the whole head on adjacent pairs (GGUF stores the Q/K
  rows permuted for that form)
- optional Q/K/V biases, optional per-pair RoPE factors (Llama 3), tied or untied head
"""

from __future__ import annotations

from shared.errors import ModelLoadError
from worker.engine.gguf_file import GGUFFile
from worker.engine.model import DecoderModel, HParams


class LlamaModel(DecoderModel):
    architecture = "llama"
    rope_adjacent = True

    def read_hparams(self, gguf: GGUFFile) -> HParams:
        hp = super().read_hparams(gguf)
        if hp.rope_dims != hp.head_dim:
            raise ModelLoadError(
                f"{gguf.path}: llama expects rope.dimension_count == head dim ({hp.rope_dims} != {hp.head_dim})")
        if hp.n_expert:
            raise ModelLoadError(f"{gguf.path}: llama mixture-of-experts files are not supported")
        return hp
