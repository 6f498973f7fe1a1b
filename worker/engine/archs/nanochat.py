"""nanochat (Karpathy's), served from a checkpoint directory (``worker/engine/checkpoint.py``).

- the embedding RMS-normed (no weight: no norm here has one), untied output, logits cut to the
  tokenizer's vocabulary (the embedding is padded to a multiple of 64) and soft-capped (15)
- RoPE over rotate-half pairs by −θ (``freq_scale`` −1), then per-head Q/K RMSNorm; GQA
- a relu² MLP: ``down(relu(up x)²)``

The checkpoint's tensors decide what else the model does (nanochat grew these over 2026):

- ``resid_lambdas`` / ``x0_lambdas``: each layer's input is ``λ_r·x + λ_0·x0`` (x0: the normed
  embedding after the smear)
- ``value_embeds.N`` with ``ve_gate``: layer N adds to V a per-token value embedding, gated per
  KV head by ``3·σ(W·x[:12])`` of the attention's normed input
- ``smear_gate`` / ``smear_lambda``: each token's embedding gets ``λ·σ(w·x[:24])`` times the
  previous token's (the cache's last token, across steps); Q and K are scaled by 1.2 each (they
  came in together), and RoPE's base is 100000 then
- ``backout_lambda``: the output of the middle layer (n_layer // 2), times λ, is taken from the
  last one's
- ``window_pattern`` (``S``/``L`` per layer, tiled, the last layer always ``L``): S layers see
  the previous ⌈sequence_len / 4 / 128⌉·128 positions and themselves
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from worker.engine import ops
from worker.engine.gguf_file import GGUFFile
from worker.engine.model import NORM, TABLE, AttentionOptions, DecoderModel, ForwardPass, HParams, LayerTensor, Rope

SMEAR_CHANNELS = 24
VE_GATE_CHANNELS = 12
QK_SCALE = 1.2


class NanochatModel(DecoderModel):
    architecture = "nanochat"
    has_output_norm = False

    def __init__(self, gguf: GGUFFile, exact: bool = False, kv_type: str = "f16"):
        self.vocab = int(gguf.metadata.get("nanochat.vocab_size", 0))
        super().__init__(gguf, exact, kv_type)
        if self.vocab:  # logits past the tokenizer's vocabulary are cut off
            self.hp = replace(self.hp, n_vocab=min(self.vocab, self.hp.n_vocab))

    def read_hparams(self, gguf: GGUFFile) -> HParams:
        hp = super().read_hparams(gguf)
        meta = gguf.metadata
        self.smear = gguf.has_tensor("smear_gate.weight")
        self.reads_cache_tokens = self.smear  # the smear mixes in the cache's last token
        self.softcap = float(meta.get("nanochat.final_logit_softcapping", 15.0))
        pattern = str(meta.get("nanochat.window_pattern", "L")).upper()
        short = -(-hp.context_length // 4 // 128) * 128
        self.windows = [short + 1 if pattern[i % len(pattern)] == "S" and i < hp.n_layer - 1 else 0
                        for i in range(hp.n_layer)]
        return hp

    @classmethod
    def layer_tensors(cls, hp: HParams, i: int) -> list[LayerTensor]:
        d, f, kv = hp.n_embd, hp.n_ff, hp.n_head_kv * hp.head_dim
        return [LayerTensor("wq", "attn_q.weight", (hp.n_head * hp.head_dim, d)),
                LayerTensor("wk", "attn_k.weight", (kv, d)),
                LayerTensor("wv", "attn_v.weight", (kv, d)),
                LayerTensor("wo", "attn_output.weight", (d, hp.n_head * hp.head_dim)),
                LayerTensor("up", "ffn_up.weight", (f, d)),
                LayerTensor("down", "ffn_down.weight", (d, f)),
                LayerTensor("value_embd", "value_embd.weight", (hp.n_vocab, kv), TABLE, optional=True),
                LayerTensor("ve_gate", "ve_gate.weight", (hp.n_head_kv, VE_GATE_CHANNELS), NORM, optional=True)]

    @classmethod
    def global_tensors(cls, hp: HParams) -> list[LayerTensor]:
        n = hp.n_layer
        return [LayerTensor("resid_lambdas", "resid_lambdas", (n,), NORM, optional=True),
                LayerTensor("x0_lambdas", "x0_lambdas", (n,), NORM, optional=True),
                LayerTensor("smear_gate", "smear_gate.weight", (1, SMEAR_CHANNELS), NORM, optional=True),
                LayerTensor("smear_lambda", "smear_lambda", (1,), NORM, optional=True),
                LayerTensor("backout_lambda", "backout_lambda", (1,), NORM, optional=True)]

    def fused_layer(self, layer: dict[str, Any]) -> None:
        return None  # no norm weights, RoPE before the Q/K norms, relu²: the step-by-step path

    def rope(self, i: int) -> Rope:
        return Rope(self.hp.rope_base, self.hp.head_dim, freq_scale=-1.0)  # −θ

    def attention(self, i: int) -> AttentionOptions:
        scale = 1.0 / float(np.sqrt(self.hp.head_dim))
        return AttentionOptions(scale=scale * (QK_SCALE * QK_SCALE if self.smear else 1.0), window=self.windows[i])

    def layer_inputs(self, token_ids: np.ndarray, x: np.ndarray) -> dict[str, np.ndarray]:
        return {"ids": token_ids, "x0": x}

    def embed(self, token_ids: np.ndarray) -> np.ndarray:
        return ops.rms_norm(super().embed(token_ids), None, self.hp.rms_eps)

    def smeared(self, x: np.ndarray, fp: ForwardPass) -> np.ndarray:
        """Each row plus its gate times the previous token's normed embedding: the row before it,
        or for a sequence's first new row, the last token its cache holds."""
        gate = float(self.smear_lambda[0]) / (1.0 + np.exp(-(ops.dense(x[:, :SMEAR_CHANNELS], self.smear_gate)[:, 0])))
        previous = np.zeros_like(x)
        for cache, (start, end) in zip(fp.caches, fp.spans):
            previous[start + 1:end] = x[start:end - 1]
            if cache.length:
                previous[start] = self.embed(np.array([cache.tokens[cache.length - 1]]))[0]
            else:
                gate[start] = 0.0
        return x + gate[:, None].astype(np.float32) * previous

    def block(self, i: int, x: np.ndarray, fp: ForwardPass) -> np.ndarray:
        layer, hp, eps = self.layers[i], self.hp, self.hp.rms_eps
        inputs = fp.layer_inputs
        if i == 0 and self.smear:
            x = inputs["x0"] = self.smeared(x, fp)
        if hasattr(self, "resid_lambdas"):
            x = self.resid_lambdas[i] * x + self.x0_lambdas[i] * inputs["x0"]
        h = ops.rms_norm(x, None, eps)
        n = h.shape[0]
        q = ops.linear(h, layer["wq"]).reshape(n, hp.n_head, hp.head_dim)
        k = ops.linear(h, layer["wk"]).reshape(n, hp.n_head_kv, hp.head_dim)
        v = ops.linear(h, layer["wv"]).reshape(n, hp.n_head_kv, hp.head_dim)
        if "value_embd" in layer:
            gate = 3.0 / (1.0 + np.exp(-(ops.dense(h[:, :VE_GATE_CHANNELS], layer["ve_gate"]))))  # [T, K]
            v = v + gate[:, :, None].astype(np.float32) * layer["value_embd"].rows(inputs["ids"]).reshape(v.shape)
        cos, sin, _ = fp.rope[i]
        q = ops.rms_norm(ops.apply_rope(q, cos, sin), None, eps)
        k = ops.rms_norm(ops.apply_rope(k, cos, sin), None, eps)
        options = self.attention_options[i]
        x = x + ops.linear(ops.attend(q, k, v, fp, i, options.scale, options.window), layer["wo"])
        up = np.maximum(ops.linear(ops.rms_norm(x, None, eps), layer["up"]), 0.0)
        x = x + ops.linear(up * up, layer["down"])
        if hasattr(self, "backout_lambda"):
            if i == hp.n_layer // 2:
                inputs["middle"] = x
            if i == hp.n_layer - 1:
                x = x - self.backout_lambda[0] * inputs["middle"]
        return x

    def head_input(self, x: np.ndarray) -> np.ndarray:
        return ops.rms_norm(x, None, self.hp.rms_eps)

    def head_output(self, products: np.ndarray, start: int) -> np.ndarray:
        # the head's rows past the vocabulary (padding) give no logits
        return ops.softcap(products[:, :max(0, self.hp.n_vocab - start)], self.softcap)
