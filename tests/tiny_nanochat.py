"""Tiny nanochat checkpoint directories for tests, written from a fixed numpy seed.

Two layouts, as ``worker/engine/checkpoint.py`` reads them:

* ``"hf"``: the Hugging Face port's (``config.json``, ``model.layers.N…`` names): the original
  nanochat, which the ``transformers`` package runs (``scripts/regen_nanochat_fixtures.py``).
* ``"native"``: nanochat's own names and ``meta_000000.json``, with every feature its 2026 code
  has: residual and x0 lambdas, value embeddings with their gates on alternate layers (the last
  included), the smear, the backout, and an ``SSSL`` window pattern (sequence_len 256: the
  short window is 128 positions back).

Both have 4 layers of width 64, 4 query heads and 2 KV heads, and the SmolLM2 vocabulary as a
``tokenizer.json`` with nanochat's split and its nine special tokens after the 49,152 pieces
(49,161 tokens; the embedding padded to 49,216 rows, a multiple of 64). Weights are float32
(``dtype="BF16"`` writes them as bfloat16, by their top 16 bits). The same arguments always
give the same bytes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file
from tiny_models import vocab_metadata

from worker.engine.checkpoint import CONTROL_TOKENS, SPLIT_PATTERN, TOOL_TOKENS, write_safetensors

SPECIAL_TOKENS = (*CONTROL_TOKENS[:5], TOOL_TOKENS[0], TOOL_TOKENS[1], *CONTROL_TOKENS[5:])
N_LAYER, N_EMBD, N_HEAD, N_KV_HEAD, SEQUENCE_LEN = 4, 64, 4, 2, 256


def tokenizer_json() -> dict[str, Any]:
    """SmolLM2's byte-level pieces and merges with nanochat's split and special tokens."""
    meta = vocab_metadata("smollm2")
    pieces = meta["tokenizer.ggml.tokens"]
    added = [{"id": len(pieces) + i, "content": text, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for i, text in enumerate(SPECIAL_TOKENS)]
    return {
        "version": "1.0",
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": SPLIT_PATTERN}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {piece: i for i, piece in enumerate(pieces)},
                  "merges": list(meta["tokenizer.ggml.merges"])},
    }


def has_value_embedding(layer: int) -> bool:
    return layer % 2 == (N_LAYER - 1) % 2


def write_tiny_nanochat(folder: str | os.PathLike, layout: str = "native", seed: int = 0,
                        dtype: str = "F32") -> dict[str, Any]:
    """Write a tiny checkpoint directory; returns its description (path, vocabulary sizes)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = tokenizer_json()
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False), encoding="utf-8")
    vocab = len(tokenizer["model"]["vocab"]) + len(tokenizer["added_tokens"])
    padded = -(-vocab // 64) * 64
    rng = np.random.default_rng(seed)
    kv = N_KV_HEAD * N_EMBD // N_HEAD

    def normal(shape: tuple[int, ...], std: float) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    native = layout == "native"
    names = ({"wte": "transformer.wte.weight", "q": "transformer.h.{}.attn.c_q.weight",
              "k": "transformer.h.{}.attn.c_k.weight", "v": "transformer.h.{}.attn.c_v.weight",
              "o": "transformer.h.{}.attn.c_proj.weight", "fc": "transformer.h.{}.mlp.c_fc.weight",
              "proj": "transformer.h.{}.mlp.c_proj.weight"} if native else
             {"wte": "model.embed_tokens.weight", "q": "model.layers.{}.self_attn.q_proj.weight",
              "k": "model.layers.{}.self_attn.k_proj.weight", "v": "model.layers.{}.self_attn.v_proj.weight",
              "o": "model.layers.{}.self_attn.o_proj.weight", "fc": "model.layers.{}.mlp.fc1.weight",
              "proj": "model.layers.{}.mlp.fc2.weight"})
    tensors: dict[str, np.ndarray] = {names["wte"]: normal((padded, N_EMBD), 1.0),
                                      "lm_head.weight": normal((padded, N_EMBD), 0.3)}
    for i in range(N_LAYER):
        tensors[names["q"].format(i)] = normal((N_EMBD, N_EMBD), N_EMBD ** -0.5)
        tensors[names["k"].format(i)] = normal((kv, N_EMBD), N_EMBD ** -0.5)
        tensors[names["v"].format(i)] = normal((kv, N_EMBD), N_EMBD ** -0.5)
        tensors[names["o"].format(i)] = normal((N_EMBD, N_EMBD), 0.5 * N_EMBD ** -0.5)
        tensors[names["fc"].format(i)] = normal((4 * N_EMBD, N_EMBD), N_EMBD ** -0.5)
        tensors[names["proj"].format(i)] = normal((N_EMBD, 4 * N_EMBD), 0.5 * (4 * N_EMBD) ** -0.5)
        if native and has_value_embedding(i):
            tensors[f"value_embeds.{i}.weight"] = normal((padded, kv), 0.5)
            tensors[f"transformer.h.{i}.attn.ve_gate.weight"] = normal((N_KV_HEAD, 12), 0.5)
    if native:
        tensors["resid_lambdas"] = (1.15 - 0.1 * np.arange(N_LAYER) / (N_LAYER - 1)).astype(np.float32)
        tensors["x0_lambdas"] = (0.2 - 0.15 * np.arange(N_LAYER) / (N_LAYER - 1)).astype(np.float32)
        tensors["smear_gate.weight"] = normal((1, 24), 0.5)
        tensors["smear_lambda"] = np.array([0.6], dtype=np.float32)
        tensors["backout_lambda"] = np.array([0.2], dtype=np.float32)
    if dtype == "BF16":  # safetensors' numpy interface has no bfloat16: write those bytes here
        _save_bf16(tensors, folder / "model.safetensors")
    else:
        save_file(tensors, str(folder / "model.safetensors"))
    if native:
        config = {"sequence_len": SEQUENCE_LEN, "vocab_size": vocab, "n_layer": N_LAYER, "n_head": N_HEAD,
                  "n_kv_head": N_KV_HEAD, "n_embd": N_EMBD, "window_pattern": "SSSL"}
        (folder / "meta_000000.json").write_text(json.dumps({"step": 0, "model_config": config}), encoding="utf-8")
    else:
        config = {"architectures": ["NanoChatForCausalLM"], "model_type": "nanochat", "vocab_size": padded,
                  "hidden_size": N_EMBD, "intermediate_size": 4 * N_EMBD, "num_hidden_layers": N_LAYER,
                  "num_attention_heads": N_HEAD, "num_key_value_heads": N_KV_HEAD,
                  "max_position_embeddings": SEQUENCE_LEN, "hidden_act": "relu2", "rms_norm_eps": 1e-6,
                  "final_logit_softcapping": 15.0, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
                  "tie_word_embeddings": False, "bos_token_id": vocab - len(SPECIAL_TOKENS),
                  "eos_token_id": vocab - len(SPECIAL_TOKENS) + 4, "pad_token_id": 0}
        (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return {"path": str(folder), "layout": layout, "seed": seed, "vocab": vocab, "padded_vocab": padded,
            "dtype": dtype}


def _save_bf16(tensors: dict[str, np.ndarray], path: Path) -> None:
    write_safetensors(path, {name: ("BF16", array.shape, (np.ascontiguousarray(array, dtype=np.float32).view(np.uint32)
                                                        >> 16).astype(np.uint16).tobytes())
                             for name, array in tensors.items()})
