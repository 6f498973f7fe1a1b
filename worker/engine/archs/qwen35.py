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
- ``block_count`` counts the multi-token-prediction (MTP) blocks after the trunk
  (``nextn_predict_layers``); the forward pass never runs them. They are a draft source for
  speculative decoding (``mtp_draft``), below.

Only the full-attention layers keep KV. The linear layers' states (the convolution's last
inputs, and the delta-rule state) live in the sequence's cache beside it, which therefore
holds its whole length or nothing (``KVCache.rewindable``).

The MTP block predicts the token after next. Its row at position p reads the token at p and
the trunk's final state at p − 1 (after ``output_norm``, what ``forward(hidden_out=)`` gives;
zeros before position 0): each is RMS-normed (``nextn.enorm``, ``nextn.hnorm``), the two are
joined [embedding | state] and projected back to n_embd (``nextn.eh_proj``), and the result
goes through one gated full-attention block like the trunk's (its FFN the family's), with KV
of its own (``MtpState.cache``, one layer, rewindable). ``nextn.shared_head_norm`` (else
``output_norm``) and the output head then give its logits; that normed state also stands in
for the trunk's when a draft goes on past its first token. The optional
``nextn.embed_tokens`` and ``nextn.shared_head_head`` replace the model's embedding and head.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
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
    MATRIX,
    TABLE,
    LayerTensor,
    LinearAttention,
    read_hparams,
)
from worker.engine.weights import MatmulInput


