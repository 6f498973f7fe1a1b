"""The decoder-only transformer every architecture file fills in.

An architecture subclass declares what it reads (hyperparameters), what it loads (tensors by
their GGUF names) and its block (``block``); this base class owns what all of them share: the
embedding, the output head, the forward pass over a batch of sequences and its KV caches, and
the attention step with RoPE.

One ``forward`` call runs one weight pass for several sequences at once: the new tokens of all
of them are stacked into one [T, D] matrix for every projection, and only attention, which
reads each sequence's own cache, is done per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar

import numpy as np

from shared.errors import ModelLoadError
from worker.engine import kernels, ops
from worker.engine.gguf_file import GGUFFile
from worker.engine.kernels import fused
from worker.engine.kv_cache import KV_TYPES, KVCache
from worker.engine.weights import MatmulInput, QuantizedWeight, Weight


@dataclass(frozen=True)
class HParams:
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    value_dim: int
    n_ff: int
    context_length: int
    rope_base: float
    rope_dims: int
    rope_freq_scale: float
    rms_eps: float
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_expert: int = 0


def read_hparams(gguf: GGUFFile, arch: str) -> HParams:
    """The hyperparameters every family shares, with llama.cpp's defaults where a key is absent."""
    meta = gguf.metadata

    def get(key: str, default: Any = None, required: bool = False) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None and required:
            raise ModelLoadError(f"{gguf.path} lacks the required key {arch}.{key}")
        return value

    def scalar(value: Any) -> Any:
        # per-layer arrays are allowed by the format; these families use one value for all layers
        if isinstance(value, list):
            if len(set(value)) != 1:
                raise ModelLoadError(f"{gguf.path}: per-layer values {value[:8]}… are not supported")
            return value[0]
        return value

    n_embd = int(get("embedding_length", required=True))
    n_head = int(scalar(get("attention.head_count", required=True)))
    n_head_kv = int(scalar(get("attention.head_count_kv", n_head)))
    head_dim = int(get("attention.key_length", n_embd // n_head))
    tokens = meta.get("tokenizer.ggml.tokens")
    n_vocab = int(get("vocab_size", len(tokens) if tokens else 0))
    if n_head % n_head_kv:
        raise ModelLoadError(f"{gguf.path}: {n_head} query heads do not split into {n_head_kv} KV heads")
    scaling_factor = float(get("rope.scaling.factor", 0.0) or 0.0)
    return HParams(
        n_vocab=n_vocab,
        n_embd=n_embd,
        n_layer=int(get("block_count", required=True)),
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        value_dim=int(get("attention.value_length", head_dim)),
        n_ff=int(scalar(get("feed_forward_length", 0))),
        context_length=int(get("context_length", 4096)),
        rope_base=float(get("rope.freq_base", 10000.0)),
        rope_dims=int(get("rope.dimension_count", head_dim)),
        rope_freq_scale=1.0 / scaling_factor if scaling_factor else 1.0,
        rms_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        n_expert=int(get("expert_count", 0) or 0),
        n_expert_used=int(get("expert_used_count", 0) or 0),
        n_ff_expert=int(get("expert_feed_forward_length", 0) or 0),
    )


@dataclass
class ForwardPass:
    """Per-call state the blocks need: where each sequence's rows are and their positions."""

    caches: list[KVCache]
    spans: list[tuple[int, int]]  # row range of each sequence in the stacked [T, D] input
    cos: np.ndarray  # [T, rope_dims/2] for every stacked row
    sin: np.ndarray


@dataclass(frozen=True)
class FusedLayer:
    """A layer's weights as the compiled block steps (``kernels/fused.py``) take them."""

    attention: tuple  # attention_inputs' arguments after x: norm, eps, wq, wk, wv, kinds, bq, bk, bv, q_norm, k_norm
    output: tuple  # attention_output's after x and attn: wo, kind
    swiglu: tuple | None  # swiglu's after x: norm, eps, wg, wu, wd, kinds, n_ff (None: not a SwiGLU layer)


class DecoderModel:
    """Base of every architecture: subclasses set ``architecture`` and fill in the hooks."""

    architecture: ClassVar[str]
    # RoPE pairs: (i, i + d/2) by default; (2i, 2i + 1) where the file's Q/K rows are ordered so
    rope_adjacent: ClassVar[bool] = False

    def __init__(self, gguf: GGUFFile, exact: bool = False, kv_type: str = "f16"):
        self.path = gguf.path
        # exact: every weight dequantized to float32 at load and multiplied with BLAS (parity
        # checks); otherwise weights stay in the file's blocks and int8 kernels multiply them
        self.exact = exact
        if kv_type not in KV_TYPES:
            raise ModelLoadError(f"unknown KV cache type {kv_type!r}: use one of {', '.join(KV_TYPES)}")
        self.kv_type = kv_type
        self.hp = self.read_hparams(gguf)
        self.layers: list[dict[str, Any]] = []
        self.token_embd = gguf.weight("token_embd.weight", dense=exact)
        if len(self.token_embd.shape) != 2 or self.token_embd.shape[1] != self.hp.n_embd:
            raise ModelLoadError(
                f"{gguf.path}: token_embd.weight is {self.token_embd.shape}, expected (*, {self.hp.n_embd})")
        if self.hp.n_vocab != self.token_embd.shape[0]:
            self.hp = replace(self.hp, n_vocab=self.token_embd.shape[0])
        self.output_norm = gguf.tensor("output_norm.weight", (self.hp.n_embd,))
        # Small models tie the output head to the embedding; the same weight serves both.
        self.output = (self.load_weight(gguf, "output.weight", self.token_embd.shape)
                       if gguf.has_tensor("output.weight") else self.token_embd)
        self.layers = [self.load_layer(gguf, i) for i in range(self.hp.n_layer)]
        self.fused = [self.fused_layer(layer) for layer in self.layers]
        self.inv_freq = ops.rope_inverse_frequencies(
            self.hp.rope_dims, self.hp.rope_base, self.hp.rope_freq_scale, self.rope_freq_factors(gguf))
        self.attn_scale = 1.0 / float(np.sqrt(self.hp.head_dim))
        self.dense_fallbacks = dict(gguf.dense_fallbacks)

    # --- what an architecture file provides ---------------------------------------------------

    def read_hparams(self, gguf: GGUFFile) -> HParams:
        return read_hparams(gguf, self.architecture)

    def load_layer(self, gguf: GGUFFile, i: int) -> dict[str, Any]:
        raise NotImplementedError

    def block(self, i: int, x: np.ndarray, fp: ForwardPass) -> np.ndarray:
        raise NotImplementedError

    def rope_freq_factors(self, gguf: GGUFFile) -> np.ndarray | None:
        return gguf.tensor("rope_freqs.weight") if gguf.has_tensor("rope_freqs.weight") else None

    # --- loading helpers the architecture files share ----------------------------------------

    def load_weight(self, gguf: GGUFFile, name: str, shape: tuple[int, ...]) -> Weight:
        return gguf.weight(name, shape, dense=self.exact)

    def load_qkv(self, gguf: GGUFFile, i: int) -> dict[str, Any]:
        """Q, K and V projections (fused in the file or not), optional biases, the output."""
        hp = self.hp
        prefix = f"blk.{i}"
        q_rows, k_rows, v_rows = hp.n_head * hp.head_dim, hp.n_head_kv * hp.head_dim, hp.n_head_kv * hp.value_dim
        if gguf.has_tensor(f"{prefix}.attn_qkv.weight"):
            weights: dict[str, Any] = {
                "wqkv": self.load_weight(gguf, f"{prefix}.attn_qkv.weight", (q_rows + k_rows + v_rows, hp.n_embd))}
        else:
            weights = {f"w{n}": self.load_weight(gguf, f"{prefix}.attn_{n}.weight", (rows, hp.n_embd))
                       for n, rows in zip("qkv", (q_rows, k_rows, v_rows))}
        biases = [gguf.tensor(f"{prefix}.attn_{n}.bias") if gguf.has_tensor(f"{prefix}.attn_{n}.bias")
                  else None for n in "qkv"]
        if any(b is not None for b in biases):
            weights["bqkv"] = [b if b is not None else np.zeros(n, np.float32)
                               for b, n in zip(biases, (q_rows, k_rows, v_rows))]
        weights["wo"] = self.load_weight(gguf, f"{prefix}.attn_output.weight", (hp.n_embd, hp.n_head * hp.value_dim))
        return weights

    def load_swiglu(self, gguf: GGUFFile, i: int) -> dict[str, Weight]:
        """Gate and up (F, D); down (D, F)."""
        hp = self.hp
        return {"gate": self.load_weight(gguf, f"blk.{i}.ffn_gate.weight", (hp.n_ff, hp.n_embd)),
                "up": self.load_weight(gguf, f"blk.{i}.ffn_up.weight", (hp.n_ff, hp.n_embd)),
                "down": self.load_weight(gguf, f"blk.{i}.ffn_down.weight", (hp.n_embd, hp.n_ff))}

    def load_norm(self, gguf: GGUFFile, name: str, size: int | None = None) -> np.ndarray:
        return gguf.tensor(name, (size or self.hp.n_embd,))

    def fused_layer(self, layer: dict[str, Any]) -> FusedLayer | None:
        """The layer for the compiled block steps, or None where it cannot take them: exact
        mode, a CPU without the kernels, a weight held as float32 (a type without a kernel), a
        fused QKV tensor, or head sizes the compiled attention does not take."""
        hp = self.hp
        if self.exact or not kernels.available() or hp.head_dim % 8 or hp.value_dim % 16:
            return None

        def held_in_place(*names: str) -> bool:
            return all(isinstance(layer.get(n), QuantizedWeight) and len(layer[n].shape) == 2
                       and int(layer[n].qtype) in fused.TYPE_CODES for n in names)

        if not held_in_place("wq", "wk", "wv", "wo") or "attn_norm" not in layer:
            return None
        none = np.zeros(0, dtype=np.float32)
        biases = layer.get("bqkv") or (none, none, none)

        def kinds(*names: str) -> np.ndarray:
            return np.array([int(layer[n].qtype) for n in names], dtype=np.int64)

        attention = (layer["attn_norm"], np.float32(hp.rms_eps), layer["wq"].data, layer["wk"].data,
                     layer["wv"].data, kinds("wq", "wk", "wv"), *biases,
                     layer.get("q_norm", none), layer.get("k_norm", none))
        output = (layer["wo"].data, int(layer["wo"].qtype))
        swiglu = None
        if held_in_place("gate", "up", "down") and "ffn_norm" in layer:
            swiglu = (layer["ffn_norm"], np.float32(hp.rms_eps), layer["gate"].data, layer["up"].data,
                      layer["down"].data, kinds("gate", "up", "down"), layer["gate"].shape[0])
        return FusedLayer(attention, output, swiglu)

    # --- the shared steps of a block -----------------------------------------------------------

    def project_qkv(self, layer: dict[str, Any], h: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """[T, D] -> q [T, H, d], k [T, K, d], v [T, K, dv]."""
        hp = self.hp
        n = h.shape[0]
        inp = MatmulInput(h)  # quantized once for the three projections
        biases = layer.get("bqkv") or (None, None, None)
        if "wqkv" in layer:
            qkv = ops.linear(inp, layer["wqkv"], np.concatenate(biases) if biases[0] is not None else None)
            q_end = hp.n_head * hp.head_dim
            k_end = q_end + hp.n_head_kv * hp.head_dim
            q, k, v = qkv[:, :q_end], qkv[:, q_end:k_end], qkv[:, k_end:]
        else:
            q, k, v = (ops.linear(inp, layer[f"w{n}"], b) for n, b in zip("qkv", biases))
        return (q.reshape(n, hp.n_head, hp.head_dim),
                k.reshape(n, hp.n_head_kv, hp.head_dim),
                v.reshape(n, hp.n_head_kv, hp.value_dim))

    def self_attention(self, i: int, h: np.ndarray, fp: ForwardPass, q_norm: np.ndarray | None = None,
                       k_norm: np.ndarray | None = None, window: int | None = None) -> np.ndarray:
        """The attention half of a block on normed input h [T, D]: QKV, optional per-head Q/K
        RMSNorm (before RoPE), attention over the caches, output projection. Returns [T, D]."""
        layer = self.layers[i]
        q, k, v = self.project_qkv(layer, h)
        if q_norm is not None:
            q = ops.rms_norm(q, q_norm, self.hp.rms_eps)
        if k_norm is not None:
            k = ops.rms_norm(k, k_norm, self.hp.rms_eps)
        return ops.linear(self.attend(i, q, k, v, fp, window), layer["wo"])

    def attend(self, i: int, q: np.ndarray, k: np.ndarray, v: np.ndarray, fp: ForwardPass,
               window: int | None = None) -> np.ndarray:
        """RoPE on q/k, store k/v in each sequence's cache, attend; returns [T, H*dv]."""
        q = ops.apply_rope(q, fp.cos, fp.sin, self.rope_adjacent)
        k = ops.apply_rope(k, fp.cos, fp.sin, self.rope_adjacent)
        out = np.empty((q.shape[0], self.hp.n_head * self.hp.value_dim), dtype=np.float32)
        for cache, (start, end) in zip(fp.caches, fp.spans):
            keys, values = cache.write(i, k[start:end], v[start:end])
            out[start:end] = ops.causal_attention(
                q[start:end], keys, values, cache.length, self.attn_scale, window)
        return out

    def attention_half(self, i: int, x: np.ndarray, fp: ForwardPass, window: int | None = None) -> np.ndarray:
        """x + attention(RMSNorm(x)) for a pre-norm block (per-head Q/K norms where the layer
        has them); compiled steps where the layer allows (x is then updated in place)."""
        layer, spec = self.layers[i], self.fused[i]
        if spec is None:
            return x + self.self_attention(i, ops.rms_norm(x, layer["attn_norm"], self.hp.rms_eps), fp,
                                           layer.get("q_norm"), layer.get("k_norm"), window)
        return fused.attention_output(x, self._fused_attention(i, x, fp, window), *spec.output)

    def swiglu_half(self, i: int, x: np.ndarray) -> np.ndarray:
        """x + SwiGLU(RMSNorm(x)); compiled where the layer allows (x then updated in place)."""
        layer, spec = self.layers[i], self.fused[i]
        if spec is None or spec.swiglu is None:
            return x + ops.swiglu(ops.rms_norm(x, layer["ffn_norm"], self.hp.rms_eps),
                                  layer["gate"], layer["up"], layer["down"])
        return fused.swiglu(x, *spec.swiglu)

    def dense_block(self, i: int, x: np.ndarray, fp: ForwardPass, window: int | None = None) -> np.ndarray:
        """The pre-norm block of llama and qwen3: attention, then SwiGLU, each with its residual."""
        spec = self.fused[i]
        if spec is None or spec.swiglu is None:
            return self.swiglu_half(i, self.attention_half(i, x, fp, window))
        if len(fp.caches) == 1:  # one sequence (a lone stream's step, a prefill chunk): one call
            hp, cache = self.hp, fp.caches[0]
            rope = (fp.cos, fp.sin, self.rope_adjacent, hp.n_head, hp.n_head_kv, hp.head_dim, hp.value_dim)
            return fused.dense_block(x, spec.attention, rope, *cache.kernel_arrays(i), cache.length,
                                     np.float32(self.attn_scale), window or 0, np.float32(0.0), spec.output, spec.swiglu)
        attn = self._fused_attention(i, x, fp, window)
        return fused.attention_output_swiglu(x, attn, *spec.output, *spec.swiglu)

    def _fused_attention(self, i: int, x: np.ndarray, fp: ForwardPass, window: int | None) -> np.ndarray:
        hp = self.hp
        q, k, v = fused.attention_inputs(x, *self.fused[i].attention, fp.cos, fp.sin, self.rope_adjacent,
                                         hp.n_head, hp.n_head_kv, hp.head_dim, hp.value_dim)
        out = np.empty((x.shape[0], hp.n_head * hp.value_dim), dtype=np.float32)
        for cache, (start, end) in zip(fp.caches, fp.spans):
            cache.store_and_attend(i, q[start:end], k[start:end], v[start:end], self.attn_scale, window,
                                   out[start:end])
        return out

    # --- the forward pass ------------------------------------------------------------------------

    def new_cache(self, max_tokens: int) -> KVCache:
        hp = self.hp
        return KVCache(hp.n_layer, hp.n_head_kv, hp.head_dim, max_tokens, hp.value_dim, self.kv_type)

    def embed(self, token_ids: np.ndarray) -> np.ndarray:
        return self.token_embd.rows(token_ids)

    def forward(self, steps: list[tuple[KVCache, list[int]]], all_logits: bool = False
                ) -> list[np.ndarray]:
        """Feed each sequence its new tokens in one weight pass; return logits per sequence.

        Logits are [n_vocab] for a sequence's last new token, or [T_s, n_vocab] for all of its
        new tokens with ``all_logits``. Each cache grows by its tokens.
        """
        spans, positions, token_ids = [], [], []
        row = 0
        for cache, tokens in steps:
            if not tokens:
                raise ValueError("every sequence in a forward pass needs at least one new token")
            for t in tokens:
                if not 0 <= t < self.hp.n_vocab:
                    raise ValueError(f"token id {t} is outside the vocabulary (0..{self.hp.n_vocab - 1})")
            cache.reserve(len(tokens))
            spans.append((row, row + len(tokens)))
            positions.append(np.arange(cache.length, cache.length + len(tokens)))
            token_ids.extend(tokens)
            row += len(tokens)
        cos, sin = ops.rope_cos_sin(np.concatenate(positions), self.inv_freq)
        fp = ForwardPass([c for c, _ in steps], spans, cos, sin)
        x = self.embed(np.asarray(token_ids, dtype=np.int64))
        for i in range(self.hp.n_layer):
            x = self.block(i, x, fp)
        for cache, tokens in steps:
            cache.commit(tokens)
        rows = np.arange(row) if all_logits else np.array([end - 1 for _, end in spans])
        logits = self.logits(x[rows])
        if all_logits:
            return [logits[start:end] for start, end in spans]
        return list(logits)

    def logits(self, x: np.ndarray) -> np.ndarray:
        # rows contiguous again: each sequence's logits are read as one vector
        return np.ascontiguousarray(ops.linear(ops.rms_norm(x, self.output_norm, self.hp.rms_eps), self.output))

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights as held: in the file's blocks, or float32 where dequantized."""
        held = [self.token_embd, self.output_norm] + ([self.output] if self.output is not self.token_embd else [])
        for layer in self.layers:
            for value in layer.values():
                held.extend(value if isinstance(value, list) else [value])
        return sum(w.nbytes for w in held)
