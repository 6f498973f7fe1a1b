"""Tiny synthetic GGUF models for engine tests, written from a fixed numpy seed.

Architectures without small public weights are tested on files made here: a few layers of
n_embd 64 with random weights, but with a real tokenizer in the metadata so that llama.cpp
accepts the file and produces reference logits (``scripts/regen_logit_fixtures.py``). The
tensors written are the ones the architecture file declares (``layer_tensors``), so a new
family needs only its hyperparameters below.

* ``llama``: GQA (4 query heads, 2 KV heads, head_dim 16), untied ``output.weight``.
* ``qwen3``: head_dim 32 while n_embd / n_head is 16 (as in real Qwen3), per-head Q/K RMSNorm,
  rope base 1e6, tied output (no ``output.weight``).
* ``gemma3``: six layers, the first five sliding over 4 positions with base 10000, the last
  global with base 1e6; per-head Q/K norms, norms after attention and FFN, GELU-tanh, tied.
* ``qwen3moe``: as qwen3 but every FFN is a mixture of 8 experts, 2 routed per token, expert
  width 32; untied output.

Matrices are F32 by default so llama.cpp computes in f32 and parity can be tight; the
``tensor_type`` override writes F16, Q8_0 or Q2_0 (either layout) matrices instead. The same
arguments always give the same bytes.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import struct
from typing import Any

import gguf
import numpy as np

from worker.engine import q2_0
from worker.engine.archs import ARCHITECTURES
from worker.engine.archs.inkling import InklingShape
from worker.engine.gguf_file import HeaderCursor
from worker.engine.model import DENSE, FACTORS, MATRIX, NORM, TABLE, HParams, LayerShape, LinearAttention

# The GGUF families the generic tiny-model tests run over (nanochat is served from checkpoint
# directories: tests/tiny_nanochat.py). The recurrent families (linear attention) have fixtures
# of both references too, but their own tests (tests/engine/test_recurrent_state.py) instead of the
# generic ones, which cut caches back and compile attention-only block steps.
RECURRENT = ("qwen35", "qwen35moe")
# Families llama.cpp does not have: transformers is their one reference. They have their own
# tests too: inkling's caches hold convolution states (they are not cut back), and
# diffusion-gemma writes its replies a block at a time.
TRANSFORMERS_ONLY = ("diffusion-gemma", "inkling")
ARCHS = tuple(arch for arch in ARCHITECTURES if arch != "nanochat" and arch not in RECURRENT + TRANSFORMERS_ONLY)

# Per-architecture defaults; every key may be overridden by keyword.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {
        "n_layer": 2,
        "n_embd": 64,
        "n_head": 4,
        "n_head_kv": 2,
        "head_dim": 16,
        "n_ff": 128,
        "rope_base": 10000.0,
        "rms_eps": 1e-5,
        "context_length": 256,
        "tied": False,
        "vocab": "smollm2",
    },
    "qwen3": {
        "n_layer": 3,
        "n_embd": 64,
        "n_head": 4,
        "n_head_kv": 2,
        "head_dim": 32,
        "n_ff": 128,
        "rope_base": 1e6,
        "rms_eps": 1e-6,
        "context_length": 256,
        "tied": True,
        "vocab": "qwen",
    },
    "qwen3moe": {
        "n_layer": 2,
        "n_embd": 64,
        "n_head": 4,
        "n_head_kv": 2,
        "head_dim": 32,
        # Real Qwen3-MoE files carry a dense feed_forward_length too; nothing uses it here.
        "n_ff": 128,
        "n_expert": 8,
        "n_expert_used": 2,
        "n_ff_exp": 32,
        "rope_base": 1e6,
        "rms_eps": 1e-6,
        "context_length": 256,
        "tied": False,
        "vocab": "qwen",
    },
}
# As qwen3 (head_dim 32, per-head Q/K norms, base 1e6, tied), over six layers: the first five
# slide over 4 positions (within the fixtures' 40 tokens, so the window shows), the last is global.
_DEFAULTS["gemma3"] = {**_DEFAULTS["qwen3"], "n_layer": 6, "vocab": "smollm2", "sliding_window": 4}
# The 26B-A4B's layout in small: sliding layers (window 4) of 2 KV heads × 32 with base 1e4,
# global layers (the 3rd and 6th) of 1 KV head × 64 with no V projection (K = V), base 1e6 and
# a quarter of their pairs rotated; every layer's FFN a dense GELU FFN plus 8 experts (2 routed,
# gate and up fused, per-expert scales); a scale on each layer's output.
_DEFAULTS["gemma4"] = {
    "n_layer": 6,
    "n_embd": 64,
    "n_head": 4,
    "n_head_kv": 2,
    "head_dim": 64,
    "head_dim_swa": 32,
    "n_head_kv_global": 1,
    "swa_pattern": (True, True, False, True, True, False),
    "sliding_window": 4,
    "n_ff": 128,
    "n_expert": 8,
    "n_expert_used": 2,
    "n_ff_exp": 32,
    "rope_base": 1e6,
    "rope_base_swa": 1e4,
    "rms_eps": 1e-6,
    "context_length": 256,
    "tied": True,
    "vocab": "gemma4",
    "n_embd_per_layer": 0,
    "shared_kv_layers": 0,
    "write_optional": ("layer_output_scale.weight", "ffn_gate_up_exps.weight", "ffn_down_exps.scale"),
}

# qwen35: three Gated DeltaNet layers, then one gated full-attention layer (interval 4); 2 key
# heads tiled over 4 value heads of 16, a 4-tap convolution; attention head_dim 32 with RoPE on
# its first 8 dims (partial rotary 0.25, as the real models), tied output.
_DEFAULTS["qwen35"] = {**_DEFAULTS["qwen3"], "n_layer": 4, "rope_base": 1e7, "rope_dims": 8,
                       "rope_sections": (2, 1, 1, 0), "full_attention_interval": 4, "ssm_conv_kernel": 4,
                       "ssm_key_heads": 2, "ssm_key_dim": 16, "ssm_value_heads": 4, "ssm_value_dim": 16}
# qwen35moe: qwen35 with every FFN a mixture of 8 experts of width 32, 2 routed per token, and a
# gated shared expert of width 48 (``n_ff``); gate and up stacked apart.
_DEFAULTS["qwen35moe"] = {**_DEFAULTS["qwen35"], "n_ff": 48, "n_expert": 8, "n_expert_used": 2, "n_ff_exp": 32,
                          "write_optional": ("ffn_gate_exps.weight", "ffn_up_exps.weight")}
# Both may carry multi-token-prediction blocks after the trunk (``nextn_predict_layers``,
# counted in ``block_count``); the plain tiny files have none.
for _family in ("qwen35", "qwen35moe"):
    _DEFAULTS[_family]["nextn_layers"] = 0
    _DEFAULTS[_family].setdefault("write_optional", ())

# diffusion-gemma: the gemma4 tiny layout (every layer with experts) as a text-diffusion model
# writing canvases of 8 tokens; its encoder's and decoder's layer scales differ.
_DEFAULTS["diffusion-gemma"] = {
    **_DEFAULTS["gemma4"],
    "write_optional": ("layer_output_scale.weight", "enc_layer_output_scale.weight", "ffn_gate_up_exps.weight",
                       "ffn_down_exps.scale"),
    "diffusion": {"canvas_length": 8, "eb_max_steps": 4, "eb_t_min": 0.4, "eb_t_max": 0.8,
                  "eb_entropy_bound": 0.1, "eb_stability_threshold": 1, "eb_confidence_threshold": 0.005},
}

# inkling: four layers, the third global (1 KV head, relative bias over 8 positions, length
# scaling from position 4) and the others sliding over 4 positions (2 KV heads, bias over the
# window); 4-tap convolutions; a dense first layer, then 8 routed experts of width 32 (2 chosen)
# and 2 shared; logits over 4, the last 64 ids padding; untied. An Inkling-style vocabulary
# (``inkling_vocab.py``: Qwen's, with Inkling's block tokens and pre-tokenizer).
_DEFAULTS["inkling"] = {
    "n_layer": 4, "n_embd": 64, "n_head": 4, "n_head_kv": 2, "n_head_kv_global": 1, "head_dim": 16,
    "swa_pattern": (True, True, False, True), "sliding_window": 4, "d_rel": 4, "rel_extent": 8,
    "conv_kernel": 4, "dense_layers": 1, "n_ff": 128, "n_expert": 8, "n_expert_used": 2, "n_ff_exp": 32,
    "n_shared": 2, "route_scale": 2.5, "logit_scale_denom": 4.0, "vocab_padding": 64, "log_n_floor": 4,
    "log_alpha": 0.1, "rope_base": 10000.0, "rms_eps": 1e-6, "context_length": 256, "tied": False,
    "vocab": "inkling",
}

# Variants with logit fixtures of their own: name -> (architecture, overrides). gemma4_e is the
# E2B/E4B layout in small: no experts, per-layer token embeddings of width 8, and the last two
# layers reading the KV of the last sliding (layer 2) and global (layer 3) layers before them.
# qwen3_q2_0 is qwen3 with its matrices in Q2_0 (ggml's layout, which llama.cpp reads).
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3_q2_0": ("qwen3", {"tensor_type": "Q2_0"}),
    "gemma4_e": ("gemma4", {"n_expert": 0, "n_embd_per_layer": 8, "shared_kv_layers": 2,
                            "swa_pattern": (True, True, True, False, True, False),
                            "write_optional": ("layer_output_scale.weight",)}),
}
# Tiny files with one MTP block (its own head norm written; embedding and head shared), whose
# drafts are held to llama.cpp's draft-mtp (scripts/regen_mtp_fixtures.py,
# tests/engine/test_mtp.py): name -> (architecture, overrides).
MTP_FIXTURES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen35_mtp": ("qwen35", {"nextn_layers": 1, "write_optional": ("nextn.shared_head_norm.weight",)}),
    "qwen35moe_mtp": ("qwen35moe", {"nextn_layers": 1, "write_optional": (
        "ffn_gate_exps.weight", "ffn_up_exps.weight", "nextn.shared_head_norm.weight")}),
}
# every logit fixture from llama.cpp of a tiny model: its name -> (architecture, overrides)
TINY_FIXTURES = {**{arch: (arch, {}) for arch in ARCHS + RECURRENT}, **VARIANTS}
# every tiny model with a fixture of either reference
TINY_SPECS = {**TINY_FIXTURES, **{arch: (arch, {}) for arch in TRANSFORMERS_ONLY}}

_COMMON_OVERRIDES = {"tensor_type", "name", "sampling"}

_TENSOR_TYPES = {
    "F32": (gguf.GGMLQuantizationType.F32, gguf.LlamaFileType.ALL_F32),
    "F16": (gguf.GGMLQuantizationType.F16, gguf.LlamaFileType.MOSTLY_F16),
    "Q8_0": (gguf.GGMLQuantizationType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
    # Q2_0 (type 42, which the gguf package does not know): ggml's 64-weight blocks, or
    # PrismML's 128-weight ones (rows of a multiple of 128 values, then). The weights are made
    # ternary per 128 where rows allow, so the two files hold the same values; matrices are
    # written as raw bytes and their type set afterwards.
    "Q2_0": (gguf.GGMLQuantizationType.I8, gguf.LlamaFileType.ALL_F32),
    "Q2_0_128": (gguf.GGMLQuantizationType.I8, gguf.LlamaFileType.ALL_F32),
}


@functools.lru_cache(maxsize=1)
def _smollm2_vocab() -> dict[str, Any]:
    # Opening the real GGUF costs ~3 s (the reader walks ~100k vocabulary strings), so its
    # tokenizer keys are kept as JSON in the cache directory, keyed by the file's size and
    # mtime, and a later process reads them in a few milliseconds.
    from shared.default_model import cache_dir, default_model_path
    from worker.engine.gguf_file import GGUFFile

    source = default_model_path()
    stat = source.stat()
    cached = cache_dir() / "vocab" / f"{source.stem}-{stat.st_size}-{stat.st_mtime_ns}.json"
    if cached.is_file():
        return json.loads(cached.read_text(encoding="utf-8"))
    metadata = GGUFFile(source).metadata
    vocab = {key: value for key, value in metadata.items() if key.startswith("tokenizer.")}
    cached.parent.mkdir(parents=True, exist_ok=True)
    partial = cached.with_suffix(f".{os.getpid()}.partial")
    # the reader keeps string arrays packed (PackedStrings): JSON takes them as the lists they hold
    partial.write_text(json.dumps(vocab, ensure_ascii=False, default=list), encoding="utf-8")
    os.replace(partial, cached)  # atomic, so a concurrent reader never sees half a file
    return json.loads(cached.read_text(encoding="utf-8"))  # the same lists a later process reads


@functools.lru_cache(maxsize=1)
def _qwen_vocab() -> dict[str, Any]:
    # The helper is a sibling file; import it the way this module itself was imported
    # (as ``tests.tiny_models`` or, with tests/ on sys.path, as ``tiny_models``).
    module_name = f"{__package__}.qwen_vocab" if __package__ else "qwen_vocab"
    module = importlib.import_module(module_name)
    return dict(module.qwen_vocab_metadata())


@functools.lru_cache(maxsize=1)
def _gemma4_vocab() -> dict[str, Any]:
    module_name = f"{__package__}.gemma4_vocab" if __package__ else "gemma4_vocab"
    return dict(importlib.import_module(module_name).gemma4_vocab_metadata())


@functools.lru_cache(maxsize=1)
def _inkling_vocab() -> dict[str, Any]:
    module_name = f"{__package__}.inkling_vocab" if __package__ else "inkling_vocab"
    return dict(importlib.import_module(module_name).inkling_vocab_metadata())


def vocab_metadata(vocab: str) -> dict[str, Any]:
    """The ``tokenizer.*`` keys of a real vocabulary: ``"smollm2"``, ``"qwen"``, ``"gemma4"``
    (Gemma 3's cut down to Gemma 4's form, ``gemma4_vocab.py``) or ``"inkling"`` (Qwen's in
    Inkling's form, ``inkling_vocab.py``)."""
    if vocab == "smollm2":
        return _smollm2_vocab()
    if vocab == "qwen":
        return _qwen_vocab()
    if vocab == "gemma4":
        return _gemma4_vocab()
    if vocab == "inkling":
        return _inkling_vocab()
    raise ValueError(f"unknown vocabulary {vocab!r}; expected 'smollm2', 'qwen', 'gemma4' or 'inkling'")


def add_tokenizer_keys(writer: gguf.GGUFWriter, metadata: dict[str, Any]) -> None:
    # Metadata arrives as plain Python values, so the GGUF value type is chosen from the
    # Python type; these are the types llama.cpp's loader checks for the tokenizer keys
    # (ids UINT32, flags BOOL, token_type INT32[], scores FLOAT32[], strings).
    for key in sorted(metadata):
        value = metadata[key]
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, (list, tuple)):
            writer.add_array(key, list(value))
        else:
            raise TypeError(f"cannot write tokenizer key {key!r} of type {type(value).__name__}")


