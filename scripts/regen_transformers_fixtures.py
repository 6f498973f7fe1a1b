"""Regenerate the tiny models' reference from the ``transformers`` package: the second reference
of the gemma models, and the only one so far of qwen35.

    python scripts/regen_transformers_fixtures.py [gemma3_tiny gemma4_tiny gemma4_e_tiny qwen35_tiny]

in a venv with torch (CPU), transformers 5.23, gguf, numpy and lmserve's own dependencies
(``tests/tiny_models.py`` writes the GGUF files). For each tiny model it writes the GGUF, reads
it back with the ``gguf`` package's reader, renames its tensors to the Hugging Face model's
(Gemma 3's norms stored as 1 + w, so w = stored − 1; Gemma 4's as they are), builds the
transformers model from the matching config, and records its logits for the llama.cpp
fixture's tokens as ``tests/fixtures/logits_<name>_hf.npz`` (``fixture_files.save_fixture``).
llama.cpp and transformers were written independently; the engine is held to both.

qwen35 undoes its converter's changes: norms stored as 1 + w (all but ``ssm_norm``), ``ssm_a``
stored as −exp(A_log), the convolution squeezed to [channels, K], and the value heads (and
everything per value head) tiled, j ↦ key head j mod H_k, where transformers groups them,
j ↦ j // (H_v/H_k). It has no llama.cpp fixture yet, so its tokens are qwen3_tiny's.
"""

from __future__ import annotations

import importlib.metadata
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO_ROOT), str(REPO_ROOT / "tests")]

import torch  # noqa: E402
from fixture_files import FIXTURE_DIR, save_fixture, sha256_of  # noqa: E402
from gguf import GGUFReader  # noqa: E402
from tiny_models import TINY_SPECS, write_tiny_gguf  # noqa: E402

NAMES = ("gemma3_tiny", "gemma4_tiny", "gemma4_e_tiny", "qwen35_tiny", "qwen35moe_tiny")
# whose llama.cpp fixture lends its tokens
TOKENS_OF = {"qwen35_tiny": "qwen3_tiny", "qwen35moe_tiny": "qwen3_tiny"}
LAYER_NAMES = {  # GGUF name after blk.N. -> Hugging Face name after model.layers.N.
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    # gemma4
    "layer_output_scale.weight": "layer_scalar",
    "ffn_gate_inp.weight": "router.proj.weight",
    "ffn_gate_inp.scale": "router.scale",
    "ffn_down_exps.scale": "router.per_expert_scale",
    "ffn_gate_up_exps.weight": "experts.gate_up_proj",
    "ffn_down_exps.weight": "experts.down_proj",
    "pre_ffw_norm_2.weight": "pre_feedforward_layernorm_2.weight",
    "post_ffw_norm_1.weight": "post_feedforward_layernorm_1.weight",
    "post_ffw_norm_2.weight": "post_feedforward_layernorm_2.weight",
    "inp_gate.weight": "per_layer_input_gate.weight",
    "proj.weight": "per_layer_projection.weight",
    "post_norm.weight": "post_per_layer_input_norm.weight",
}
# qwen35: the attention and FFN names as gemma's (its pre-FFN norm is post_attention_norm,
# which maps alike), and its linear-attention layers'
QWEN35_NAMES = {**LAYER_NAMES,
                "attn_qkv.weight": "linear_attn.in_proj_qkv.weight",
                "attn_gate.weight": "linear_attn.in_proj_z.weight",
                "ssm_conv1d.weight": "linear_attn.conv1d.weight",
                "ssm_dt.bias": "linear_attn.dt_bias",
                "ssm_a": "linear_attn.A_log",
                "ssm_beta.weight": "linear_attn.in_proj_b.weight",
                "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
                "ssm_norm.weight": "linear_attn.norm.weight",
                "ssm_out.weight": "linear_attn.out_proj.weight",
                # qwen35moe
                "ffn_gate_inp.weight": "mlp.gate.weight",
                "ffn_down_exps.weight": "mlp.experts.down_proj",
                "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
                "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
                "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
                "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight"}
GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "per_layer_token_embd.weight": "model.embed_tokens_per_layer.weight",
    "per_layer_model_proj.weight": "model.per_layer_model_projection.weight",
    "per_layer_proj_norm.weight": "model.per_layer_projection_norm.weight",
}


