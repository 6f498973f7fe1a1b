"""Loading GGUF files: every tensor type the gguf package decodes, and clear errors."""

from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest
from tiny_models import write_tiny_gguf

from shared.errors import ModelLoadError
from worker.engine.archs import load_model
from worker.engine.gguf_file import DECODABLE_TYPES, GGUFFile

BLOCK_TYPES = sorted((t for t in DECODABLE_TYPES if gguf.GGML_QUANT_SIZES[t][0] > 1), key=lambda t: t.name)


def _write(path, tensors: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType | None]], arch="llama"):
    writer = gguf.GGUFWriter(str(path), arch)
    for name, (array, qtype) in tensors.items():
        writer.add_tensor(name, array, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_every_block_type_decodes_like_the_gguf_package(qtype, tmp_path):
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = 4, 2 * max(block, 256)
    rng = np.random.default_rng(int(qtype))
    raw = rng.integers(0, 256, size=(rows, cols // block * type_size), dtype=np.uint8)
    # keep fp16 scale fields finite: clear the exponent bits' top so no inf/NaN patterns appear
    raw &= np.uint8(0xBF)
    _write(tmp_path / "q.gguf", {"w": (raw, qtype)})
    expected = gguf.quants.dequantize(raw, qtype).reshape(rows, cols)
    loaded = GGUFFile(tmp_path / "q.gguf")
    assert loaded.tensor_info("w").shape == (rows, cols)
    if np.all(np.isfinite(expected)):
        np.testing.assert_array_equal(loaded.tensor("w"), expected.astype(np.float32))
    else:
        with pytest.raises(ModelLoadError, match="NaN or infinite"):
            loaded.tensor("w")


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_plain_types(dtype, tmp_path):
    array = np.arange(24, dtype=dtype).reshape(2, 3, 4)
    _write(tmp_path / "p.gguf", {"w": (array, None)})
    np.testing.assert_array_equal(GGUFFile(tmp_path / "p.gguf").tensor("w"), array.astype(np.float32))


def test_quantized_copies_of_a_model_track_the_f32_one(tmp_path):
    tokens = list(range(100, 120))
    logits = {}
    for kind in ("F32", "F16", "Q8_0"):
        write_tiny_gguf(tmp_path / f"{kind}.gguf", "llama", seed=3, tensor_type=kind)
        model = load_model(GGUFFile(tmp_path / f"{kind}.gguf"))
        logits[kind] = model.forward([(model.new_cache(32), tokens)], all_logits=True)[0]
    assert np.abs(logits["F16"] - logits["F32"]).max() < 0.05
    assert np.abs(logits["Q8_0"] - logits["F32"]).max() < 0.5


def test_missing_file(tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        GGUFFile(tmp_path / "nope.gguf")


def test_not_a_gguf_file(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"PK\x03\x04 a zip, not a model")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        GGUFFile(tmp_path / "x.gguf")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "llama.gguf"
    write_tiny_gguf(path, "llama", seed=0)
    return path


@pytest.mark.parametrize("keep", [10, 2000, -100])
def test_truncated_files_name_the_problem(tiny_llama, tmp_path, keep):
    data = tiny_llama.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:keep] if keep > 0 else data[:keep])
    with pytest.raises(ModelLoadError, match="truncated"):
        GGUFFile(cut)


def _retype(source, target, tensor: str, type_id: int) -> None:
    """Copy a GGUF, changing one tensor's type id in its header."""
    data = bytearray(source.read_bytes())
    name = tensor.encode()
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    n_dims = struct.unpack_from("<I", data, at)[0]
    struct.pack_into("<I", data, at + 4 + 8 * n_dims, type_id)
    target.write_bytes(bytes(data))


def test_undecodable_tensor_type_is_named(tiny_llama, tmp_path):
    _retype(tiny_llama, tmp_path / "q1.gguf", "blk.0.attn_q.weight", gguf.GGMLQuantizationType.Q1_0)
    with pytest.raises(ModelLoadError, match=r"attn_q.weight.*type Q1_0.*cannot dequantize"):
        load_model(GGUFFile(tmp_path / "q1.gguf"))
    _retype(tiny_llama, tmp_path / "q99.gguf", "blk.0.attn_q.weight", 99)  # no type has this id
    with pytest.raises(ModelLoadError, match=r"attn_q.weight.*type id 99"):
        load_model(GGUFFile(tmp_path / "q99.gguf"))
    # Q2_0 (42): its float32 bytes fit neither Q2_0 layout
    _retype(tiny_llama, tmp_path / "q42.gguf", "blk.0.attn_q.weight", 42)
    with pytest.raises(ModelLoadError, match=r"Q2_0 tensor 'blk.0.attn_q.weight'.*fits neither Q2_0 layout"):
        GGUFFile(tmp_path / "q42.gguf")


def test_unsupported_architecture_is_named(tmp_path):
    _write(tmp_path / "a.gguf", {"w": (np.zeros(4, np.float32), None)}, arch="mamba9")
    with pytest.raises(ModelLoadError, match=r"'mamba9' is not supported \(supported: diffusion-gemma, gemma3, gemma4, inkling, llama, nanochat, qwen3, qwen35, qwen35moe, qwen3moe\)"):
        load_model(GGUFFile(tmp_path / "a.gguf"))


def test_missing_tensor_is_named(tmp_path):
    write_tiny_gguf(tmp_path / "m.gguf", "qwen3", seed=0)
    data = (tmp_path / "m.gguf").read_bytes().replace(b"blk.1.attn_k_norm.weight", b"blk.1.attn_k_norm.weigh_")
    (tmp_path / "m2.gguf").write_bytes(data)
    with pytest.raises(ModelLoadError, match="lacks tensor 'blk.1.attn_k_norm.weight'"):
        load_model(GGUFFile(tmp_path / "m2.gguf"))


def test_wrong_shape_is_named(tmp_path):
    write_tiny_gguf(tmp_path / "s.gguf", "llama", seed=0, n_ff=96)
    gguf_file = GGUFFile(tmp_path / "s.gguf")
    gguf_file.metadata["llama.feed_forward_length"] = 64  # what the file claims vs what it holds
    with pytest.raises(ModelLoadError, match=r"ffn_gate.weight.*has shape \(96, 64\), expected \(64, 64\)"):
        load_model(gguf_file)
