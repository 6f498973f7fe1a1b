"""qwen35 (Qwen3.5 / Qwen3.6, and Ternary-Bonsai-27B): a hybrid of linear and full attention.

- Three of every four layers are Gated DeltaNet (linear attention): a short causal depthwise
  convolution over the Q/K/V projection, L2-normed Q and K, and per value head a [key size ×
  value size] state that decays by exp(g), with g = softplus(α + dt bias) · a (a < 0), and
  takes the delta rule's correction β (v − Sᵀk); the output is the state read by q, RMS-normed
  per head and gated by SiLU(z). Value head j reads key head j mod (key heads): the GGUF
  converter tiles the value heads so.
- Every fourth layer (``full_attention_interval``, or the ``recurrent_layers`` flags) is
  gated full attention: Q carries an output gate per head ([q_h | gate_h] rows), per-head
  RMSNorm on Q and K, NEOX RoPE over the first ``rope.dimension_count`` dims of each head (the
  multi-section RoPE reduces to it for text: all three position axes are the token's
  position), and sigmoid(gate) on the attention output.
- ``post_attention_norm`` is the norm before the FFN (SwiGLU). Norm weights are stored as
  1 + w by the converter, so they are plain weights here; ``ssm_norm`` as it is.
- ``block_count`` counts the multi-token-prediction layers after the trunk; they are not run.

Only the full-attention layers keep KV. The linear layers' states (the convolution's last
inputs, and the delta-rule state) live in the sequence's cache beside it, which therefore
holds its whole length or nothing (``KVCache.rewindable``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from shared.errors import ModelLoadError
from worker.engine import kernels, ops
from worker.engine.kernels import recurrent
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
    LinearAttention,
    read_hparams,
)
from worker.engine.weights import MatmulInput


class Qwen35Model(DecoderModel):
    architecture = "qwen35"

    def read_hparams(self, gguf: GGUFFile) -> HParams:
        arch = self.architecture
        meta = gguf.metadata
        hp = read_hparams(gguf, arch)
        n_layer = hp.n_layer - int(meta.get(f"{arch}.nextn_predict_layers", 0) or 0)

        def need(key: str) -> int:
            value = meta.get(f"{arch}.{key}")
            if value is None:
                raise ModelLoadError(f"{gguf.path} lacks the required key {arch}.{key}")
            return int(value)

        value_heads = need("ssm.time_step_rank")
        linear = LinearAttention(conv_kernel=need("ssm.conv_kernel"), key_heads=need("ssm.group_count"),
                                 key_dim=need("ssm.state_size"), value_heads=value_heads,
                                 value_dim=need("ssm.inner_size") // value_heads)
        if linear.value_heads % linear.key_heads:
            raise ModelLoadError(f"{gguf.path}: {linear.value_heads} value heads do not tile "
                                 f"{linear.key_heads} key heads")
        flags = meta.get(f"{arch}.attention.recurrent_layers")
        interval = int(meta.get(f"{arch}.full_attention_interval", 4) or 4)
        recurrent = [bool(flags[i]) if flags is not None else (i + 1) % interval != 0 for i in range(n_layer)]
        layers = tuple(LayerShape(hp.n_head_kv, hp.head_dim, recurrent=r) for r in recurrent)
        return replace(hp, n_layer=n_layer, layers=layers, linear_attention=linear)

    @classmethod
    def ffn_tensors(cls, hp: HParams) -> list[LayerTensor]:
        """The dense SwiGLU after ``post_attention_norm``."""
        d, f = hp.n_embd, hp.n_ff
        return [LayerTensor("gate", "ffn_gate.weight", (f, d)),
                LayerTensor("up", "ffn_up.weight", (f, d)),
                LayerTensor("down", "ffn_down.weight", (d, f))]

    @classmethod
    def layer_tensors(cls, hp: HParams, i: int) -> list[LayerTensor]:
        d = hp.n_embd
        tensors = [LayerTensor("attn_norm", "attn_norm.weight", (d,), NORM),
                   LayerTensor("ffn_norm", "post_attention_norm.weight", (d,), NORM), *cls.ffn_tensors(hp)]
        if not hp.layer(i).recurrent:
            hd = hp.head_dim
            return tensors + [LayerTensor("wq", "attn_q.weight", (2 * hp.n_head * hd, d)),
                              LayerTensor("wk", "attn_k.weight", (hp.n_head_kv * hd, d)),
                              LayerTensor("wv", "attn_v.weight", (hp.n_head_kv * hd, d)),
                              LayerTensor("q_norm", "attn_q_norm.weight", (hd,), NORM),
                              LayerTensor("k_norm", "attn_k_norm.weight", (hd,), NORM),
                              LayerTensor("wo", "attn_output.weight", (d, hp.n_head * hd))]
        la = hp.linear_attention
        values = la.value_heads * la.value_dim
        return tensors + [LayerTensor("qkv", "attn_qkv.weight", (la.conv_channels, d)),
                          LayerTensor("z", "attn_gate.weight", (values, d)),
                          LayerTensor("conv", "ssm_conv1d.weight", (la.conv_channels, la.conv_kernel), DENSE),
                          LayerTensor("dt_bias", "ssm_dt.bias", (la.value_heads,), BIAS),
                          LayerTensor("a", "ssm_a", (la.value_heads,), BIAS),
                          LayerTensor("beta", "ssm_beta.weight", (la.value_heads, d)),
                          LayerTensor("alpha", "ssm_alpha.weight", (la.value_heads, d)),
                          LayerTensor("ssm_norm", "ssm_norm.weight", (la.value_dim,), NORM),
                          LayerTensor("ssm_out", "ssm_out.weight", (d, values))]

    def __init__(self, gguf: GGUFFile, exact: bool = False, kv_type: str = "f16"):
        super().__init__(gguf, exact, kv_type)
        # cache layer of each full-attention layer: only those keep KV
        full = [i for i in range(self.hp.n_layer) if not self.hp.layer(i).recurrent]
        self.kv_index = {layer: n for n, layer in enumerate(full)}

    def fused_layer(self, layer: dict[str, Any]) -> FusedLayer | None:
        return None  # gated Q and linear layers: the numpy steps, with the matmul kernels

    def block(self, i: int, x: np.ndarray, fp: ForwardPass) -> np.ndarray:
        layer, eps = self.layers[i], self.hp.rms_eps
        h = ops.rms_norm(x, layer["attn_norm"], eps)
        mixer = self.gated_delta_net if self.hp.layer(i).recurrent else self.gated_attention
        x = x + mixer(i, h, fp)
        return x + self.ffn(i, ops.rms_norm(x, layer["ffn_norm"], eps))

    def ffn(self, i: int, h: np.ndarray) -> np.ndarray:
        layer = self.layers[i]
        return ops.gated_ffn(h, layer["gate"], layer["up"], layer["down"], "silu")

    def gated_attention(self, i: int, h: np.ndarray, fp: ForwardPass) -> np.ndarray:
        hp, layer = self.hp, self.layers[i]
        n, hd = h.shape[0], hp.head_dim
        inp = MatmulInput(h)
        qg = ops.linear(inp, layer["wq"]).reshape(n, hp.n_head, 2 * hd)
        q = ops.rms_norm(np.ascontiguousarray(qg[..., :hd]), layer["q_norm"], hp.rms_eps)
        gate = qg[..., hd:].reshape(n, hp.n_head * hd)
        k = ops.rms_norm(ops.linear(inp, layer["wk"]).reshape(n, hp.n_head_kv, hd), layer["k_norm"], hp.rms_eps)
        v = ops.linear(inp, layer["wv"]).reshape(n, hp.n_head_kv, hd)
        cos, sin, adjacent = fp.rope[i]
        q, k = ops.apply_rope(q, cos, sin, adjacent), ops.apply_rope(k, cos, sin, adjacent)
        out = ops.attend(q, k, v, fp, self.kv_index[i], self.attention_options[i].scale)
        return ops.linear(out * ops.sigmoid(gate), layer["wo"])

    def gated_delta_net(self, i: int, h: np.ndarray, fp: ForwardPass) -> np.ndarray:
        hp, layer, la = self.hp, self.layers[i], self.hp.linear_attention
        n = h.shape[0]
        inp = MatmulInput(h)
        mixed = ops.linear(inp, layer["qkv"])  # [T, conv channels]
        z = ops.linear(inp, layer["z"]).reshape(n, la.value_heads, la.value_dim)
        beta = ops.sigmoid(ops.linear(inp, layer["beta"]))  # [T, value heads]
        g = ops.softplus(ops.linear(inp, layer["alpha"]) + layer["dt_bias"]) * layer["a"]  # < 0: a decay
        out = np.empty((n, la.value_heads, la.value_dim), dtype=np.float32)
        for cache, (start, end) in zip(fp.caches, fp.spans):
            out[start:end] = self._recurrence(i, cache, mixed[start:end], beta[start:end], g[start:end])
        out = ops.rms_norm(out, layer["ssm_norm"], hp.rms_eps) * ops.silu(z)
        return ops.linear(out.reshape(n, -1), layer["ssm_out"])

    def _recurrence(self, i: int, cache: KVCache, mixed: np.ndarray, beta: np.ndarray, g: np.ndarray) -> np.ndarray:
        """One sequence's new tokens through layer i's convolution and delta rule, from and
        into the states its cache holds; returns [t, value heads, value size]."""
        la, eps = self.hp.linear_attention, self.hp.rms_eps
        k_size = la.conv_kernel
        if i not in cache.recurrent:
            cache.recurrent[i] = [np.zeros((k_size - 1, la.conv_channels), dtype=np.float32),
                                  np.zeros((la.value_heads, la.key_dim, la.value_dim), dtype=np.float32)]
        conv_state, state = cache.recurrent[i]
        t = mixed.shape[0]
        conv, cache.recurrent[i][0] = ops.causal_conv(conv_state, mixed, self.layers[i]["conv"])
        conv = ops.silu(conv)
        keys = la.key_heads * la.key_dim
        q = conv[:, :keys].reshape(t, la.key_heads, la.key_dim)
        k = conv[:, keys:2 * keys].reshape(t, la.key_heads, la.key_dim)
        v = conv[:, 2 * keys:].reshape(t, la.value_heads, la.value_dim)
        q = q / np.sqrt(np.sum(q * q, axis=-1, keepdims=True) + eps)
        k = k / np.sqrt(np.sum(k * k, axis=-1, keepdims=True) + eps)
        q = q * np.float32(1.0 / np.sqrt(la.key_dim))
        tiles = la.value_heads // la.key_heads  # value head j reads key head j mod key heads
        q, k = np.tile(q, (1, tiles, 1)), np.tile(k, (1, tiles, 1))
        decay = np.exp(g)
        out = np.empty((t, la.value_heads, la.value_dim), dtype=np.float32)
        if kernels.available():
            f32 = np.float32
            return recurrent.gated_delta_rule(state, np.ascontiguousarray(q, f32), np.ascontiguousarray(k, f32),
                                              np.ascontiguousarray(v, f32), np.ascontiguousarray(decay, f32),
                                              np.ascontiguousarray(beta, f32), out)
        for step in range(t):
            state *= decay[step][:, None, None]
            read = np.einsum("hkv,hk->hv", state, k[step])
            delta = beta[step][:, None] * (v[step] - read)
            state += k[step][:, :, None] * delta[:, None, :]
            out[step] = np.einsum("hkv,hk->hv", state, q[step])
        return out

