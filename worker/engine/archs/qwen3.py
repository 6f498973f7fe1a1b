"""qwen3 (dense Qwen3).

- pre-norm blocks with SwiGLU, grouped-query attention
- head dim from attention.key_length (not n_embd / n_head)
- per-head RMSNorm on Q and K before RoPE; half-split (NEOX) RoPE over the whole head
- no biases; the output head is tied to the embedding on the small models
"""

from __future__ import annotations

from typing import Any

import numpy as np

from worker.engine.gguf_file import GGUFFile
from worker.engine.model import DecoderModel, ForwardPass


class Qwen3Model(DecoderModel):
    architecture = "qwen3"

    def load_layer(self, gguf: GGUFFile, i: int) -> dict[str, Any]:
        head_dim = self.hp.head_dim
        return {
            "attn_norm": self.load_norm(gguf, f"blk.{i}.attn_norm.weight"),
            **self.load_qkv(gguf, i),
            "q_norm": self.load_norm(gguf, f"blk.{i}.attn_q_norm.weight", head_dim),
            "k_norm": self.load_norm(gguf, f"blk.{i}.attn_k_norm.weight", head_dim),
            "ffn_norm": self.load_norm(gguf, f"blk.{i}.ffn_norm.weight"),
            **self.load_swiglu(gguf, i),
        }

    def block(self, i: int, x: np.ndarray, fp: ForwardPass) -> np.ndarray:
        return self.dense_block(i, x, fp)  # with the layer's per-head Q/K RMSNorm, before RoPE
