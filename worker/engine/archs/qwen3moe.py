"""qwen3moe (Qwen3 mixture of experts, e.g. Qwen3-30B-A3B).

- attention exactly as qwen3: per-head Q/K RMSNorm before half-split RoPE, GQA
- every block's FFN is a routed mixture: softmax over all experts, keep the top k,
  renormalize the kept weights to sum 1, weighted sum of SwiGLU experts; no shared expert
"""

from __future__ import annotations

from typing import Any

import numpy as np

from shared.errors import ModelLoadError
from worker.engine import ops
from worker.engine.gguf_file import GGUFFile
from worker.engine.model import DecoderModel, ForwardPass, HParams


class Qwen3MoeModel(DecoderModel):
    architecture = "qwen3moe"

    def read_hparams(self, gguf: GGUFFile) -> HParams:
        hp = super().read_hparams(gguf)
        if not hp.n_expert or not hp.n_expert_used:
            raise ModelLoadError(f"{gguf.path}: qwen3moe needs expert_count and expert_used_count")
        if not hp.n_ff_expert:  # older files: per-expert width = n_ff / experts used
            from dataclasses import replace
            hp = replace(hp, n_ff_expert=hp.n_ff // hp.n_expert_used)
        return hp

    def load_layer(self, gguf: GGUFFile, i: int) -> dict[str, Any]:
        hp = self.hp
        n_exp, n_ff, n_embd = hp.n_expert, hp.n_ff_expert, hp.n_embd
        return {
            "attn_norm": self.load_norm(gguf, f"blk.{i}.attn_norm.weight"),
            **self.load_qkv(gguf, i),
            "q_norm": self.load_norm(gguf, f"blk.{i}.attn_q_norm.weight", hp.head_dim),
            "k_norm": self.load_norm(gguf, f"blk.{i}.attn_k_norm.weight", hp.head_dim),
            "ffn_norm": self.load_norm(gguf, f"blk.{i}.ffn_norm.weight"),
            "router": gguf.tensor(f"blk.{i}.ffn_gate_inp.weight", (n_exp, n_embd)),
            # the experts stay in the file; a step reads only the blocks of those it routes to
            "gate_exps": self.load_weight(gguf, f"blk.{i}.ffn_gate_exps.weight", (n_exp, n_ff, n_embd)),
            "up_exps": self.load_weight(gguf, f"blk.{i}.ffn_up_exps.weight", (n_exp, n_ff, n_embd)),
            "down_exps": self.load_weight(gguf, f"blk.{i}.ffn_down_exps.weight", (n_exp, n_embd, n_ff)),
        }

    def block(self, i: int, x: np.ndarray, fp: ForwardPass) -> np.ndarray:
        layer, eps = self.layers[i], self.hp.rms_eps
        x = self.attention_half(i, x, fp)  # with per-head Q/K RMSNorm, before RoPE
        h = ops.rms_norm(x, layer["ffn_norm"], eps)
        experts, weights = ops.moe_route_softmax_topk(h @ layer["router"].T, self.hp.n_expert_used, True)
        return x + ops.moe_swiglu(h, experts, weights, layer["gate_exps"], layer["up_exps"], layer["down_exps"])
