"""The tiny synthetic GGUF writer: files open with our loader, say what they claim, and are
reproducible byte for byte (the logit fixtures depend on that)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from tiny_models import ARCHS, write_tiny_gguf

from worker.engine.archs import load_model
from worker.engine.gguf_file import GGUFFile


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[dict, GGUFFile]]:
    # Opening a file with a full vocabulary takes seconds, so each architecture is written
    # and opened once for the whole module.
    out: dict[str, tuple[dict, GGUFFile]] = {}
    root = tmp_path_factory.mktemp("tiny")
    for arch in ARCHS:
        info = write_tiny_gguf(root / f"{arch}.gguf", arch, seed=0)
        out[arch] = (info, GGUFFile(info["path"]))
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_header_matches_description(written: dict, arch: str) -> None:
    info, gguf_file = written[arch]
    meta = gguf_file.metadata
    assert gguf_file.architecture == arch
    assert meta[f"{arch}.block_count"] == info["n_layer"]
    assert meta[f"{arch}.embedding_length"] == info["n_embd"]
    assert meta[f"{arch}.attention.head_count"] == info["n_head"]
    kv_heads = meta[f"{arch}.attention.head_count_kv"]
    assert (kv_heads if isinstance(kv_heads, list) else [kv_heads] * info["n_layer"]) == info["layer_kv_heads"]
    assert meta[f"{arch}.attention.key_length"] == info["head_dim"]
    assert meta[f"{arch}.rope.dimension_count"] == info["head_dim"]
    assert meta[f"{arch}.context_length"] == 256
    assert meta[f"{arch}.rope.freq_base"] == pytest.approx(info["rope_base"])
    assert len(meta["tokenizer.ggml.tokens"]) == info["n_vocab"]
    if info["n_expert"]:
        assert meta[f"{arch}.expert_count"] == info["n_expert"]
        assert meta[f"{arch}.expert_used_count"] == info["n_expert_used"]
        assert meta[f"{arch}.expert_feed_forward_length"] == info["n_ff_exp"]


@pytest.mark.parametrize("arch", ARCHS)
def test_tensor_shapes_are_numpy_order(written: dict, arch: str) -> None:
    info, gguf_file = written[arch]
    assert sorted(gguf_file.tensor_names) == sorted(info["tensor_shapes"])
    for name, shape in info["tensor_shapes"].items():
        assert gguf_file.tensor_info(name).shape == shape, name
        assert gguf_file.tensor_info(name).type_name == "F32", name

    n_embd, head_dim = info["n_embd"], info["layer_head_dims"][0]
    assert gguf_file.tensor_info("token_embd.weight").shape == (info["n_vocab"], n_embd)
    assert gguf_file.tensor_info("blk.0.attn_q.weight").shape == (info["n_head"] * head_dim, n_embd)
    assert gguf_file.tensor_info("blk.0.attn_k.weight").shape == (info["layer_kv_heads"][0] * head_dim, n_embd)
    assert gguf_file.tensor_info("blk.0.attn_output.weight").shape == (n_embd, info["n_head"] * head_dim)
    last = info["n_layer"] - 1
    assert gguf_file.has_tensor(f"blk.{last}.ffn_norm.weight")
    assert not gguf_file.has_tensor(f"blk.{last + 1}.ffn_norm.weight")
    assert gguf_file.has_tensor("output.weight") == (not info["tied"])
    # every tensor the architecture declares (and only those) was written, in its shape
    model = load_model(gguf_file)
    declared = {f"blk.{i}.{t.name}": t.shape for i in range(info["n_layer"])
                for t in model.layer_tensors(model.hp, i) if not t.optional or t.name in info.get("write_optional", ())}
    assert {n: s for n, s in info["tensor_shapes"].items() if n.startswith("blk.")} == declared


def test_llama_is_untied_and_qwen3_is_tied(written: dict) -> None:
    assert written["llama"][0]["tied"] is False
    assert written["qwen3"][0]["tied"] is True


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path: Path) -> None:
    first = write_tiny_gguf(tmp_path / "a.gguf", "llama", seed=7)
    second = write_tiny_gguf(tmp_path / "b.gguf", "llama", seed=7)
    third = write_tiny_gguf(tmp_path / "c.gguf", "llama", seed=8)
    a, b, c = (Path(info["path"]).read_bytes() for info in (first, second, third))
    assert a == b
    assert len(a) == len(c) and a != c


def test_q8_0_variant_quantizes_matrices_only(tmp_path: Path) -> None:
    # The smaller SmolLM2 vocabulary keeps the two opens quick; the weights of both files
    # come from the same random stream, so they differ only by quantization.
    exact_info = write_tiny_gguf(tmp_path / "f32.gguf", "qwen3moe", seed=0, vocab="smollm2")
    info = write_tiny_gguf(tmp_path / "q8.gguf", "qwen3moe", seed=0, vocab="smollm2",
                           tensor_type="Q8_0")
    reference, quantized = GGUFFile(exact_info["path"]), GGUFFile(info["path"])
    assert quantized.metadata["general.file_type"] == 7  # MOSTLY_Q8_0
    assert quantized.tensor_info("blk.0.ffn_up_exps.weight").type_name == "Q8_0"
    assert quantized.tensor_info("token_embd.weight").type_name == "Q8_0"
    assert quantized.tensor_info("blk.0.attn_k_norm.weight").type_name == "F32"
    assert quantized.tensor_info("blk.0.ffn_gate_inp.weight").type_name == "F32"
    exact = reference.tensor("blk.1.ffn_down_exps.weight")
    approx = quantized.tensor("blk.1.ffn_down_exps.weight", shape=exact.shape)
    # Q8_0 keeps each 32-value block to within half a step of its scale (amax / 127).
    assert np.max(np.abs(approx - exact)) <= np.max(np.abs(exact)) / 127
    assert not np.array_equal(approx, exact)


def test_unknown_override_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="n_embed"):
        write_tiny_gguf(tmp_path / "x.gguf", "llama", n_embed=32)
