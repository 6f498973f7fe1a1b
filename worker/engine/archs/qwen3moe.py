"""qwen3moe (Qwen3 mixture of experts, e.g. Qwen3-30B-A3B).

- attention exactly as qwen3: per-head Q/K RMSNorm before half-split RoPE, GQA
- every block's FFN is a routed mixture: softmax over all experts, keep the top k,
  renormalize the kept weights to sum 1, weighted sum of SwiGLU experts; no shared expert
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from shared.errors import ModelLoadError
from worker.engine import ops
from worker.engine.gguf_file import GGUFFile
from worker.engine.model import DecoderModel, ForwardPass, HParams, LayerTensor


class Qwen3MoeModel(DecoderModel):
    architecture = "qwen3moe"

    def read_hparams(self, gguf: GGUFFile) -> HParams:
        hp = super().read_hparams(gguf)
        if not hp.n_expert or not hp.n_expert_used:
            raise ModelLoadError(f"{gguf.path}: qwen3moe needs expert_count and expert_used_count")
        if not hp.n_ff_expert:  # older files: per-expert width = n_ff / experts used
            hp = replace(hp, n_ff_expert=hp.n_ff // hp.n_expert_used)
        return hp

    @classmethod
    def layer_tensors(cls, hp: HParams, i: int) -> list[LayerTensor]:
        return cls.attention_tensors(hp, qk_norm=True) + cls.moe_tensors(hp)

    def block(self, i: int, x: np.ndarray, fp: ForwardPass) -> np.ndarray:
        layer, eps = self.layers[i], self.hp.rms_eps
        x = self.attention_half(i, x, fp)
        h = ops.rms_norm(x, layer["ffn_norm"], eps)
        experts, weights = ops.moe_route_softmax_topk(ops.dense(h, layer["router"]), self.hp.n_expert_used, True)
        gate, up, down = layer["gate_exps"], layer["up_exps"], layer["down_exps"]
        return x + ops.moe_gated_ffn(h, experts, weights, lambda e: (gate.expert(e), up.expert(e), down.expert(e)))
