"""inkling (Thinking Machines' Inkling and Inkling-Small): attention without RoPE, positions
told by a learned relative bias, and short convolutions around every mixer.

- No rotation: position enters through a bias on the scores. Each layer projects the normed
  input to ``d_rel`` coefficients per head (``attn_r``); mixed through the layer's bank
  ``attn_rel_proj`` [d_rel, E] they give one bias per backward distance 0 … E − 1, added to
  the score of the key that far back (nothing beyond E). E is ``rel_extent`` on global layers
  and ``rel_extent_swa`` (the window) on sliding ones.
- Scores are q·k / head size (Q and K are RMS-normed per head, which fixes their size), causal,
  over the window on sliding layers (``attention.sliding_window_pattern``, true for sliding;
  by default every sixth layer is global). KV heads may differ per layer.
- Global layers scale Q and the bias by τ = 1 + α·ln(max((position + 1) / n_floor, 1)) when
  the file names an ``n_floor`` (``log_scaling_n_floor``; 0 for none).
- Four causal depthwise convolutions of width K per layer, each with its input added back,
  ``sconv(y) = y + conv(y)``: on K and V after their projections (before the K norm), on the
  attention output after ``attn_output``, and on the FFN output; the layer's residuals come on
  top. Their last K − 1 inputs are state the sequence's cache holds beside its KV, as qwen35's
  linear layers do, so the cache holds its whole length or nothing.
- The first ``dense_block_count`` layers have a SwiGLU FFN; the rest a mixture: the router
  ``ffn_gate_inp`` scores the routed experts and, in its last rows, the shared ones; the top k
  routed by sigmoid(logit) + ``exp_probs_b``; the chosen and the shared weighted by their
  sigmoids normalized to sum 1, times ``expert_weights_scale``. Every FFN output is times the
  layer's ``ffn_gscale``.
- The embedding is RMS-normed (``token_embd_norm``); the output head is untied, fed the final
  norm divided by ``logit_scale_denom``; ids from ``unpadded_vocab_size`` on are padding and
  never sampled (their logits are −∞).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from shared.errors import ModelLoadError
from worker.engine import ops
from worker.engine.gguf_file import GGUFFile
from worker.engine.kv_cache import KVCache
from worker.engine.model import (
    BIAS,
    DENSE,
    NORM,
    DecoderModel,
    ForwardPass,
    FusedLayer,
    HParams,
    LayerShape,
    LayerTensor,
    Rope,
    read_hparams,
)
from worker.engine.weights import MatmulInput

SCONV_K, SCONV_V, SCONV_ATTN, SCONV_MLP = range(4)  # a layer's convolution states, in order


@dataclass(frozen=True)
class InklingShape:
    """What only inkling's layers need: the relative bias's width and extents, the
    convolutions' width, the leading dense layers, shared experts, the output's scale and
    real vocabulary, and the global layers' length scaling (n_floor 0: none)."""

    d_rel: int
    rel_extent: int
    rel_extent_swa: int
    conv_kernel: int
    dense_layers: int
    n_shared: int
    route_scale: float
    logit_scale_denom: float
    unpadded_vocab: int
    log_n_floor: int = 0
    log_alpha: float = 0.0


