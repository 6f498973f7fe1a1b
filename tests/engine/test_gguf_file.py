"""Loading GGUF files: every tensor type the gguf package decodes, and clear errors."""

from __future__ import annotations

import re
import struct
import subprocess
import sys

import gguf
import numpy as np
import pytest
from conftest import REPO
from tiny_models import write_tiny_gguf

from shared.errors import ModelLoadError
from worker.engine.archs import load_model
from worker.engine.gguf_file import DECODABLE_TYPES, GGUFFile, HeaderCursor

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


def _with_metadata(source, target, key: str, value: bytes) -> None:
    """Copy a GGUF with one more metadata entry (``value``: its type id and bytes), the header
    padded again so the tensor data keeps its alignment."""
    data = source.read_bytes()
    header = HeaderCursor(data)
    header.pos = 8
    n_tensors, n_kv = header.scalar("<Q"), header.scalar("<Q")
    for _ in range(n_kv):
        header.string()
        header.value(header.scalar("<I"))
    kv_end = header.pos
    for _ in range(n_tensors):
        header.string()
        n_dims = header.scalar("<I")
        header.pos += 8 * n_dims + 4 + 8  # dims, type, offset
    data_start = -(-header.pos // 32) * 32
    entry = struct.pack("<Q", len(key)) + key.encode() + value
    head = data[:16] + struct.pack("<Q", n_kv + 1) + data[24:kv_end] + entry + data[kv_end:header.pos]
    target.write_bytes(head + bytes(-len(head) % 32) + data[data_start:])


def _nested_vocab_size(source, target) -> None:
    """llama.vocab_size, which the loader reads, as an array holding one array of one uint32."""
    array, uint32 = gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.UINT32
    _with_metadata(source, target, "llama.vocab_size",
                   struct.pack("<IIQIQI", array, array, 1, uint32, 1, 49152))


def _huge_embedding(source, target) -> None:
    """token_embd.weight declared 2^40 x 2^40 (its element count wraps to 0 in int64)."""
    data = bytearray(source.read_bytes())
    name = b"token_embd.weight"
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    struct.pack_into("<IQQ", data, at, 2, 1 << 40, 1 << 40)
    target.write_bytes(bytes(data))


def test_a_nested_metadata_array_is_named(tiny_llama, tmp_path):
    _nested_vocab_size(tiny_llama, tmp_path / "nested.gguf")
    with pytest.raises(ModelLoadError, match=r"nested.gguf: metadata key 'llama.vocab_size' holds an array of arrays"):
        GGUFFile(tmp_path / "nested.gguf")


def test_a_tensor_larger_than_its_file_is_named(tiny_llama, tmp_path):
    _huge_embedding(tiny_llama, tmp_path / "huge.gguf")
    with pytest.raises(ModelLoadError, match=r"'token_embd.weight'.*\(1099511627776, 1099511627776\).*more than "
                                             r"the whole file"):
        GGUFFile(tmp_path / "huge.gguf")


@pytest.mark.parametrize("key, value", [("llama.block_count", "two"), ("llama.context_length", [])])
def test_a_hyperparameter_of_the_wrong_type_is_named(tiny_llama, key, value):
    gguf_file = GGUFFile(tiny_llama)
    gguf_file.metadata[key] = value
    with pytest.raises(ModelLoadError, match=re.escape(f"{key} is {value!r}, not a number")):
        load_model(gguf_file)


def test_impossible_metadata_deep_in_a_family_is_one_line(tiny_llama):
    gguf_file = GGUFFile(tiny_llama)
    gguf_file.metadata["llama.attention.head_count"] = 0
    with pytest.raises(ModelLoadError, match=r"does not describe a llama model lmserve can build \(ZeroDivisionError"):
        load_model(gguf_file)


@pytest.mark.parametrize("command", ["worker", "generate"])
@pytest.mark.parametrize("craft, culprit", [(_nested_vocab_size, "'llama.vocab_size'"),
                                            (_huge_embedding, "'token_embd.weight'")])
def test_the_commands_report_a_crafted_file_in_one_line(tiny_llama, tmp_path, command, craft, culprit):
    crafted = tmp_path / "crafted.gguf"
    craft(tiny_llama, crafted)
    extra = ["--worker", "tcp://127.0.0.1:1"] if command == "worker" else ["--prompt", "hi", "--max-tokens", "1"]
    done = subprocess.run([sys.executable, "-m", "launcher.cli", command, str(crafted), *extra],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0].startswith(f"lmserve {command}: ") and str(crafted) in lines[0] and culprit in lines[0]
