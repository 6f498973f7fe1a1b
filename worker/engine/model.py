"""The decoder-only transformer every architecture file fills in.

An architecture file declares its family: the hyperparameters it reads (``read_hparams``), the
tensors of a layer by their GGUF names (``layer_tensors``), each layer's RoPE (``rope``) and
attention options (``attention``), the FFN activation, and, where the family departs from the
pre-norm attention + gated-FFN block, its ``block``. This base class owns what all of them
share: loading what was declared, the embedding, the output head, the forward pass over a batch
of sequences and its KV caches, attention with RoPE, and the compiled block steps.

One ``forward`` call runs one weight pass for several sequences at once: the new tokens of all
of them are stacked into one [T, D] matrix for every projection, and only attention, which
reads each sequence's own cache, is done per sequence.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import numpy as np

from shared.errors import ModelLoadError
from worker.engine import kernels, ops
from worker.engine.gguf_file import GGUFFile
from worker.engine.kernels import fused, rowwise
from worker.engine.kernels.attention import task_addresses
from worker.engine.kv_cache import KV_TYPES, KVCache
from worker.engine.weights import (
    FLOAT_KERNELS,
    DenseWeight,
    MatmulInput,
    PanelWeight,
    QuantizedWeight,
    Weight,
    kernel_kind,
)


@dataclass(frozen=True)
class LayerShape:
    """A layer's own attention geometry, in families where layers differ: its KV heads, head
    size, whether it slides over a window, and the earlier layer whose KV it reads instead of
    keeping its own (None: its own)."""

    n_head_kv: int
    head_dim: int
    local: bool = False
    kv_from: int | None = None
    n_ff: int = 0  # its FFN's width (0: the model's)
    recurrent: bool = False  # a linear-attention layer: no KV, a recurrent state instead


@dataclass(frozen=True)
class LinearAttention:
    """The geometry of a family's linear-attention (Gated DeltaNet) layers: the short causal
    convolution's kernel, key heads and their size, value heads and their size."""

    conv_kernel: int
    key_heads: int
    key_dim: int
    value_heads: int
    value_dim: int

    @property
    def conv_channels(self) -> int:
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim


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
    layers: tuple[LayerShape, ...] = ()  # per-layer geometry where layers differ; () where they do not
    n_embd_per_layer: int = 0  # width of per-layer token embeddings (0: none)
    linear_attention: LinearAttention | None = None  # the recurrent layers' geometry, where there are any
    family: Any = None  # what only one family's layers need (a dataclass of its own file)

    def layer(self, i: int) -> LayerShape:
        return self.layers[i] if self.layers else LayerShape(self.n_head_kv, self.head_dim)


