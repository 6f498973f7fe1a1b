"""gemma3 (Gemma 3: 270M to 27B).

- the embedding scaled by √n_embd; the output head tied to it; an optional final soft cap
- local layers attend within a sliding window and rotate with their own base (rope.freq_base_swa,
  default 10000, never scaled); every sliding_window_pattern-th layer (default 6: layers 5, 11,
  …) is global, with rope.freq_base and the file's linear scaling
- per-head Q/K RMSNorm before NEOX RoPE; norms after attention and after the FFN as well as
  before each (the converter bakes Gemma's 1 + w into the stored weights)
- a GELU-tanh gated FFN
"""

from __future__ import annotations

import numpy as np

from worker.engine import ops
from worker.engine.gguf_file import GGUFFile
from worker.engine.model import NORM, AttentionOptions, DecoderModel, ForwardPass, HParams, LayerTensor, Rope


class Gemma3Model(DecoderModel):
    architecture = "gemma3"
    activation = "gelu_tanh"

    def read_hparams(self, gguf: GGUFFile) -> HParams:
        meta, arch = gguf.metadata, self.architecture
        self.sliding_window = int(meta.get(f"{arch}.attention.sliding_window", 0) or 0)
        self.swa_period = int(meta.get(f"{arch}.attention.sliding_window_pattern", 6) or 6)
        self.swa_base = float(meta.get(f"{arch}.rope.freq_base_swa", 10000.0))
        self.softcap = float(meta.get(f"{arch}.final_logit_softcapping", 0.0) or 0.0)
        return super().read_hparams(gguf)

    @classmethod
    def layer_tensors(cls, hp: HParams, i: int) -> list[LayerTensor]:
        d = hp.n_embd
        return (cls.attention_tensors(hp, qk_norm=True)
                + [LayerTensor("post_attention_norm", "post_attention_norm.weight", (d,), NORM)]
                + cls.ffn_tensors(hp)
                + [LayerTensor("post_ffw_norm", "post_ffw_norm.weight", (d,), NORM)])

    def local(self, i: int) -> bool:
        return self.sliding_window > 0 and i % self.swa_period < self.swa_period - 1

    def rope(self, i: int) -> Rope:
        if self.local(i):
            return Rope(self.swa_base, self.hp.rope_dims)
        return super().rope(i)

    def attention(self, i: int) -> AttentionOptions:
        # the 27B (62 layers) scales by its width per head, the others by the head size
        per_head = self.hp.n_embd // self.hp.n_head if self.hp.n_layer == 62 else self.hp.head_dim
        return AttentionOptions(scale=1.0 / float(np.sqrt(per_head)),
                                window=self.sliding_window if self.local(i) else 0)

    def embed(self, token_ids: np.ndarray) -> np.ndarray:
        x = super().embed(token_ids)
        x *= np.float32(np.sqrt(self.hp.n_embd))
        return x

    def block(self, i: int, x: np.ndarray, fp: ForwardPass) -> np.ndarray:
        layer, eps = self.layers[i], self.hp.rms_eps
        if self.fused[i] is not None:
            attn = ops.linear(self.fused_attention(i, x, fp), layer["wo"])
        else:
            attn = self.self_attention(i, ops.rms_norm(x, layer["attn_norm"], eps), fp)
        x = x + ops.rms_norm(attn, layer["post_attention_norm"], eps)
        ffn = ops.gated_ffn(ops.rms_norm(x, layer["ffn_norm"], eps), layer["gate"], layer["up"], layer["down"],
                            self.activation)
        return x + ops.rms_norm(ffn, layer["post_ffw_norm"], eps)

    def head_output(self, products: np.ndarray, start: int) -> np.ndarray:
        return ops.softcap(products, self.softcap)