def _resolve_hparams(arch: str, overrides: dict[str, Any]) -> dict[str, Any]:
    if arch not in _DEFAULTS:
        raise ValueError(f"unknown architecture {arch!r}; expected one of {ARCHS}")
    hparams = dict(_DEFAULTS[arch])
    unknown = set(overrides) - set(hparams) - _COMMON_OVERRIDES
    if unknown:
        raise TypeError(f"unknown override(s) for {arch}: {sorted(unknown)}")
    hparams.update({k: v for k, v in overrides.items() if k not in _COMMON_OVERRIDES})
    tensor_type = overrides.get("tensor_type", "F32")
    if tensor_type not in _TENSOR_TYPES:
        raise ValueError(f"tensor_type must be one of {sorted(_TENSOR_TYPES)}, got {tensor_type!r}")
    hparams["tensor_type"] = tensor_type
    if hparams["n_head"] % hparams["n_head_kv"]:
        raise ValueError("n_head must be a multiple of n_head_kv")
    return hparams


class _TensorSink:
    """Collects tensors in writing order, encoding matrices in the requested type."""

    def __init__(self, writer: gguf.GGUFWriter, tensor_type: str):
        self._writer = writer
        self._qtype = _TENSOR_TYPES[tensor_type][0]
        self._q2_0_block = {"Q2_0": 64, "Q2_0_128": 128}.get(tensor_type)
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.q2_0: dict[str, int] = {}  # tensors written as Q2_0 bytes: name -> values per row

    def add(self, name: str, array: np.ndarray, keep_f32: bool = False) -> None:
        self.shapes[name] = tuple(int(d) for d in array.shape)
        # Norm vectors stay F32 in every real quantized file (and llama.cpp requires it);
        # callers also keep the MoE router F32, as llama-quantize does.
        if keep_f32 or array.ndim < 2 or self._qtype == gguf.GGMLQuantizationType.F32:
            self._writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
        elif self._qtype == gguf.GGMLQuantizationType.F16:
            self._writer.add_tensor(name, array.astype(np.float16))
        elif self._q2_0_block is not None:
            rows = array.reshape(-1, array.shape[-1])  # a row of 64 values is ternary per 64
            common = 128 if rows.shape[-1] % 128 == 0 else 64
            ternary = q2_0.dequantize(q2_0.quantize(rows, common), common, rows.shape)
            encoded = q2_0.quantize(ternary, self._q2_0_block)
            self._writer.add_tensor(name, encoded.reshape(*array.shape[:-1], -1).view(np.int8))
            self.q2_0[name] = array.shape[-1]
        else:
            encoded = gguf.quants.quantize(array, self._qtype)
            self._writer.add_tensor(name, encoded, raw_dtype=self._qtype)