def read_hparams(gguf: GGUFFile, arch: str, per_layer: frozenset[str] = frozenset()) -> HParams:
    """The hyperparameters every family shares, with llama.cpp's defaults where a key is absent.
    Keys in ``per_layer`` may hold one value per layer (the family reads them itself); the
    value kept here is their largest."""
    meta = gguf.metadata

    def get(key: str, default: Any = None, required: bool = False) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None and required:
            raise ModelLoadError(f"{gguf.path} lacks the required key {arch}.{key}")
        # a crafted file's string or empty list is named here, not met as a TypeError further on
        items = value if isinstance(value, list) else [value]
        if value is not None and not (items and all(isinstance(v, (int, float)) for v in items)):
            raise ModelLoadError(f"{gguf.path}: {arch}.{key} is {value!r:.60}, not a number (or one per layer)")
        # per-layer arrays are allowed by the format; most families use one value for all layers
        if isinstance(value, list) and key in per_layer:
            return max(value)
        if isinstance(value, list):
            if len(set(value)) != 1:
                raise ModelLoadError(f"{gguf.path}: per-layer values {value[:8]}… are not supported")
            return value[0]
        return value

    n_embd = int(get("embedding_length", required=True))
    n_head = int(get("attention.head_count", required=True))
    n_head_kv = int(get("attention.head_count_kv", n_head))
    head_dim = int(get("attention.key_length", n_embd // n_head))
    tokens = meta.get("tokenizer.ggml.tokens")
    n_vocab = int(get("vocab_size", len(tokens) if tokens else 0))
    if n_head % n_head_kv and "attention.head_count_kv" not in per_layer:
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
        n_ff=int(get("feed_forward_length", 0)),
        context_length=int(get("context_length", 4096)),
        rope_base=float(get("rope.freq_base", 10000.0)),
        rope_dims=int(get("rope.dimension_count", head_dim)),
        rope_freq_scale=1.0 / scaling_factor if scaling_factor else 1.0,
        rms_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        n_expert=int(get("expert_count", 0) or 0),
        n_expert_used=int(get("expert_used_count", 0) or 0),
        n_ff_expert=int(get("expert_feed_forward_length", 0) or 0),
    )


# What a layer tensor is, for loading it (and for writing synthetic files from the declaration).
MATRIX = "matrix"  # a weight matrix, repacked in panels (dequantized in exact mode)
TABLE = "table"  # a lookup table: rows read per token, never multiplied; kept in the file
DENSE = "dense"  # a small matrix read as float32 (a router)
NORM = "norm"  # a norm's weight vector, float32
BIAS = "bias"  # a bias vector, float32
FACTORS = "factors"  # RoPE's per-pair frequency factors, float32 (read as the model's rope_factors)


@dataclass(frozen=True)
class LayerTensor:
    """One tensor of a layer: the key the block reads it by, its GGUF name after ``blk.N.``,
    its shape (numpy order: rows first) and kind; an optional one may be absent from a file."""

    key: str
    name: str
    shape: tuple[int, ...]
    kind: str = MATRIX
    optional: bool = False


@dataclass(frozen=True)
class Rope:
    """How a layer rotates Q and K: ``dims`` leading dims of each head in pairs (i, i + dims/2),
    or (2i, 2i + 1) when ``adjacent``, at angle position · freq_scale · base^(-2i/dims) / factor_i."""

    base: float
    dims: int
    freq_scale: float = 1.0
    adjacent: bool = False
    factors: np.ndarray | None = field(default=None, compare=False)

    def inverse_frequencies(self) -> np.ndarray:
        return ops.rope_inverse_frequencies(self.dims, self.base, self.freq_scale, self.factors)


@dataclass(frozen=True)
class AttentionOptions:
    """A layer's attention: the score scale, a sliding window (0: the whole context) and a
    tanh soft cap on the scores (0: none)."""

    scale: float
    window: int = 0
    softcap: float = 0.0


ACTIVATIONS = ("silu", "gelu_tanh")  # of the gate in the gated FFN


@dataclass
class ForwardPass:
    """Per-call state the blocks need: where each sequence's rows are and their positions."""

    caches: list[KVCache]
    spans: list[tuple[int, int]]  # row range of each sequence in the stacked [T, D] input
    rope: list[tuple[np.ndarray, np.ndarray, bool]]  # per layer: cos, sin [T, dims/2] of every row; adjacent
    positions: np.ndarray  # [T]: each row's position in its sequence
    layer_inputs: Any = None  # what ``layer_inputs`` gave for these rows
    # a diffusion canvas (``DiffusionGemmaModel.denoise``): its rows see each other both ways
    # and are written to no cache
    canvas: bool = False


@dataclass(frozen=True)
class FusedLayer:
    """A layer's weights as the compiled block steps (``kernels/fused.py``) take them."""

    attention: tuple  # attention_inputs' arguments after x: norm, eps, wq, wk, wv, bq, bk, bv, q_norm, k_norm
    output: tuple  # attention_output's after x and attn: wo
    swiglu: tuple | None  # swiglu's after x: norm, eps, wg, wu, wd, n_ff (None: not a SwiGLU layer)


def _no_tasks(dtype: np.dtype) -> tuple[int, int]:
    """Where ``one_call_signatures`` says the attention's tasks are: nowhere, in the type of
    ``attention.task_addresses``' answer, which would compile the tasks to find them (in the
    worker, on a first start, while its helpers compile them too)."""
    return (0, 0)


class DecoderModel:
    """Base of every architecture: subclasses set ``architecture`` and declare their family."""

    architecture: ClassVar[str]
    # RoPE pairs of the default ``rope``: (i, i + d/2), or (2i, 2i + 1) where the file's Q/K rows
    # are ordered so
    rope_adjacent: ClassVar[bool] = False
    activation: ClassVar[str] = "silu"  # the gate's activation in the gated FFN (ACTIVATIONS)
    has_output_norm: ClassVar[bool] = True  # False: the final RMSNorm has no weight
    # the forward pass reads the token ids a cache holds (not only its keys and values)
    reads_cache_tokens: bool = False
    # replies are written a block at a time by denoising passes (``denoise``), not token by token
    diffusion: ClassVar[bool] = False
    # one sequence's dense block is one compiled call (``fused.dense_block``); False while that
    # call compiles after a first start's warm-up (``Engine.warm_up``), its four calls meanwhile
    one_call_blocks: bool = True

    def __init__(self, gguf: GGUFFile, exact: bool = False, kv_type: str = "f16"):
        self.path = gguf.path
        # exact: every weight dequantized to float32 at load and multiplied with BLAS (parity
        # checks); otherwise weights stay in the file's blocks and int8 kernels multiply them
        self.exact = exact
        if kv_type not in KV_TYPES:
            raise ModelLoadError(f"unknown KV cache type {kv_type!r}: use one of {', '.join(KV_TYPES)}")
        if self.activation not in ACTIVATIONS:
            raise ModelLoadError(f"{self.architecture}: unknown FFN activation {self.activation!r}")
        self.kv_type = kv_type
        kernels.start_threads()
        self.hp = self.read_hparams(gguf)
        self.layers: list[dict[str, Any]] = []
        self.token_embd = gguf.weight("token_embd.weight", dense=exact)
        if len(self.token_embd.shape) != 2 or self.token_embd.shape[1] != self.hp.n_embd:
            raise ModelLoadError(
                f"{gguf.path}: token_embd.weight is {self.token_embd.shape}, expected (*, {self.hp.n_embd})")
        if self.hp.n_vocab != self.token_embd.shape[0]:
            self.hp = replace(self.hp, n_vocab=self.token_embd.shape[0])
        self.output_norm = gguf.tensor("output_norm.weight", (self.hp.n_embd,)) if self.has_output_norm else None
        if gguf.has_tensor("output.weight"):
            self.output = self.load_weight(gguf, "output.weight", self.token_embd.shape)
        else:  # small models tie the output head to the embedding: one packed weight serves both
            self.output = self.token_embd = self.packed(gguf, "token_embd.weight", self.token_embd)
        self.layers = [self.load_layer(gguf, i) for i in range(self.hp.n_layer)]
        self.load_globals(gguf)
        self.fused = [self.fused_layer(layer) for layer in self.layers]
        self.rope_factors = self.rope_freq_factors(gguf)
        self.attention_options = [self.attention(i) for i in range(self.hp.n_layer)]
        # layers that rotate alike share one table of angles per forward pass
        tables: dict[tuple[bytes, bool], int] = {}
        self.rope_tables: list[tuple[np.ndarray, bool]] = []
        self.layer_rope: list[int] = []
        for i in range(self.hp.n_layer):
            rope = self.rope(i)
            inv_freq = rope.inverse_frequencies()
            key = (inv_freq.tobytes(), rope.adjacent)
            if key not in tables:
                tables[key] = len(self.rope_tables)
                self.rope_tables.append((inv_freq, rope.adjacent))
            self.layer_rope.append(tables[key])
        self.dense_fallbacks = dict(gguf.dense_fallbacks)

    # --- what an architecture file declares ---------------------------------------------------

    def read_hparams(self, gguf: GGUFFile) -> HParams:
        return read_hparams(gguf, self.architecture)

    @classmethod
    def layer_tensors(cls, hp: HParams, i: int) -> list[LayerTensor]:
        """The tensors of layer i; the default is the pre-norm block with a gated FFN."""
        return cls.attention_tensors(hp) + cls.ffn_tensors(hp)

    def rope(self, i: int) -> Rope:
        """Layer i's RoPE; the default is the file's one RoPE for every layer."""
        hp = self.hp
        return Rope(hp.rope_base, hp.rope_dims, hp.rope_freq_scale, self.rope_adjacent, self.rope_factors)

    def attention(self, i: int) -> AttentionOptions:
        """Layer i's attention options; the default is 1/√d over the whole context."""
        return AttentionOptions(scale=1.0 / float(np.sqrt(self.hp.head_dim)))

    def block(self, i: int, x: np.ndarray, fp: ForwardPass) -> np.ndarray:
        """One layer on the stacked rows x [T, D]; the default is ``dense_block``."""
        return self.dense_block(i, x, fp)

    @classmethod
    def global_tensors(cls, hp: HParams) -> list[LayerTensor]:
        """Tensors outside the layers beyond the embedding, output norm and head (full GGUF
        names); each is loaded as the model's attribute of its key."""
        return []

    def layer_inputs(self, token_ids: np.ndarray, x: np.ndarray) -> Any:
        """What every block of a forward pass gets besides x (``ForwardPass.layer_inputs``),
        from the pass's token ids and embedded rows; the default is nothing."""
        return None

    def rope_freq_factors(self, gguf: GGUFFile) -> np.ndarray | None:
        return gguf.tensor("rope_freqs.weight") if gguf.has_tensor("rope_freqs.weight") else None

    # --- declarations the architecture files share -------------------------------------------

    @staticmethod
    def attention_tensors(hp: HParams, qk_norm: bool = False) -> list[LayerTensor]:
        """Pre-norm attention: the norm, Q, K, V (optional biases), per-head Q/K norms where the
        family has them, the output projection."""
        d = hp.n_embd
        rows = {"q": hp.n_head * hp.head_dim, "k": hp.n_head_kv * hp.head_dim, "v": hp.n_head_kv * hp.value_dim}
        tensors = [LayerTensor("attn_norm", "attn_norm.weight", (d,), NORM)]
        tensors += [LayerTensor(f"w{n}", f"attn_{n}.weight", (r, d)) for n, r in rows.items()]
        tensors += [LayerTensor(f"b{n}", f"attn_{n}.bias", (r,), BIAS, optional=True) for n, r in rows.items()]
        if qk_norm:
            tensors += [LayerTensor("q_norm", "attn_q_norm.weight", (hp.head_dim,), NORM),
                        LayerTensor("k_norm", "attn_k_norm.weight", (hp.head_dim,), NORM)]
        return tensors + [LayerTensor("wo", "attn_output.weight", (d, hp.n_head * hp.value_dim))]

    @staticmethod
    def ffn_tensors(hp: HParams) -> list[LayerTensor]:
        """Pre-norm gated FFN: the norm, gate and up (F, D), down (D, F)."""
        d, f = hp.n_embd, hp.n_ff
        return [LayerTensor("ffn_norm", "ffn_norm.weight", (d,), NORM),
                LayerTensor("gate", "ffn_gate.weight", (f, d)),
                LayerTensor("up", "ffn_up.weight", (f, d)),
                LayerTensor("down", "ffn_down.weight", (d, f))]

    @staticmethod
    def moe_tensors(hp: HParams) -> list[LayerTensor]:
        """Pre-norm routed experts: the norm, the router (float32), gate/up/down of every expert."""
        d, f, n = hp.n_embd, hp.n_ff_expert, hp.n_expert
        return [LayerTensor("ffn_norm", "ffn_norm.weight", (d,), NORM),
                LayerTensor("router", "ffn_gate_inp.weight", (n, d), DENSE),
                LayerTensor("gate_exps", "ffn_gate_exps.weight", (n, f, d)),
                LayerTensor("up_exps", "ffn_up_exps.weight", (n, f, d)),
                LayerTensor("down_exps", "ffn_down_exps.weight", (n, d, f))]

    # --- loading what was declared -----------------------------------------------------------

    def load_globals(self, gguf: GGUFFile) -> None:
        for t in self.global_tensors(self.hp):
            if t.kind == MATRIX:
                setattr(self, t.key, self.load_weight(gguf, t.name, t.shape))
            elif t.kind == TABLE:
                setattr(self, t.key, gguf.weight(t.name, t.shape, dense=self.exact))
            elif t.kind != FACTORS and (gguf.has_tensor(t.name) or not t.optional):
                setattr(self, t.key, gguf.tensor(t.name, t.shape))

    def load_weight(self, gguf: GGUFFile, name: str, shape: tuple[int, ...]) -> Weight:
        """A matrix to multiply by: repacked in panels where its type has them."""
        return self.packed(gguf, name, gguf.weight(name, shape, dense=self.exact))

    @staticmethod
    def packed(gguf: GGUFFile, name: str, weight: Weight) -> Weight:
        """``weight`` repacked in panels if it can be (a 2-D matrix of a block type with them),
        its pages of the file let go once copied, and given the GEMM of its kind
        (``weights.kernel_kind``, from the file's header as the kernels compiled ahead are); else
        itself."""
        if not isinstance(weight, QuantizedWeight):
            return weight
        packed = weight.packed()
        if packed is not weight:
            gguf.release(name)
            if kernel_kind(packed.qtype, gguf.matrix_weights()) == "rows":
                packed.without_tiles()
        return packed

    def load_layer(self, gguf: GGUFFile, i: int) -> dict[str, Any]:
        """Layer i's declared tensors by key (an absent optional one has no key); matrices stay
        in the file's blocks (and experts in the file: a step reads only those it routes to)."""
        layer: dict[str, Any] = {}
        for t in self.layer_tensors(self.hp, i):
            name = f"blk.{i}.{t.name}"
            if t.optional and not gguf.has_tensor(name):
                continue
            if t.kind == MATRIX:
                layer[t.key] = self.load_weight(gguf, name, t.shape)
            elif t.kind == TABLE:
                layer[t.key] = gguf.weight(name, t.shape, dense=self.exact)
            else:
                layer[t.key] = gguf.tensor(name, t.shape)
        return layer

    def fused_layer(self, layer: dict[str, Any]) -> FusedLayer | None:
        """The layer for the compiled block steps, or None where it cannot take them: exact
        mode, a CPU without the kernels, a weight held as float32 (a type without a kernel), or
        head sizes the compiled attention does not take. Its FFN takes them only with SiLU."""
        hp = self.hp
        if self.exact or not kernels.available() or hp.head_dim % 8 or hp.value_dim % 16:
            return None

        def compiled(*names: str) -> bool:
            return all(isinstance(layer.get(n), PanelWeight) or (
                isinstance(layer.get(n), QuantizedWeight) and len(layer[n].shape) == 2
                and layer[n].qtype in FLOAT_KERNELS) for n in names)

        if not compiled("wq", "wk", "wv", "wo") or "attn_norm" not in layer:
            return None
        none = np.zeros(0, dtype=np.float32)
        attention = (layer["attn_norm"], np.float32(hp.rms_eps), *(layer[w].kernel_array for w in ("wq", "wk", "wv")),
                     *(layer.get(b, none) for b in ("bq", "bk", "bv")), layer.get("q_norm", none),
                     layer.get("k_norm", none))
        output = (layer["wo"].kernel_array,)
        swiglu = None
        if self.activation == "silu" and compiled("gate", "up", "down") and "ffn_norm" in layer:
            swiglu = (layer["ffn_norm"], np.float32(hp.rms_eps), layer["gate"].kernel_array,
                      layer["up"].kernel_array, layer["down"].kernel_array, layer["gate"].shape[0])
        return FusedLayer(attention, output, swiglu)

    # --- the shared steps of a block -----------------------------------------------------------

    def project_qkv(self, layer: dict[str, Any], h: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """[T, D] -> q [T, H, d], k [T, K, d], v [T, K, dv]."""
        hp = self.hp
        n = h.shape[0]
        inp = MatmulInput(h)  # quantized once for the three projections
        q, k, v = (ops.linear(inp, layer[f"w{n}"], layer.get(f"b{n}")) for n in "qkv")
        return (q.reshape(n, hp.n_head, hp.head_dim),
                k.reshape(n, hp.n_head_kv, hp.head_dim),
                v.reshape(n, hp.n_head_kv, hp.value_dim))

    def self_attention(self, i: int, h: np.ndarray, fp: ForwardPass) -> np.ndarray:
        """The attention half of a block on normed input h [T, D]: QKV, per-head Q/K RMSNorm
        where the layer has them (before RoPE), attention over the caches, output projection.
        Returns [T, D]."""
        layer = self.layers[i]
        q, k, v = self.project_qkv(layer, h)
        if "q_norm" in layer:
            q = ops.rms_norm(q, layer["q_norm"], self.hp.rms_eps)
        if "k_norm" in layer:
            k = ops.rms_norm(k, layer["k_norm"], self.hp.rms_eps)
        cos, sin, adjacent = fp.rope[i]
        q, k = ops.apply_rope(q, cos, sin, adjacent), ops.apply_rope(k, cos, sin, adjacent)
        options = self.attention_options[i]
        return ops.linear(ops.attend(q, k, v, fp, i, options.scale, options.window, options.softcap), layer["wo"])

    def attention_half(self, i: int, x: np.ndarray, fp: ForwardPass) -> np.ndarray:
        """x + attention(RMSNorm(x)) for a pre-norm block; compiled steps where the layer
        allows (x is then updated in place)."""
        layer, spec = self.layers[i], self.fused[i]
        if spec is None:
            return x + self.self_attention(i, ops.rms_norm(x, layer["attn_norm"], self.hp.rms_eps), fp)
        return fused.attention_output(x, self.fused_attention(i, x, fp), *spec.output)

    def ffn_half(self, i: int, x: np.ndarray) -> np.ndarray:
        """x + FFN(RMSNorm(x)) with the family's gate activation; compiled where the layer
        allows (x then updated in place)."""
        layer, spec = self.layers[i], self.fused[i]
        if spec is None or spec.swiglu is None:
            return x + ops.gated_ffn(ops.rms_norm(x, layer["ffn_norm"], self.hp.rms_eps),
                                     layer["gate"], layer["up"], layer["down"], self.activation)
        return fused.swiglu(x, *spec.swiglu)

    def dense_block(self, i: int, x: np.ndarray, fp: ForwardPass) -> np.ndarray:
        """The pre-norm block of llama and qwen3: attention, then the gated FFN, each with its
        residual."""
        spec = self.fused[i]
        if spec is None or spec.swiglu is None:
            return self.ffn_half(i, self.attention_half(i, x, fp))
        if len(fp.caches) == 1 and self.one_call_blocks:  # one sequence (a lone stream's step, a prefill chunk)
            return fused.dense_block(*self.one_call_arguments(i, x, fp.caches[0], fp.rope[i], task_addresses))
        fused.attention_output(x, self.fused_attention(i, x, fp), *spec.output)
        return fused.swiglu(x, *spec.swiglu)

    def one_call_arguments(self, i: int, x: np.ndarray, cache: KVCache, rope: tuple, tasks: Callable) -> tuple:
        """``fused.dense_block``'s arguments for layer i of one sequence; ``tasks(dtype)``: where the
        attention's tasks are (``attention.task_addresses``)."""
        hp, spec, options = self.hp, self.fused[i], self.attention_options[i]
        keys, values = cache.kernel_arrays(i)
        return (x, spec.attention, (*rope, hp.n_head, hp.n_head_kv, hp.head_dim, hp.value_dim), keys, values,
                cache.length, np.float32(options.scale), options.window, np.float32(options.softcap),
                cache.prompt_rows(x.shape[0]), tasks(values.dtype), spec.output, spec.swiglu)

    def one_call_signatures(self) -> set[tuple]:
        """The numba types of ``fused.dense_block``'s arguments for each of its layers (those of a
        forward pass: the arguments made as ``dense_block`` makes them)."""
        layers = [i for i, spec in enumerate(getattr(self, "fused", [])) if spec is not None and spec.swiglu]
        if not layers:
            return set()
        x = np.zeros((1, self.hp.n_embd), dtype=np.float32)
        cache, rope = self.new_cache(8), self.layer_rope_tables(np.arange(1))
        cache.reserve(1)
        return {tuple(map(fused.dense_block.typeof_pyval, self.one_call_arguments(i, x, cache, rope[i], _no_tasks)))
                for i in layers}

    def fused_attention(self, i: int, x: np.ndarray, fp: ForwardPass) -> np.ndarray:
        """Compiled: attn_norm, Q/K/V, Q/K norms, RoPE, the caches' store and attention of each
        sequence; returns [T, H*dv] before the output projection. Only where ``fused[i]``."""
        hp, options = self.hp, self.attention_options[i]
        q, k, v = fused.attention_inputs(x, *self.fused[i].attention, *fp.rope[i],
                                         hp.n_head, hp.n_head_kv, hp.head_dim, hp.value_dim)
        return ops.attend(q, k, v, fp, i, options.scale, options.window, options.softcap, compiled=True)

    def warm_products(self) -> None:
        """Run, on one row, the compiled block steps that do not attend (a fused layer's inputs, and
        its output half where that is a SwiGLU) and the head: on a first start they compile while
        the attention kernel still compiles in its helper, which ``forward`` would wait for. Types
        as ``forward``'s. A GELU-gated family's gate (``ops.gated_ffn``) compiles here too."""
        hp = self.hp
        if self.activation == "gelu_tanh" and kernels.available():
            gate = np.zeros((1, 8), dtype=np.float32)
            rowwise.gelu_tanh_times(gate, gate, gate)
        layers = [(i, spec) for i, spec in enumerate(getattr(self, "fused", [])) if spec is not None]
        if not layers:
            return
        x = self.embed(np.zeros(1, dtype=np.int64))
        rope = self.layer_rope_tables(np.arange(1))
        for i, spec in layers:
            fused.attention_inputs(x.copy(), *spec.attention, *rope[i], hp.n_head, hp.n_head_kv, hp.head_dim,
                                   hp.value_dim)
            if spec.swiglu is not None:
                attn = np.zeros((1, hp.n_head * hp.value_dim), dtype=np.float32)
                fused.swiglu(fused.attention_output(x.copy(), attn, *spec.output), *spec.swiglu)
        self.logits(x)

    # --- the forward pass ------------------------------------------------------------------------

    def new_cache(self, max_tokens: int) -> KVCache:
        """A cache for every layer that keeps KV of its own, each in its layer's shape."""
        hp = self.hp
        if not hp.layers:
            return KVCache(hp.n_layer, hp.n_head_kv, hp.head_dim, max_tokens, hp.value_dim, self.kv_type,
                           windows=[self.attention_options[i].window for i in range(hp.n_layer)])
        own = [i for i, shape in enumerate(hp.layers) if shape.kv_from is None and not shape.recurrent]
        # a layer's KV is read over the widest window of the layers reading it (0: whole context)
        readers = {i: [j for j, shape in enumerate(hp.layers) if j == i or shape.kv_from == i] for i in own}
        windows = [0 if any(self.attention_options[j].window == 0 for j in readers[i])
                   else max(self.attention_options[j].window for j in readers[i]) for i in own]
        cache = KVCache(len(own), hp.n_head_kv, hp.head_dim, max_tokens, hp.value_dim, self.kv_type,
                        layers=[(hp.layers[i].n_head_kv, hp.layers[i].head_dim, hp.layers[i].head_dim) for i in own],
                        windows=windows)
        # a recurrent layer's state exists only at the end of what it read: the cache cannot be
        # cut back to a shorter prefix
        cache.rewindable = not any(shape.recurrent for shape in hp.layers)
        return cache

    def embed(self, token_ids: np.ndarray) -> np.ndarray:
        return self.token_embd.rows(token_ids)

    def layer_rope_tables(self, positions: np.ndarray) -> list[tuple[np.ndarray, np.ndarray, bool]]:
        """Each layer's cos, sin [T, dims/2] and pairing for rows at these positions (one table
        per distinct rotation, shared by the layers that rotate alike)."""
        tables = [(*ops.rope_cos_sin(positions, inv_freq), adjacent) for inv_freq, adjacent in self.rope_tables]
        return [tables[t] for t in self.layer_rope]

    def forward(self, steps: list[tuple[KVCache, list[int]]], all_logits: bool = False,
                hidden: bool = False, tails: list[int] | None = None,
                hidden_out: list[np.ndarray] | None = None,
                best: list[tuple[np.ndarray, np.ndarray] | None] | None = None) -> list[np.ndarray]:
        """Feed each sequence its new tokens in one weight pass; return logits per sequence.

        Logits are [n_vocab] for a sequence's last new token, or [T_s, n_vocab] for all of its
        new tokens with ``all_logits``, or [tails[s], n_vocab] for its last ``tails[s]`` where
        that is not 1: above (a speculating stream's verified rows), or 0 (a prompt chunk with
        more to come, whose logits nobody reads: [0, n_vocab], the head not applied). With
        ``hidden``, the final RMSNorm's output [n_embd] stands in for the logits (what a fleet's
        index embeds). A ``hidden_out`` list gets, per sequence, that output for every one of its
        new tokens [T_s, n_embd] (what a multi-token-prediction draft reads). Where ``best[s]``
        is a logit bias (token ids, values; both may be empty), a sequence gets instead of its
        rows' logits the index of each row's largest biased one (int64 [tails[s]], or a scalar
        for one row): a greedy stream's verified rows, without a row of the vocabulary's size
        each (``head``). Each cache grows by its tokens.
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
        row_positions = np.concatenate(positions)
        fp = ForwardPass([c for c, _ in steps], spans, self.layer_rope_tables(row_positions), row_positions)
        ids = np.asarray(token_ids, dtype=np.int64)
        x = self.embed(ids)
        fp.layer_inputs = self.layer_inputs(ids, x)
        for i in range(self.hp.n_layer):
            x = self.block(i, x, fp)
        for cache, tokens in steps:
            cache.commit(tokens)
        if hidden_out is not None:
            normed = ops.rms_norm(x, self.output_norm, self.hp.rms_eps)
            hidden_out.extend(normed[start:end] for start, end in spans)
        if all_logits:
            tails = [end - start for start, end in spans]
        tails = tails or [1] * len(spans)
        rows = np.concatenate([np.arange(end - tail, end) for (_, end), tail in zip(spans, tails)])
        ends = np.cumsum(tails)
        if best is not None and any(b is not None for b in best) and not hidden and len(rows):
            wanted = [b is not None for b in best]
            keep = np.repeat(~np.asarray(wanted), tails)
            biases = [(end - tail, end, *bias) for end, tail, bias in zip(ends, tails, best)
                      if bias is not None and len(bias[0]) and tail]
            logits, chosen = self.head(x[rows], keep, biases)
            kept = np.cumsum(np.where(wanted, 0, tails))
            return [(chosen[end - tail:end] if tail != 1 else chosen[end - 1]) if chooses else
                    (logits[at - tail:at] if all_logits or tail != 1 else logits[at - 1])
                    for end, at, tail, chooses in zip(ends, kept, tails, wanted)]
        if not len(rows):  # every sequence still reading its prompt: no head to apply
            logits = np.empty((0, self.hp.n_embd if hidden else self.hp.n_vocab), dtype=np.float32)
        else:
            logits = ops.rms_norm(x[rows], self.output_norm, self.hp.rms_eps) if hidden else self.logits(x[rows])
        return [logits[end - tail:end] if all_logits or tail != 1 else logits[end - 1]
                for end, tail in zip(ends, tails)]

    def logits(self, x: np.ndarray) -> np.ndarray:
        # rows contiguous again: each sequence's logits are read as one vector
        return np.ascontiguousarray(self.head_output(ops.linear(self.head_input(x), self.output), 0))

    def head_input(self, x: np.ndarray) -> np.ndarray:
        """What meets the output matrix: the final norm of the rows."""
        return ops.rms_norm(x, self.output_norm, self.hp.rms_eps)

    def head_output(self, products: np.ndarray, start: int) -> np.ndarray:
        """The logits of the vocabulary's entries from ``start`` on, from their products with the
        head's input (what a family does to each, a soft cap say; column by column)."""
        return products

    HEAD_SLICE = 8192  # output rows of the head a slice of ``head`` multiplies at once

    def head(self, x: np.ndarray, keep: np.ndarray,
             biases: list[tuple[int, int, np.ndarray, np.ndarray]] = ()) -> tuple[np.ndarray, np.ndarray]:
        """The logits of the rows ``keep`` marks, and every row's best entry (its largest logit,
        the first of equals: ``np.argmax``'s), the head applied a slice of the vocabulary at a
        time: the rows not kept take no row of the vocabulary's size. Each logit is the one
        ``logits`` gives (a product's numbers do not depend on which outputs come with it), so
        a greedy choice is the same. ``biases``: (first row, end row, token ids, values) added to
        those rows' logits before they are compared, as the sampler adds a logit bias (rows not
        kept). A head whose product sums a row by BLAS (``DenseWeight``'s exact one, whose order
        can depend on the outputs) takes the whole vocabulary at once."""
        rows = np.arange(len(x))
        chosen = np.zeros(len(x), dtype=np.int64)
        top = np.full(len(x), -np.inf, dtype=np.float32)
        kept: list[np.ndarray] = []
        for start, part in self._head_slices(x):
            kept.append(part[keep])
            for first, end, ids, values in biases:
                inside = (ids >= start) & (ids < start + part.shape[1])
                part[first:end, ids[inside] - start] += values[inside]
            at = np.argmax(part, axis=1)
            value = part[rows, at]
            # strictly larger: an earlier slice keeps a tie, as argmax keeps the first; a NaN wins
            better = (value > top) | (np.isnan(value) & ~np.isnan(top))
            chosen[better], top[better] = at[better] + start, value[better]
        return np.ascontiguousarray(np.concatenate(kept, axis=1)), chosen

    def _head_slices(self, x: np.ndarray):
        """(first entry, logits of the entries from there) for ``head``, slice by slice."""
        if isinstance(self.output, DenseWeight) and self.output.exact:
            yield 0, self.logits(x)
            return
        inputs = MatmulInput(self.head_input(x))
        for start in range(0, self.output.shape[0], self.HEAD_SLICE):
            part = self.head_output(ops.linear(inputs, self.output.row_range(
                start, min(start + self.HEAD_SLICE, self.output.shape[0]))), start)
            if not part.shape[1]:
                return
            yield start, part

    def held_weights(self) -> list:
        """Every tensor the model holds, each once (a tied output is the embedding)."""
        held = [self.token_embd] + ([self.output_norm] if self.output_norm is not None else [])
        held += [self.output] if self.output is not self.token_embd else []
        held += [getattr(self, t.key) for t in self.global_tensors(self.hp) if hasattr(self, t.key)]
        for layer in self.layers:
            for value in layer.values():
                held.extend(value if isinstance(value, list) else [value])
        return held

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights as held: in the file's blocks, or float32 where dequantized."""
        return sum(w.nbytes for w in self.held_weights())

    @property
    def parameter_count(self) -> int:
        """Values in the weights held (norms and biases included)."""
        return sum(int(np.prod(w.shape)) for w in self.held_weights())
