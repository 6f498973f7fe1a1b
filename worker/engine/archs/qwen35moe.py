"""qwen35moe (Qwen3.5 / Qwen3.6 mixture of experts, e.g. Qwen3.5-35B-A3B): qwen35's hybrid of
Gated DeltaNet and gated full attention, with a mixture for every FFN.

- routed experts: softmax over all experts, the top k kept and renormalized to sum 1, a
  weighted sum of SwiGLU experts (gate and up stacked apart, or fused as ``ffn_gate_up_exps``)
- plus a shared SwiGLU expert of its own width (``expert_shared_feed_forward_length``), scaled
  by sigmoid(x · ``ffn_gate_inp_shexp``)
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from shared.errors import ModelLoadError
from worker.engine import ops
from worker.engine.archs.qwen35 import Qwen35Model
from worker.engine.gguf_file import GGUFFile
from worker.engine.model import BIAS, DENSE, HParams, LayerTensor


class Qwen35MoeModel(Qwen35Model):
    architecture = "qwen35moe"

    def read_hparams(self, gguf: GGUFFile) -> HParams:
        hp = super().read_hparams(gguf)
        shared = gguf.metadata.get(f"{self.architecture}.expert_shared_feed_forward_length")
        if not hp.n_expert or not hp.n_expert_used or not hp.n_ff_expert or not shared:
            raise ModelLoadError(f"{gguf.path}: qwen35moe needs expert_count, expert_used_count, "
                                 "expert_feed_forward_length and expert_shared_feed_forward_length")
        return replace(hp, n_ff=int(shared))  # the dense width is the shared expert's

    @classmethod
    def ffn_tensors(cls, hp: HParams) -> list[LayerTensor]:
        d, f, n, shared = hp.n_embd, hp.n_ff_expert, hp.n_expert, hp.n_ff
        return [LayerTensor("router", "ffn_gate_inp.weight", (n, d), DENSE),
                LayerTensor("gate_exps", "ffn_gate_exps.weight", (n, f, d), optional=True),
                LayerTensor("up_exps", "ffn_up_exps.weight", (n, f, d), optional=True),
                LayerTensor("gate_up_exps", "ffn_gate_up_exps.weight", (n, 2 * f, d), optional=True),
                LayerTensor("down_exps", "ffn_down_exps.weight", (n, d, f)),
                LayerTensor("shexp_gate_inp", "ffn_gate_inp_shexp.weight", (d,), BIAS),
                LayerTensor("shexp_gate", "ffn_gate_shexp.weight", (shared, d)),
                LayerTensor("shexp_up", "ffn_up_shexp.weight", (shared, d)),
                LayerTensor("shexp_down", "ffn_down_shexp.weight", (d, shared))]

    def load_layer(self, gguf: GGUFFile, i: int) -> dict:
        layer = super().load_layer(gguf, i)
        if "gate_up_exps" not in layer and not {"gate_exps", "up_exps"} <= set(layer):
            raise ModelLoadError(f"{gguf.path}: layer {i} has neither ffn_gate_up_exps nor ffn_gate_exps "
                                 "and ffn_up_exps")
        return layer

    def ffn(self, i: int, h: np.ndarray) -> np.ndarray:
        layer, f = self.layers[i], self.hp.n_ff_expert
        experts, weights = ops.moe_route_softmax_topk(ops.dense(h, layer["router"]), self.hp.n_expert_used, True)
        down = layer["down_exps"]

        def expert(e: int):
            if "gate_up_exps" in layer:
                both = layer["gate_up_exps"].expert(e)
                return both.row_range(0, f), both.row_range(f, 2 * f), down.expert(e)
            return layer["gate_exps"].expert(e), layer["up_exps"].expert(e), down.expert(e)

        routed = ops.moe_gated_ffn(h, experts, weights, expert)
        shared = ops.gated_ffn(h, layer["shexp_gate"], layer["shexp_up"], layer["shexp_down"], "silu")
        return routed + shared * ops.sigmoid(ops.dense(h, layer["shexp_gate_inp"][None, :]))