@dataclass
class MtpState:
    """One sequence's MTP drafting state: the MTP block's KV over the positions the sequence
    has kept (one layer, rewindable; its length is the next token's position), and the
    trunk's final state at the last of them (``last_hidden`` [n_embd]: zeros before any), which
    the next position's row reads."""

    cache: KVCache
    last_hidden: np.ndarray

    def truncate(self, length: int, hidden: np.ndarray | None = None) -> None:
        """Keep the first ``length`` positions; ``hidden`` is the trunk's final state at
        position length − 1 (None: zeros, as before position 0)."""
        self.cache.truncate(length)
        self.last_hidden = (np.zeros_like(self.last_hidden) if hidden is None
                            else np.asarray(hidden, dtype=np.float32).reshape(self.last_hidden.shape).copy())


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
        """Layer i of the trunk; from ``hp.n_layer`` on, an MTP block (``mtp_tensors``)."""
        if i >= hp.n_layer:
            return cls.mtp_tensors(hp)
        d = hp.n_embd
        tensors = [LayerTensor("attn_norm", "attn_norm.weight", (d,), NORM),
                   LayerTensor("ffn_norm", "post_attention_norm.weight", (d,), NORM), *cls.ffn_tensors(hp)]
        if not hp.layer(i).recurrent:
            return tensors + cls.gated_attention_tensors(hp)
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

    @staticmethod
    def gated_attention_tensors(hp: HParams) -> list[LayerTensor]:
        """Q with its output gate ([q_h | gate_h] rows per head), K, V, per-head Q/K norms, output."""
        d, hd = hp.n_embd, hp.head_dim
        return [LayerTensor("wq", "attn_q.weight", (2 * hp.n_head * hd, d)),
                LayerTensor("wk", "attn_k.weight", (hp.n_head_kv * hd, d)),
                LayerTensor("wv", "attn_v.weight", (hp.n_head_kv * hd, d)),
                LayerTensor("q_norm", "attn_q_norm.weight", (hd,), NORM),
                LayerTensor("k_norm", "attn_k_norm.weight", (hd,), NORM),
                LayerTensor("wo", "attn_output.weight", (d, hp.n_head * hd))]

    @classmethod
    def mtp_tensors(cls, hp: HParams) -> list[LayerTensor]:
        """An MTP block: a gated full-attention block of the family, and the ``nextn.`` tensors
        that feed it (the two input norms, the projection of [embedding | state]) and read it
        out (its head norm; its own embedding and head where the file has them)."""
        d = hp.n_embd
        return [LayerTensor("attn_norm", "attn_norm.weight", (d,), NORM),
                LayerTensor("ffn_norm", "post_attention_norm.weight", (d,), NORM), *cls.ffn_tensors(hp),
                *cls.gated_attention_tensors(hp),
                LayerTensor("enorm", "nextn.enorm.weight", (d,), NORM),
                LayerTensor("hnorm", "nextn.hnorm.weight", (d,), NORM),
                LayerTensor("eh_proj", "nextn.eh_proj.weight", (d, 2 * d)),
                LayerTensor("head_norm", "nextn.shared_head_norm.weight", (d,), NORM, optional=True),
                LayerTensor("embed", "nextn.embed_tokens.weight", (hp.n_vocab, d), TABLE, optional=True),
                LayerTensor("head", "nextn.shared_head_head.weight", (hp.n_vocab, d), MATRIX, optional=True)]

    def __init__(self, gguf: GGUFFile, exact: bool = False, kv_type: str = "f16"):
        super().__init__(gguf, exact, kv_type)
        # cache layer of each full-attention layer: only those keep KV
        full = [i for i in range(self.hp.n_layer) if not self.hp.layer(i).recurrent]
        self.kv_index = {layer: n for n, layer in enumerate(full)}
        # the MTP blocks follow the trunk in ``layers``, as in the file (blk.n_layer …)
        n_mtp = int(gguf.metadata.get(f"{self.architecture}.nextn_predict_layers", 0) or 0)
        self.layers += [self.load_layer(gguf, self.hp.n_layer + j) for j in range(n_mtp)]
        self.mtp_layers = n_mtp
        rope = self.rope(full[0] if full else 0)
        self.mtp_rope = (rope.inverse_frequencies(), rope.adjacent)

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
        return self.gated_attention_of(self.layers[i], h, fp, fp.rope[i], self.kv_index[i],
                                       self.attention_options[i].scale)

    def gated_attention_of(self, layer: dict[str, Any], h: np.ndarray, fp: ForwardPass,
                           rope: tuple[np.ndarray, np.ndarray, bool], cache_layer: int, scale: float) -> np.ndarray:
        """A gated full-attention layer's weights on normed rows h [T, D], rotated by ``rope``
        (cos, sin, adjacent), its KV in the caches' ``cache_layer``. Returns [T, D]."""
        hp = self.hp
        n, hd = h.shape[0], hp.head_dim
        inp = MatmulInput(h)
        qg = ops.linear(inp, layer["wq"]).reshape(n, hp.n_head, 2 * hd)
        q = ops.rms_norm(np.ascontiguousarray(qg[..., :hd]), layer["q_norm"], hp.rms_eps)
        gate = qg[..., hd:].reshape(n, hp.n_head * hd)
        k = ops.rms_norm(ops.linear(inp, layer["wk"]).reshape(n, hp.n_head_kv, hd), layer["k_norm"], hp.rms_eps)
        v = ops.linear(inp, layer["wv"]).reshape(n, hp.n_head_kv, hd)
        cos, sin, adjacent = rope
        q, k = ops.apply_rope(q, cos, sin, adjacent), ops.apply_rope(k, cos, sin, adjacent)
        out = ops.attend(q, k, v, fp, cache_layer, scale)
        return ops.linear(out * ops.sigmoid(gate), layer["wo"])

    # --- the MTP block as a draft source ----------------------------------------------------------

    def new_mtp_state(self, max_tokens: int) -> MtpState:
        """An empty MTP state for a sequence of up to ``max_tokens`` positions (drafts included)."""
        if not self.mtp_layers:
            raise ValueError(f"{self.path} has no MTP layers (nextn_predict_layers)")
        hp = self.hp
        cache = KVCache(1, hp.n_head_kv, hp.head_dim, max_tokens, hp.head_dim, self.kv_type)
        return MtpState(cache, np.zeros(hp.n_embd, dtype=np.float32))

    def mtp_forward(self, cache: KVCache, tokens: list[int], hidden: np.ndarray,
                    logits: bool = True) -> tuple[np.ndarray, np.ndarray] | None:
        """The first MTP block on rows of one sequence: token j at position cache.length + j,
        read with ``hidden[j]`` [n_embd], the trunk's final state at the position before it.
        The cache grows by the tokens. Returns logits [T, n_vocab] and the block's normed
        output state [T, n_embd], or None without ``logits``."""
        hp, eps = self.hp, self.hp.rms_eps
        i = hp.n_layer
        layer, n = self.layers[i], len(tokens)
        ids = np.asarray(tokens, dtype=np.int64)
        cache.reserve(n)
        positions = np.arange(cache.length, cache.length + n)
        inv_freq, adjacent = self.mtp_rope
        rope = (*ops.rope_cos_sin(positions, inv_freq), adjacent)
        fp = ForwardPass([cache], [(0, n)], [rope], positions)
        embedded = layer["embed"].rows(ids) if "embed" in layer else self.embed(ids)
        # [RMSNorm(embedding) | RMSNorm(state)] [T, 2D] -> [T, D]
        joined = np.concatenate([ops.rms_norm(embedded, layer["enorm"], eps),
                                 ops.rms_norm(np.asarray(hidden, dtype=np.float32).reshape(n, hp.n_embd),
                                              layer["hnorm"], eps)], axis=1)
        x = ops.linear(joined, layer["eh_proj"])
        h = ops.rms_norm(x, layer["attn_norm"], eps)
        x = x + self.gated_attention_of(layer, h, fp, rope, 0, self.attention(i).scale)
        x = x + self.ffn(i, ops.rms_norm(x, layer["ffn_norm"], eps))
        cache.commit(tokens)
        if not logits:
            return None
        state = ops.rms_norm(x, layer.get("head_norm", self.output_norm), eps)
        return np.ascontiguousarray(ops.linear(state, layer.get("head", self.output))), state

    def mtp_accept(self, state: MtpState, tokens: list[int], hidden: np.ndarray) -> None:
        """Give the MTP block a sequence's newly kept tokens (in order, from the position
        ``state`` holds up to) with the trunk's final states at their positions, [T, n_embd]
        (``forward``'s ``hidden_out`` rows of them)."""
        if not tokens:
            return
        hidden = np.asarray(hidden, dtype=np.float32).reshape(len(tokens), self.hp.n_embd)
        before = np.concatenate([state.last_hidden[None, :], hidden[:-1]])  # each token reads the state before it
        self.mtp_forward(state.cache, tokens, before, logits=False)
        state.last_hidden = hidden[-1].copy()

    def mtp_draft(self, state: MtpState, token: int, limit: int) -> list[int]:
        """Up to ``limit`` greedy guesses of the tokens after ``token``, the sequence's next
        token (sampled, not yet kept: its position is the state's length). Each guess is the
        argmax of one MTP row; a row past the first reads the previous row's own state. The
        state is left as it was."""
        start, drafts, hidden = state.cache.length, [], state.last_hidden
        try:
            for _ in range(max(0, limit)):
                logits, states = self.mtp_forward(state.cache, [token], hidden[None, :])
                token, hidden = int(np.argmax(logits[0])), states[0]
                drafts.append(token)
        finally:
            state.cache.truncate(start)
        return drafts

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

