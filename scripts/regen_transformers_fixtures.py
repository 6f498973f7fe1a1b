"""Regenerate the tiny models' reference from the ``transformers`` package: the second reference
of the gemma and qwen35 models, and the only one of inkling (which llama.cpp does not have).

    python scripts/regen_transformers_fixtures.py [gemma3_tiny gemma4_tiny gemma4_e_tiny qwen35_tiny inkling_tiny]

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
j ↦ j // (H_v/H_k). Its tokens, and inkling's, are qwen3_tiny's.

inkling's tensors keep their values; the experts' gate and up are stacked as transformers
holds them, the convolutions get their channel axis, and ``ffn_gscale`` is the dense MLP's or
the router's global scale.
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

NAMES = ("gemma3_tiny", "gemma4_tiny", "gemma4_e_tiny", "qwen35_tiny", "qwen35moe_tiny", "inkling_tiny",
         "diffusion-gemma_tiny")
# whose llama.cpp fixture lends its tokens
TOKENS_OF = {"qwen35_tiny": "qwen3_tiny", "qwen35moe_tiny": "qwen3_tiny", "inkling_tiny": "qwen3_tiny",
             "diffusion-gemma_tiny": "gemma4_tiny"}
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
    # diffusion-gemma: the encoder's own layer scale (moved to the encoder's layers below)
    "enc_layer_output_scale.weight": "enc_layer_scalar",
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
    # diffusion-gemma's self-conditioning (its decoder's, below)
    "self_cond_pre_norm.weight": "model.self_conditioning.pre_norm.weight",
    **{f"self_cond_{n}.weight": f"model.self_conditioning.{n}_proj.weight" for n in ("gate", "up", "down")},
}


def gguf_arrays(path: Path):
    """Each tensor of a GGUF file by name, as float32 in numpy's order (rows first)."""
    for tensor in GGUFReader(str(path)).tensors:
        yield tensor.name, np.array(tensor.data, dtype=np.float32).reshape([int(d) for d in reversed(tensor.shape)])


def state_dict(path: Path, norm_shift: float) -> dict[str, torch.Tensor]:
    out = {}
    for name, values in gguf_arrays(path):
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
    for name, values in gguf_arrays(path):
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


# inkling: GGUF name after blk.N. -> Hugging Face name after model.layers.N. (the MoE's
# stacked gate and up, and the convolutions' [C, 1, K] weights, are made below)
INKLING_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    **{f"attn_{n}.weight": f"self_attn.{n}_proj.weight" for n in "qkvr"},
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_rel_proj.weight": "self_attn.rel_logits_proj.proj",
    "shortconv_k.weight": "self_attn.k_sconv.conv1d.weight",
    "shortconv_v.weight": "self_attn.v_sconv.conv1d.weight",
    "shortconv_attn.weight": "attn_sconv.conv1d.weight",
    "shortconv_mlp.weight": "mlp_sconv.conv1d.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj",
}


