"""qwen3 (dense Qwen3).

- pre-norm blocks with SwiGLU, grouped-query attention
- head dim from attention.key_length (not n_embd / n_head)
- per-head RMSNorm on Q and K before RoPE; half-split (NEOX) RoPE over the whole head
- no biases; the output head is tied to the embedding on the small models
"""

from __future__ import annotations

from worker.engine.model import DecoderModel, HParams, LayerTensor


class Qwen3Model(DecoderModel):
    architecture = "qwen3"

    @classmethod
    def layer_tensors(cls, hp: HParams, i: int) -> list[LayerTensor]:
        return cls.attention_tensors(hp, qk_norm=True) + cls.ffn_tensors(hp)