def set_q2_0_types(path: str | os.PathLike, rows: dict[str, int]) -> None:
    """Give the tensors written as raw Q2_0 bytes their type (42) and row length in values, in
    the header's tensor table (the same number of bytes: patched in place; only the header,
    which the first 256 MiB hold, is read)."""
    with open(path, "r+b") as fh:
        data = bytearray(fh.read(256 << 20))
        cursor = HeaderCursor(bytes(data))
        cursor.pos = 4 + 4
        n_tensors, n_kv = cursor.scalar("<Q"), cursor.scalar("<Q")
        for _ in range(n_kv):
            cursor.string()
            cursor.value(cursor.scalar("<I"))
        for _ in range(n_tensors):
            name = cursor.string()
            n_dims = cursor.scalar("<I")
            innermost = cursor.pos
            cursor.pos += 8 * n_dims
            if name in rows:
                struct.pack_into("<Q", data, innermost, rows[name])
                struct.pack_into("<I", data, cursor.pos, q2_0.TYPE_ID)
            cursor.pos += 4 + 8
        fh.seek(0)
        fh.write(data)


def _layer_shapes(hp: dict[str, Any]) -> tuple[LayerShape, ...]:
    """Per-layer geometry of the families whose layers differ (gemma4, qwen35), as its file says it."""
    if "full_attention_interval" in hp:
        return tuple(LayerShape(hp["n_head_kv"], hp["head_dim"], recurrent=(i + 1) % hp["full_attention_interval"] != 0)
                     for i in range(hp["n_layer"]))
    if "swa_pattern" not in hp:
        return ()
    if "d_rel" in hp:  # inkling: KV heads by kind of layer, one head size
        return tuple(LayerShape(hp["n_head_kv"] if local else hp["n_head_kv_global"], hp["head_dim"], local)
                     for local in hp["swa_pattern"])
    local = list(hp["swa_pattern"])
    first_shared = hp["n_layer"] - hp["shared_kv_layers"]
    shapes = []
    for i, is_local in enumerate(local):
        source = None
        if i >= first_shared:
            source = first_shared - 2 if is_local == local[first_shared - 2] else first_shared - 1
        shapes.append(LayerShape(hp["n_head_kv"] if is_local else hp["n_head_kv_global"],
                                 hp["head_dim_swa"] if is_local else hp["head_dim"], is_local, source))
    return tuple(shapes)