def inkling_state_dict(path: Path, info: dict) -> dict[str, torch.Tensor]:
    """The GGUF's tensors under transformers' names. ``ffn_gscale`` is the dense MLP's
    ``global_scale`` on a dense layer and the router's on a mixture layer."""
    out = {}
    stacked: dict[str, dict[str, np.ndarray]] = {}
    for name, values in gguf_arrays(path):
        if not name.startswith("blk."):
            out[{**GLOBAL_NAMES, "token_embd_norm.weight": "model.embed_tokens.embed_norm.weight"}[name]] = \
                torch.from_numpy(np.ascontiguousarray(values))
            continue
        _, layer, rest = name.split(".", 2)
        prefix = f"model.layers.{layer}."
        if rest in ("ffn_gate_exps.weight", "ffn_up_exps.weight"):
            stacked.setdefault(layer, {})[rest] = values
            continue
        if rest == "ffn_gscale.weight":
            dense = int(layer) < info["dense_layers"]
            out[prefix + ("mlp.global_scale" if dense else "mlp.gate.global_scale")] = torch.from_numpy(values)
            continue
        if rest.startswith("shortconv_"):
            values = values[:, None, :]
        out[prefix + INKLING_NAMES[rest]] = torch.from_numpy(np.ascontiguousarray(values))
    for layer, parts in stacked.items():
        both = np.concatenate([parts["ffn_gate_exps.weight"], parts["ffn_up_exps.weight"]], axis=1)
        out[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.from_numpy(both)
    return out


def inkling_model(info: dict) -> torch.nn.Module:
    from transformers import InklingForCausalLM, InklingTextConfig

    n_layer = info["n_layer"]
    config = InklingTextConfig(
        vocab_size=info["n_vocab"], unpadded_vocab_size=info["n_vocab"] - info["vocab_padding"],
        hidden_size=info["n_embd"], num_hidden_layers=n_layer, num_attention_heads=info["n_head"],
        num_key_value_heads=info["n_head_kv_global"], head_dim=info["head_dim"],
        swa_num_attention_heads=info["n_head"], swa_num_key_value_heads=info["n_head_kv"],
        swa_head_dim=info["head_dim"], sliding_window_size=info["sliding_window"], d_rel=info["d_rel"],
        rel_extent=info["rel_extent"], log_scaling_n_floor=info["log_n_floor"] or None,
        log_scaling_alpha=info["log_alpha"],
        layer_types=["hybrid_sliding" if local else "hybrid" for local in info["swa_pattern"]],
        mlp_layer_types=["dense" if i < info["dense_layers"] else "sparse" for i in range(n_layer)],
        max_position_embeddings=info["context_length"], rms_norm_eps=info["rms_eps"],
        conv_kernel_size=info["conv_kernel"], intermediate_size=info["n_ff"],
        moe_intermediate_size=info["n_ff_exp"], n_routed_experts=info["n_expert"],
        num_experts_per_tok=info["n_expert_used"], n_shared_experts=info["n_shared"],
        route_scale=info["route_scale"], logits_mup_width_multiplier=info["logit_scale_denom"],
        tie_word_embeddings=False)
    return InklingForCausalLM(config)


def diffusion_passes(info: dict, tokens: list[int]) -> tuple[np.ndarray, dict[str, np.ndarray], str]:
    """diffusion-gemma's three decoder passes: over a random canvas after the prompt, the same
    canvas self-conditioned on the first pass's logits at temperature 0.8, and, once the second
    pass's argmax is appended through the encoder, over a second random canvas. Returns the
    passes' logits stacked [3·C, vocab], the canvases, and the model's class name."""
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion, DynamicCache

    from transformers import DiffusionGemmaTextConfig

    text_config = DiffusionGemmaTextConfig(
        vocab_size=info["n_vocab"], hidden_size=info["n_embd"], intermediate_size=info["n_ff"],
        num_hidden_layers=info["n_layer"], num_attention_heads=info["n_head"], num_key_value_heads=info["n_head_kv"],
        head_dim=info["head_dim_swa"], global_head_dim=info["head_dim"],
        num_global_key_value_heads=info["n_head_kv_global"], rms_norm_eps=info["rms_eps"],
        sliding_window=info["sliding_window"],
        layer_types=["sliding_attention" if local else "full_attention" for local in info["swa_pattern"]],
        max_position_embeddings=info["context_length"], num_experts=info["n_expert"],
        top_k_experts=info["n_expert_used"], moe_intermediate_size=info["n_ff_exp"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": info["rope_base_swa"]},
                         "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                            "rope_theta": info["rope_base"]}})
    canvas_length = info["diffusion"]["canvas_length"]
    config = DiffusionGemmaConfig(text_config=text_config, canvas_length=canvas_length,
                                  vision_config={"model_type": "gemma4_vision", "hidden_size": 16,
                                                 "num_hidden_layers": 1, "num_attention_heads": 2,
                                                 "intermediate_size": 32})
    model = DiffusionGemmaForBlockDiffusion(config)
    weights = {}
    for name, value in state_dict(Path(info["path"]), 0.0).items():
        rest = name.removeprefix("model.")
        if rest.endswith("enc_layer_scalar"):
            weights[f"model.encoder.language_model.{rest.removesuffix('enc_layer_scalar')}layer_scalar"] = value
        elif rest.startswith("self_conditioning.") or rest.endswith("layer_scalar"):
            weights[f"model.decoder.{rest}"] = value
        elif name.startswith("model."):
            weights[f"model.decoder.{rest}"] = value
            weights[f"model.encoder.language_model.{rest}"] = value
    weights["lm_head.weight"] = weights["model.decoder.embed_tokens.weight"]
    missing, unexpected = model.load_state_dict(weights, strict=False)
    missing = [m for m in missing if "vision" not in m and "embed_vision" not in m]
    buffers = {n for n, _ in model.named_buffers()}
    if unexpected or set(missing) - buffers:
        raise SystemExit(f"diffusion-gemma: state dict mismatch: missing {missing}, unexpected {unexpected}")
    model.config._attn_implementation = "eager"
    model.config.text_config._attn_implementation = "eager"
    model.eval()
    rng = np.random.default_rng(1)
    first, second = (rng.integers(0, info["n_vocab"], canvas_length).tolist() for _ in range(2))
    with torch.no_grad():
        cache = DynamicCache(config=config.text_config)
        one = model(input_ids=torch.tensor([tokens]), past_key_values=cache,
                    decoder_input_ids=torch.tensor([first])).logits
        two = model(past_key_values=cache, decoder_input_ids=torch.tensor([first]),
                    self_conditioning_logits=one / 0.8).logits
        written = two[0].argmax(-1).tolist()
        model.model.encoder(input_ids=torch.tensor([written]), past_key_values=cache)
        three = model(past_key_values=cache, decoder_input_ids=torch.tensor([second])).logits
    logits = torch.cat([one[0], two[0], three[0]]).float().numpy()
    canvases = {"canvas": np.array(first), "written": np.array(written), "canvas2": np.array(second)}
    return logits, canvases, type(model).__name__


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
            if arch == "diffusion-gemma":
                logits, canvases, reference = diffusion_passes(info, tokens)
                meta = {"name": f"{name}_hf", "reference": f"transformers {importlib.metadata.version('transformers')} "
                        f"{reference}", "torch": torch.__version__,
                        "eval": "three decoder passes (diffusion_passes), float32, eager attention",
                        "model": {"kind": "tiny_models.write_tiny_gguf", "arch": arch, "seed": 0,
                                  "overrides": overrides, "sha256": sha256_of(Path(info["path"]))},
                        "tokens": f"those of logits_{lender}.npz"}
                save_fixture(f"{name}_hf", tokens, logits, json.loads(json.dumps(meta)), canvases)
                continue
            if arch in ("qwen35", "qwen35moe"):
                model, weights = qwen35_model(info), qwen35_state_dict(Path(info["path"]), info)
            elif arch == "inkling":
                model, weights = inkling_model(info), inkling_state_dict(Path(info["path"]), info)
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