class InklingModel(DecoderModel):
    architecture = "inkling"

    def read_hparams(self, gguf: GGUFFile) -> HParams:
        meta, arch = gguf.metadata, self.architecture
        hp = read_hparams(gguf, arch, frozenset({"attention.head_count_kv"}))
        n = hp.n_layer

        def need(key: str) -> Any:
            value = meta.get(f"{arch}.{key}")
            if value is None:
                raise ModelLoadError(f"{gguf.path} lacks the required key {arch}.{key}")
            return value

        kv = meta.get(f"{arch}.attention.head_count_kv", hp.n_head)
        kv_heads = [int(v) for v in kv] if isinstance(kv, list) else [int(kv)] * n
        pattern = meta.get(f"{arch}.attention.sliding_window_pattern")
        local = [bool(v) for v in pattern] if isinstance(pattern, list) else [i % 6 != 5 for i in range(n)]
        if len(kv_heads) != n or len(local) != n:
            raise ModelLoadError(f"{gguf.path}: per-layer KV heads or sliding pattern do not have {n} values")
        for i, heads in enumerate(kv_heads):
            if hp.n_head % heads:
                raise ModelLoadError(f"{gguf.path}: layer {i}: {hp.n_head} query heads do not split into "
                                     f"{heads} KV heads")
        self.sliding_window = int(need("attention.sliding_window"))
        family = InklingShape(
            d_rel=int(need("d_rel")), rel_extent=int(need("rel_extent")),
            rel_extent_swa=int(meta.get(f"{arch}.rel_extent_swa", self.sliding_window)),
            conv_kernel=int(need("shortconv_kernel")),
            dense_layers=int(meta.get(f"{arch}.dense_block_count", 0) or 0),
            n_shared=int(meta.get(f"{arch}.expert_shared_count", 0) or 0),
            route_scale=float(meta.get(f"{arch}.expert_weights_scale", 1.0) or 1.0),
            logit_scale_denom=float(meta.get(f"{arch}.logit_scale_denom", 1.0) or 1.0),
            unpadded_vocab=int(meta.get(f"{arch}.unpadded_vocab_size", 0) or 0),
            log_n_floor=int(meta.get(f"{arch}.log_scaling_n_floor", 0) or 0),
            log_alpha=float(meta.get(f"{arch}.log_scaling_alpha", 0.0) or 0.0))
        if family.dense_layers < n and (not hp.n_expert or not hp.n_expert_used or not hp.n_ff_expert):
            raise ModelLoadError(f"{gguf.path}: inkling's mixture layers need expert_count, expert_used_count "
                                 "and expert_feed_forward_length")
        layers = tuple(LayerShape(heads, hp.head_dim, is_local) for heads, is_local in zip(kv_heads, local))
        return replace(hp, layers=layers, family=family)

    @classmethod
    def global_tensors(cls, hp: HParams) -> list[LayerTensor]:
        return [LayerTensor("embed_norm", "token_embd_norm.weight", (hp.n_embd,), NORM)]

    @classmethod
    def layer_tensors(cls, hp: HParams, i: int) -> list[LayerTensor]:
        family: InklingShape = hp.family
        d, hd, shape = hp.n_embd, hp.head_dim, hp.layer(i)
        kv_width = shape.n_head_kv * hd
        extent = family.rel_extent_swa if shape.local else family.rel_extent
        k_size = family.conv_kernel
        tensors = [LayerTensor("attn_norm", "attn_norm.weight", (d,), NORM),
                   LayerTensor("wq", "attn_q.weight", (hp.n_head * hd, d)),
                   LayerTensor("wk", "attn_k.weight", (kv_width, d)),
                   LayerTensor("wv", "attn_v.weight", (kv_width, d)),
                   LayerTensor("wr", "attn_r.weight", (hp.n_head * family.d_rel, d)),
                   LayerTensor("wo", "attn_output.weight", (d, hp.n_head * hd)),
                   LayerTensor("q_norm", "attn_q_norm.weight", (hd,), NORM),
                   LayerTensor("k_norm", "attn_k_norm.weight", (hd,), NORM),
                   LayerTensor("rel_proj", "attn_rel_proj.weight", (family.d_rel, extent), DENSE),
                   LayerTensor("sconv_k", "shortconv_k.weight", (kv_width, k_size), DENSE),
                   LayerTensor("sconv_v", "shortconv_v.weight", (kv_width, k_size), DENSE),
                   LayerTensor("sconv_attn", "shortconv_attn.weight", (d, k_size), DENSE),
                   LayerTensor("sconv_mlp", "shortconv_mlp.weight", (d, k_size), DENSE),
                   LayerTensor("ffn_norm", "ffn_norm.weight", (d,), NORM),
                   LayerTensor("gscale", "ffn_gscale.weight", (1,), BIAS)]
        if i < family.dense_layers:
            f = hp.n_ff
            return tensors + [LayerTensor("gate", "ffn_gate.weight", (f, d)),
                              LayerTensor("up", "ffn_up.weight", (f, d)),
                              LayerTensor("down", "ffn_down.weight", (d, f))]
        n, s, f = hp.n_expert, family.n_shared, hp.n_ff_expert
        return tensors + [LayerTensor("router", "ffn_gate_inp.weight", (n + s, d), DENSE),
                          LayerTensor("router_bias", "exp_probs_b.bias", (n,), BIAS),
                          LayerTensor("gate_exps", "ffn_gate_exps.weight", (n, f, d)),
                          LayerTensor("up_exps", "ffn_up_exps.weight", (n, f, d)),
                          LayerTensor("down_exps", "ffn_down_exps.weight", (n, d, f)),
                          LayerTensor("gate_shexp", "ffn_gate_shexp.weight", (s, f, d)),
                          LayerTensor("up_shexp", "ffn_up_shexp.weight", (s, f, d)),
                          LayerTensor("down_shexp", "ffn_down_shexp.weight", (s, d, f))]

    def rope_freq_factors(self, gguf: GGUFFile) -> None:
        return None

    def rope(self, i: int) -> Rope:
        return Rope(10000.0, 0)  # no rotation: an empty table, which no layer reads

    def fused_layer(self, layer: dict[str, Any]) -> FusedLayer | None:
        return None  # the relative bias and the convolutions: the numpy steps

    def new_cache(self, max_tokens: int) -> KVCache:
        cache = super().new_cache(max_tokens)
        cache.rewindable = False  # the convolutions' states hold the end of what was read
        return cache

    def embed(self, token_ids: np.ndarray) -> np.ndarray:
        return ops.rms_norm(super().embed(token_ids), self.embed_norm, self.hp.rms_eps)

    def head_input(self, x: np.ndarray) -> np.ndarray:
        family: InklingShape = self.hp.family
        return ops.rms_norm(x, self.output_norm, self.hp.rms_eps) * np.float32(1.0 / family.logit_scale_denom)

    def head_output(self, products: np.ndarray, start: int) -> np.ndarray:
        unpadded = self.hp.family.unpadded_vocab
        if 0 < unpadded < start + products.shape[1]:  # the padding's entries are never chosen
            products[:, max(0, unpadded - start):] = -np.inf
        return products

    # --- the block -------------------------------------------------------------------------------

    def block(self, i: int, x: np.ndarray, fp: ForwardPass) -> np.ndarray:
        layer, eps = self.layers[i], self.hp.rms_eps
        h = ops.rms_norm(x, layer["attn_norm"], eps)
        x = x + self.sconv(i, SCONV_ATTN, self.attention_with_bias(i, h, fp), fp)
        h = ops.rms_norm(x, layer["ffn_norm"], eps)
        ffn = self.dense_ffn(i, h) if "router" not in layer else self.mixture(i, h)
        return x + self.sconv(i, SCONV_MLP, ffn, fp)

    def sconv(self, i: int, which: int, y: np.ndarray, fp: ForwardPass) -> np.ndarray:
        """y + the causal depthwise convolution of y, per sequence, from and into the states
        its cache holds for layer i."""
        weight = self.layers[i][("sconv_k", "sconv_v", "sconv_attn", "sconv_mlp")[which]]  # [C, K]
        k_size = weight.shape[1]
        out = np.empty_like(y)
        for cache, (start, end) in zip(fp.caches, fp.spans):
            states = cache.recurrent.get(i)
            if states is None:
                states = cache.recurrent[i] = [np.zeros((k_size - 1, self.layers[i][name].shape[0]), np.float32)
                                               for name in ("sconv_k", "sconv_v", "sconv_attn", "sconv_mlp")]
            conv, states[which] = ops.causal_conv(states[which], y[start:end], weight)
            out[start:end] = y[start:end] + conv
        return out

    def attention_with_bias(self, i: int, h: np.ndarray, fp: ForwardPass) -> np.ndarray:
        hp, layer, family = self.hp, self.layers[i], self.hp.family
        shape = hp.layer(i)
        n, hd = h.shape[0], hp.head_dim
        inp = MatmulInput(h)
        q = ops.rms_norm(ops.linear(inp, layer["wq"]).reshape(n, hp.n_head, hd), layer["q_norm"], hp.rms_eps)
        k = self.sconv(i, SCONV_K, ops.linear(inp, layer["wk"]), fp).reshape(n, shape.n_head_kv, hd)
        k = ops.rms_norm(k, layer["k_norm"], hp.rms_eps)
        v = self.sconv(i, SCONV_V, ops.linear(inp, layer["wv"]), fp).reshape(n, shape.n_head_kv, hd)
        r = ops.linear(inp, layer["wr"]).reshape(n, hp.n_head, family.d_rel)
        rel = np.ascontiguousarray(np.einsum("thr,re->the", r, layer["rel_proj"]), dtype=np.float32)  # [T, H, E]
        if not shape.local and family.log_n_floor:  # τ(position) scales the queries and the bias
            tau = 1.0 + family.log_alpha * np.log(np.maximum((fp.positions + 1) / family.log_n_floor, 1.0))
            tau = tau.astype(np.float32)[:, None, None]
            q, rel = q * tau, rel * tau
        window = self.sliding_window if shape.local else 0
        return ops.linear(ops.attend(q, k, v, fp, i, 1.0 / hd, window, bias=rel), layer["wo"])

    def dense_ffn(self, i: int, h: np.ndarray) -> np.ndarray:
        layer = self.layers[i]
        return ops.gated_ffn(h, layer["gate"], layer["up"], layer["down"], "silu") * layer["gscale"][0]

    def mixture(self, i: int, h: np.ndarray) -> np.ndarray:
        layer, family, hp = self.layers[i], self.hp.family, self.hp
        logits = h @ layer["router"].T  # [T, routed + shared]
        routed, shared = logits[:, :hp.n_expert], logits[:, hp.n_expert:]
        choice = ops.sigmoid(routed) + layer["router_bias"]
        experts = np.argpartition(-choice, hp.n_expert_used - 1, axis=-1)[:, :hp.n_expert_used]
        kept = ops.sigmoid(np.concatenate([np.take_along_axis(routed, experts, axis=-1), shared], axis=-1))
        weights = kept / kept.sum(axis=-1, keepdims=True) * np.float32(family.route_scale * layer["gscale"][0])
        gate, up, down = layer["gate_exps"], layer["up_exps"], layer["down_exps"]
        out = ops.moe_gated_ffn(h, experts, weights[:, :hp.n_expert_used],
                                lambda e: (gate.expert(e), up.expert(e), down.expert(e)))
        for s in range(family.n_shared):
            expert = (layer["gate_shexp"].expert(s), layer["up_shexp"].expert(s), layer["down_shexp"].expert(s))
            out += ops.gated_ffn(h, *expert, "silu") * weights[:, hp.n_expert_used + s, None]
        return out