def add_gemma4_keys(writer: gguf.GGUFWriter, hp: dict[str, Any], arch: str = "gemma4") -> None:
    """gemma4's own keys (diffusion-gemma's too) from the tiny hyperparameters' names
    (swa_pattern, head_dim_swa, rope_base_swa, n_embd_per_layer, shared_kv_layers)."""
    writer.add_array(f"{arch}.attention.sliding_window_pattern", [bool(v) for v in hp["swa_pattern"]])
    writer.add_uint32(f"{arch}.attention.key_length_swa", hp["head_dim_swa"])
    writer.add_uint32(f"{arch}.attention.value_length_swa", hp["head_dim_swa"])
    writer.add_uint32(f"{arch}.rope.dimension_count_swa", hp["head_dim_swa"])
    writer.add_float32(f"{arch}.rope.freq_base_swa", float(hp["rope_base_swa"]))
    writer.add_uint32(f"{arch}.embedding_length_per_layer_input", hp["n_embd_per_layer"])
    if hp["shared_kv_layers"]:
        writer.add_uint32(f"{arch}.attention.shared_kv_layers", hp["shared_kv_layers"])


def inkling_shape(hp: dict[str, Any], n_vocab: int) -> InklingShape:
    return InklingShape(d_rel=hp["d_rel"], rel_extent=hp["rel_extent"], rel_extent_swa=hp["sliding_window"],
                        conv_kernel=hp["conv_kernel"], dense_layers=hp["dense_layers"], n_shared=hp["n_shared"],
                        route_scale=hp["route_scale"], logit_scale_denom=hp["logit_scale_denom"],
                        unpadded_vocab=n_vocab - hp["vocab_padding"], log_n_floor=hp["log_n_floor"],
                        log_alpha=hp["log_alpha"])