def state_dict(path: Path, norm_shift: float) -> dict[str, torch.Tensor]:
    out = {}
    for tensor in GGUFReader(str(path)).tensors:
        name = tensor.name
        values = np.array(tensor.data, dtype=np.float32).reshape([int(d) for d in reversed(tensor.shape)])
        if name == "rope_freqs.weight":
            continue  # transformers computes the proportional rotation from its config
        if name.endswith("norm.weight"):
            values = values - norm_shift
        if name.startswith("blk."):
            _, layer, rest = name.split(".", 2)
            name = f"model.layers.{layer}.{LAYER_NAMES[rest]}"
        else:
            name = GLOBAL_NAMES[name]
        out[name] = torch.from_numpy(values)
    if "lm_head.weight" not in out:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def grouped_order(info: dict) -> np.ndarray:
    """For each value head in transformers' grouped order, the GGUF's (tiled) head it is."""
    key_heads, value_heads = info["ssm_key_heads"], info["ssm_value_heads"]
    per_key = value_heads // key_heads
    return np.array([(j % per_key) * key_heads + j // per_key for j in range(value_heads)])


def qwen35_state_dict(path: Path, info: dict) -> dict[str, torch.Tensor]:
    order = grouped_order(info)
    value_dim, keys = info["ssm_value_dim"], 2 * info["ssm_key_heads"] * info["ssm_key_dim"]

    def by_head(values: np.ndarray, width: int, axis: int = 0) -> np.ndarray:
        """Reorder ``values``' value heads (``width`` entries each along ``axis``) tiled -> grouped."""
        moved = np.moveaxis(values, axis, 0)
        heads = moved.reshape(len(order), width, *moved.shape[1:])[order]
        return np.moveaxis(heads.reshape(moved.shape), 0, axis)

    out = {}
    stacked: dict[str, dict[str, np.ndarray]] = {}
    for tensor in GGUFReader(str(path)).tensors:
        values = np.array(tensor.data, dtype=np.float32).reshape([int(d) for d in reversed(tensor.shape)])
        name = tensor.name
        if not name.startswith("blk."):
            if name == "output_norm.weight":
                values = values - 1.0
            out[GLOBAL_NAMES[name]] = torch.from_numpy(np.ascontiguousarray(values))
            continue
        _, layer, rest = name.split(".", 2)
        if rest.endswith("norm.weight") and rest != "ssm_norm.weight":
            values = values - 1.0
        if rest in ("attn_qkv.weight", "ssm_conv1d.weight"):
            values = np.concatenate([values[:keys], by_head(values[keys:], value_dim)])
        elif rest == "attn_gate.weight":
            values = by_head(values, value_dim)
        elif rest in ("ssm_beta.weight", "ssm_alpha.weight", "ssm_dt.bias", "ssm_a"):
            values = by_head(values, 1)
        elif rest == "ssm_out.weight":
            values = by_head(values, value_dim, axis=1)
        if rest == "ssm_a":
            values = np.log(-values)
        if rest == "ssm_conv1d.weight":
            values = values[:, None, :]
        if rest == "ffn_gate_inp_shexp.weight":
            values = values[None, :]  # a [1, D] projection there
        if rest in ("ffn_gate_exps.weight", "ffn_up_exps.weight"):  # stacked as one [E, 2F, D] there
            stacked.setdefault(layer, {})[rest] = values
            continue
        out[f"model.layers.{layer}.{QWEN35_NAMES[rest]}"] = torch.from_numpy(np.ascontiguousarray(values))
    for layer, parts in stacked.items():
        both = np.concatenate([parts["ffn_gate_exps.weight"], parts["ffn_up_exps.weight"]], axis=1)
        out[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.from_numpy(both)
    out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def qwen35_model(info: dict) -> torch.nn.Module:
    from transformers import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, Qwen3_5TextConfig

    interval = info["full_attention_interval"]
    moe = info["arch"] == "qwen35moe"
    extra = dict(num_experts=info["n_expert"], num_experts_per_tok=info["n_expert_used"],
                 moe_intermediate_size=info["n_ff_exp"], shared_expert_intermediate_size=info["n_ff"]) if moe else {}
    config = (Qwen3_5MoeTextConfig if moe else Qwen3_5TextConfig)(**extra,
        vocab_size=info["n_vocab"], hidden_size=info["n_embd"], intermediate_size=info["n_ff"],
        num_hidden_layers=info["n_layer"], num_attention_heads=info["n_head"],
        num_key_value_heads=info["n_head_kv"], head_dim=info["head_dim"], rms_norm_eps=info["rms_eps"],
        linear_conv_kernel_dim=info["ssm_conv_kernel"], linear_key_head_dim=info["ssm_key_dim"],
        linear_value_head_dim=info["ssm_value_dim"], linear_num_key_heads=info["ssm_key_heads"],
        linear_num_value_heads=info["ssm_value_heads"],
        layer_types=["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                     for i in range(info["n_layer"])],
        rope_parameters={"rope_type": "default", "rope_theta": info["rope_base"],
                         "partial_rotary_factor": info["rope_dims"] / info["head_dim"],
                         "mrope_section": list(info["rope_sections"][:3])},
        max_position_embeddings=info["context_length"], tie_word_embeddings=True)
    return (Qwen3_5MoeForCausalLM if moe else Qwen3_5ForCausalLM)(config)


def model_for(info: dict) -> tuple[torch.nn.Module, float]:
    """The transformers model of a tiny GGUF's hyperparameters, and its norms' stored shift."""
    layer_types = ["sliding_attention" if local else "full_attention"
                   for local in (info.get("swa_pattern") or [i % 6 < 5 for i in range(info["n_layer"])])]
    common = dict(vocab_size=info["n_vocab"], hidden_size=info["n_embd"], intermediate_size=info["n_ff"],
                  num_hidden_layers=info["n_layer"], num_attention_heads=info["n_head"],
                  num_key_value_heads=info["n_head_kv"], rms_norm_eps=info["rms_eps"],
                  sliding_window=info["sliding_window"], layer_types=layer_types,
                  max_position_embeddings=info["context_length"], tie_word_embeddings=True)
    if info["arch"] == "gemma3":
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        config = Gemma3TextConfig(**common, head_dim=info["head_dim"], query_pre_attn_scalar=info["head_dim"],
                                  rope_parameters={"full_attention": {"rope_type": "default",
                                                                      "rope_theta": info["rope_base"]},
                                                   "sliding_attention": {"rope_type": "default",
                                                                         "rope_theta": 10000.0}})
        return Gemma3ForCausalLM(config), 1.0
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    config = Gemma4TextConfig(
        **common, head_dim=info["head_dim_swa"], global_head_dim=info["head_dim"],
        num_global_key_value_heads=info["n_head_kv_global"], attention_k_eq_v=True,
        hidden_size_per_layer_input=info["n_embd_per_layer"], vocab_size_per_layer_input=info["n_vocab"],
        num_kv_shared_layers=info["shared_kv_layers"],
        enable_moe_block=bool(info["n_expert"]), num_experts=info["n_expert"] or None,
        top_k_experts=info["n_expert_used"] or None, moe_intermediate_size=info["n_ff_exp"] or None,
        final_logit_softcapping=30.0,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": info["rope_base_swa"]},
                         "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                            "rope_theta": info["rope_base"]}})
    return Gemma4ForCausalLM(config), 0.0


def main(argv: list[str]) -> int:
    names = argv or list(NAMES)
    for name in names:
        arch, overrides = TINY_SPECS[name.removesuffix("_tiny")]
        lender = TOKENS_OF.get(name, name)
        with np.load(FIXTURE_DIR / f"logits_{lender}.npz") as data:
            tokens = data["tokens"].tolist()  # the llama.cpp fixture's tokens
        with tempfile.TemporaryDirectory() as scratch:
            info = write_tiny_gguf(Path(scratch) / f"{name}.gguf", arch, seed=0, **overrides)
            if arch in ("qwen35", "qwen35moe"):
                model, weights = qwen35_model(info), qwen35_state_dict(Path(info["path"]), info)
            else:
                model, shift = model_for(info)
                weights = state_dict(Path(info["path"]), shift)
            missing, unexpected = model.load_state_dict(weights, strict=False)
            buffers = {n for n, _ in model.named_buffers()}
            if unexpected or set(missing) - buffers:
                raise SystemExit(f"{name}: state dict mismatch: missing {missing}, unexpected {unexpected}")
            model.config._attn_implementation = "eager"
            model.eval()
            with torch.no_grad():
                logits = model(torch.tensor([tokens])).logits[0].float().numpy()
            meta = {"name": f"{name}_hf", "reference": f"transformers {importlib.metadata.version('transformers')} "
                    f"{type(model).__name__}", "torch": torch.__version__,
                    "eval": "one forward of the whole token list, float32, eager attention",
                    "model": {"kind": "tiny_models.write_tiny_gguf", "arch": arch, "seed": 0, "overrides": overrides,
                              "sha256": sha256_of(Path(info["path"]))},
                    "tokens": f"those of logits_{lender}.npz"}
            save_fixture(f"{name}_hf", tokens, logits, json.loads(json.dumps(meta)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