def add_inkling_keys(writer: gguf.GGUFWriter, hp: dict[str, Any], family: InklingShape) -> None:
    arch = "inkling"
    writer.add_array(f"{arch}.attention.sliding_window_pattern", [bool(v) for v in hp["swa_pattern"]])
    for key, value in (("d_rel", family.d_rel), ("rel_extent", family.rel_extent),
                       ("rel_extent_swa", family.rel_extent_swa), ("shortconv_kernel", family.conv_kernel),
                       ("dense_block_count", family.dense_layers), ("expert_shared_count", family.n_shared),
                       ("expert_gating_func", 2), ("log_scaling_n_floor", family.log_n_floor),
                       ("unpadded_vocab_size", family.unpadded_vocab)):
        writer.add_uint32(f"{arch}.{key}", value)
    for key, value in (("expert_weights_scale", family.route_scale),
                       ("logit_scale_denom", family.logit_scale_denom), ("log_scaling_alpha", family.log_alpha)):
        writer.add_float32(f"{arch}.{key}", value)


def write_tiny_gguf(path: str | os.PathLike, arch: str, seed: int = 0, **overrides: Any) -> dict:
    """Write a tiny random-weight GGUF of ``arch`` to ``path`` and describe it.

    Overrides: any hyperparameter key of the returned dict (``n_layer``, ``n_embd``,
    ``n_head``, ``n_head_kv``, ``head_dim``, ``n_ff``, ``n_expert``, ``n_expert_used``,
    ``n_ff_exp``, ``rope_base``, ``rms_eps``, ``context_length``, ``tied``, ``vocab``), plus
    ``tensor_type`` ("F32", "F16", "Q8_0"), ``name``, and ``sampling``: the recommended sampling
    settings the file carries, ``{"temp": 0.6, "top_k": 20}`` written as ``general.sampling.temp``…
    (integers as uint32, the rest as float32).
    """
    hp = _resolve_hparams(arch, overrides)
    vocab = vocab_metadata(hp["vocab"])
    n_vocab = len(vocab["tokenizer.ggml.tokens"])
    n_embd, n_head, n_head_kv, head_dim = hp["n_embd"], hp["n_head"], hp["n_head_kv"], hp["head_dim"]
    is_moe = bool(hp.get("n_expert"))
    name = overrides.get("name", f"tiny-{arch}-seed{seed}")

    writer = gguf.GGUFWriter(os.fspath(path), arch)
    writer.add_name(name)
    writer.add_file_type(int(_TENSOR_TYPES[hp["tensor_type"]][1]))
    writer.add_block_count(hp["n_layer"] + hp.get("nextn_layers", 0))
    writer.add_context_length(hp["context_length"])
    writer.add_embedding_length(n_embd)
    writer.add_feed_forward_length(hp["n_ff"])
    writer.add_head_count(n_head)
    shapes = _layer_shapes(hp)
    # per layer where layers differ, MTP blocks (full attention) included
    mtp_kv_heads = [n_head_kv] * hp.get("nextn_layers", 0)
    writer.add_head_count_kv([shape.n_head_kv for shape in shapes] + mtp_kv_heads if shapes else n_head_kv)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(float(hp["rope_base"]))
    writer.add_rope_dimension_count(hp.get("rope_dims", head_dim))
    writer.add_layer_norm_rms_eps(float(hp["rms_eps"]))
    if hp.get("sliding_window"):
        writer.add_sliding_window(hp["sliding_window"])
    if is_moe:
        writer.add_expert_count(hp["n_expert"])
        writer.add_expert_used_count(hp["n_expert_used"])
        writer.add_expert_feed_forward_length(hp["n_ff_exp"])
    if arch in ("gemma4", "diffusion-gemma"):
        add_gemma4_keys(writer, hp, arch)
    if arch == "diffusion-gemma":
        writer.add_bool(f"{arch}.attention.causal", False)
        for key, value in hp["diffusion"].items():
            (writer.add_float32 if isinstance(value, float) else writer.add_uint32)(f"diffusion.{key}", value)
    family = inkling_shape(hp, n_vocab) if arch == "inkling" else None
    if family is not None:
        add_inkling_keys(writer, hp, family)
    if arch == "qwen35moe":
        writer.add_expert_shared_feed_forward_length(hp["n_ff"])
    if arch in ("qwen35", "qwen35moe"):
        writer.add_ssm_conv_kernel(hp["ssm_conv_kernel"])
        writer.add_ssm_state_size(hp["ssm_key_dim"])
        writer.add_ssm_group_count(hp["ssm_key_heads"])
        writer.add_ssm_time_step_rank(hp["ssm_value_heads"])
        writer.add_ssm_inner_size(hp["ssm_value_heads"] * hp["ssm_value_dim"])
        writer.add_full_attention_interval(hp["full_attention_interval"])
        writer.add_rope_dimension_sections(list(hp["rope_sections"]))
        if hp["nextn_layers"]:
            writer.add_uint32(f"{arch}.nextn_predict_layers", hp["nextn_layers"])
    add_tokenizer_keys(writer, vocab)
    for key, value in overrides.get("sampling", {}).items():
        (writer.add_uint32 if isinstance(value, int) else writer.add_float32)(f"general.sampling.{key}", value)

    rng = np.random.default_rng(seed)

    def normal(shape: tuple[int, ...], std: float) -> np.ndarray:
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(std)

    def norm_weight(size: int) -> np.ndarray:
        # Near 1 so activations keep unit scale, but not exactly 1 so a missing or
        # misapplied norm changes the logits.
        return np.float32(1.0) + normal((size,), 0.1)

    sink = _TensorSink(writer, hp["tensor_type"])
    # Embedding std 0.3: with a unit-RMS final hidden state, tied logits get std ~2.4, peaked
    # enough for a clear top-1 but far from one-hot.
    sink.add("token_embd.weight", normal((n_vocab, n_embd), 0.3))
    declared = HParams(
        n_vocab=n_vocab, n_embd=n_embd, n_layer=hp["n_layer"], n_head=n_head, n_head_kv=n_head_kv,
        head_dim=head_dim, value_dim=head_dim, n_ff=hp["n_ff"], context_length=hp["context_length"],
        rope_base=float(hp["rope_base"]), rope_dims=hp.get("rope_dims", head_dim), rope_freq_scale=1.0,
        rms_eps=float(hp["rms_eps"]), n_expert=hp.get("n_expert", 0), n_expert_used=hp.get("n_expert_used", 0),
        n_ff_expert=hp.get("n_ff_exp", 0), layers=shapes, n_embd_per_layer=hp.get("n_embd_per_layer", 0),
        linear_attention=LinearAttention(hp["ssm_conv_kernel"], hp["ssm_key_heads"], hp["ssm_key_dim"],
                                         hp["ssm_value_heads"], hp["ssm_value_dim"])
        if "ssm_conv_kernel" in hp else None, family=family)
    written_optional = set(hp.get("write_optional", ()))
    for tensor in ARCHITECTURES[arch].global_tensors(declared):
        if tensor.kind == FACTORS:  # "proportional" RoPE: the first quarter of the pairs rotate
            rotated = tensor.shape[0] // 4
            value = np.where(np.arange(tensor.shape[0]) < rotated, 1.0, 1e30).astype(np.float32)
        elif tensor.kind == NORM:
            value = norm_weight(tensor.shape[0])
        else:
            value = normal(tensor.shape, 1.0 / np.sqrt(tensor.shape[-1]))
        sink.add(tensor.name, value, keep_f32=tensor.kind not in (MATRIX, TABLE))
    # the trunk's layers, then any MTP blocks (declared by the family for indices past the trunk)
    for layer in range(hp["n_layer"] + hp.get("nextn_layers", 0)):
        for tensor in ARCHITECTURES[arch].layer_tensors(declared, layer):
            if tensor.optional and tensor.name not in written_optional:
                continue
            if tensor.kind == NORM:
                value = norm_weight(tensor.shape[0])
            elif tensor.name == "ssm_a":  # -exp(A_log): a decay, always negative
                value = -np.exp(normal(tensor.shape, 0.5))
            elif tensor.name == "ffn_gscale.weight":
                value = norm_weight(1)
            elif tensor.name.startswith("shortconv_"):  # small taps: y + conv(y) stays near y
                value = normal(tensor.shape, 0.2)
            else:
                # gain/sqrt(n_in) keeps a unit-variance input at unit variance; projections
                # that write the residual stream use gain 0.5 so the token embedding is not
                # washed out after a few layers.
                gain = 0.5 if tensor.name.startswith(("attn_output.", "ffn_down")) else 1.0
                value = normal(tensor.shape, gain / np.sqrt(tensor.shape[-1]))
            # the router stays F32, as llama-quantize keeps it
            sink.add(f"blk.{layer}.{tensor.name}", value, keep_f32=tensor.kind == DENSE)
    sink.add("output_norm.weight", norm_weight(n_embd))
    if not hp["tied"]:
        sink.add("output.weight", normal((n_vocab, n_embd), 0.3))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if sink.q2_0:
        set_q2_0_types(path, sink.q2_0)

    info: dict[str, Any] = {"arch": arch, "seed": seed, "name": name, "path": os.fspath(path),
                            "n_vocab": n_vocab, **hp, "tensor_shapes": sink.shapes,
                            # each layer's KV heads and head size (all alike but in gemma4)
                            "layer_kv_heads": [declared.layer(i).n_head_kv for i in range(hp["n_layer"])],
                            "layer_head_dims": [declared.layer(i).head_dim for i in range(hp["n_layer"])]}
    if not is_moe:
        for key in ("n_expert", "n_expert_used", "n_ff_exp"):
            info.setdefault(key, 0)
    return info


def load_tiny(folder: str | os.PathLike, name: str, seed: int = 1):
    """The engine of a family's tiny model (a TINY_SPECS name, or ``nanochat``, a checkpoint
    folder), written into ``folder``."""
    from tiny_nanochat import write_tiny_nanochat

    from worker.engine import Engine
    folder = os.fspath(folder)
    if name == "nanochat":
        write_tiny_nanochat(os.path.join(folder, "nanochat"))
        return Engine.load(os.path.join(folder, "nanochat"))
    arch, overrides = TINY_SPECS[name]
    write_tiny_gguf(os.path.join(folder, f"{name}.gguf"), arch, seed=seed, **overrides)
    return Engine.load(os.path.join(folder, f"{name}.gguf"))
