"""nanochat checkpoint directories (``--nanochat DIR``), read the way the engine reads a GGUF file.

A directory holds ``model.safetensors`` (the weights, under the Hugging Face port's names,
``model.layers.N.self_attn.q_proj.weight``…, or nanochat's own, ``transformer.h.N.attn.c_q.weight``…),
its hyperparameters (``config.json`` of the Hugging Face port, or nanochat's ``meta_*.json`` with
a ``model_config``) and its tokenizer as ``tokenizer.json``. ``NanochatCheckpoint`` offers what
the engine asks of a ``GGUFFile``: GGUF-style metadata (``nanochat.*`` hyperparameters,
``tokenizer.*`` keys converted from ``tokenizer.json``, a chat template in nanochat's turn
format) and the weights under GGUF names, read in place from the memory-mapped file.

nanochat's own tokenizer files (``tokenizer.pkl``, a pickled tiktoken encoding) are refused:
unpickling runs whatever code the file names. A ``tokenizer.json`` of the same vocabulary is
what to provide (the Hugging Face port ships one).

The safetensors format is read here rather than with the ``safetensors`` package, whose numpy
interface cannot hold bfloat16, the type nanochat trains and saves in: the file is an 8-byte
header length, a JSON header (dtype, shape and byte range per tensor) and the raw bytes, and
bfloat16 weights are multiplied in place by the BF16 kernel.
"""

from __future__ import annotations

import glob
import json
import mmap
import os
import re
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType

from shared.errors import ModelLoadError
from shared.tokenizer import PRE_KINDS, TOKEN_CONTROL, TOKEN_NORMAL, TOKEN_USER_DEFINED, byte_level_alphabet
from worker.engine import kernels
from worker.engine.weights import DenseWeight, QuantizedWeight, Weight, has_kernel

Q = GGMLQuantizationType
# safetensors dtype -> (block type, numpy type of its values; None: widened from its bits)
DTYPES: dict[str, tuple[GGMLQuantizationType, Any]] = {
    "F32": (Q.F32, np.float32), "F16": (Q.F16, np.float16), "BF16": (Q.BF16, None)}
ITEM_BYTES = {"F32": 4, "F16": 2, "BF16": 2}
ARCH = "nanochat"
MAX_VOCABULARY = 1 << 22  # token ids a tokenizer.json may use

# The split of GPT-4's tokenizer as nanochat trains it (numbers in runs of up to two digits).
SPLIT_PATTERN = PRE_KINDS["nanochat"].splits[0]
CONTROL_TOKENS = ("<|bos|>", "<|user_start|>", "<|user_end|>", "<|assistant_start|>", "<|assistant_end|>",
                  "<|output_start|>", "<|output_end|>")
# the calculator's markers are part of what a reply says, so they are decoded like its text
TOOL_TOKENS = ("<|python_start|>", "<|python_end|>")

# Hugging Face port names, nanochat's own names -> GGUF names ({i}: the layer)
_NAMES = [
    (r"model\.embed_tokens\.weight|transformer\.wte\.weight", "token_embd.weight"),
    (r"lm_head\.weight", "output.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.q_proj\.(weight|bias)|transformer\.h\.(\d+)\.attn\.c_q\.(weight|bias)",
     "blk.{i}.attn_q.{kind}"),
    (r"model\.layers\.(\d+)\.self_attn\.k_proj\.(weight|bias)|transformer\.h\.(\d+)\.attn\.c_k\.(weight|bias)",
     "blk.{i}.attn_k.{kind}"),
    (r"model\.layers\.(\d+)\.self_attn\.v_proj\.(weight|bias)|transformer\.h\.(\d+)\.attn\.c_v\.(weight|bias)",
     "blk.{i}.attn_v.{kind}"),
    (r"model\.layers\.(\d+)\.self_attn\.o_proj\.(weight|bias)|transformer\.h\.(\d+)\.attn\.c_proj\.(weight|bias)",
     "blk.{i}.attn_output.{kind}"),
    (r"model\.layers\.(\d+)\.mlp\.fc1\.(weight)|transformer\.h\.(\d+)\.mlp\.c_fc\.(weight)", "blk.{i}.ffn_up.{kind}"),
    (r"model\.layers\.(\d+)\.mlp\.fc2\.(weight)|transformer\.h\.(\d+)\.mlp\.c_proj\.(weight)",
     "blk.{i}.ffn_down.{kind}"),
    (r"transformer\.h\.(\d+)\.attn\.ve_gate\.(weight)", "blk.{i}.ve_gate.{kind}"),
    (r"value_embeds\.(\d+)\.(weight)", "blk.{i}.value_embd.{kind}"),
    (r"resid_lambdas", "resid_lambdas"),
    (r"x0_lambdas", "x0_lambdas"),
    (r"smear_gate\.weight", "smear_gate.weight"),
    (r"smear_lambda", "smear_lambda"),
    (r"backout_lambda", "backout_lambda"),
]


def gguf_name(name: str) -> str | None:
    """The GGUF name of a checkpoint tensor, or None for one the engine does not use."""
    name = name.removeprefix("_orig_mod.")  # saved from a torch.compile'd model
    for pattern, target in _NAMES:
        match = re.fullmatch(pattern, name)
        if match:
            groups = [g for g in match.groups() if g is not None]
            return target.format(i=groups[0] if groups else "", kind=groups[1] if len(groups) > 1 else "")
    return None


class SafetensorsFile:
    """A safetensors file, memory-mapped: name -> (dtype, shape, raw bytes view)."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        try:
            with open(self.path, "rb") as fh:
                self._map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
            (length,) = struct.unpack_from("<Q", self._map, 0)
            header = json.loads(bytes(self._map[8:8 + length]))
            if not isinstance(header, dict):
                raise ValueError("its header is not a JSON object")
        except (OSError, struct.error, ValueError) as exc:
            raise ModelLoadError(f"{self.path} is not a safetensors file ({exc})") from exc
        metadata = header.pop("__metadata__", None)
        self.metadata: dict[str, str] = metadata if isinstance(metadata, dict) else {}
        self.start = 8 + length
        room = len(self._map) - self.start
        self.entries: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
        for name, entry in header.items():
            # every number is checked: the kernels read a weight's rows by its shape, in place
            try:
                dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
                numbers = [*shape, begin, end]
                if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in numbers):
                    raise ValueError("shape and offsets must be whole numbers")
            except (KeyError, TypeError, ValueError) as exc:
                raise ModelLoadError(f"tensor {name!r} in {self.path} has a malformed entry ({exc})") from exc
            if dtype not in DTYPES:
                raise ModelLoadError(f"tensor {name!r} in {self.path} has dtype {dtype}; lmserve reads {', '.join(DTYPES)}")
            if not begin <= end <= room:
                raise ModelLoadError(f"{self.path} is truncated or corrupt: tensor {name!r} lies outside its data")
            if end - begin != int(np.prod(shape, dtype=np.int64)) * ITEM_BYTES[dtype]:
                raise ModelLoadError(f"tensor {name!r} in {self.path} holds {end - begin} bytes, not the "
                                     f"{ITEM_BYTES[dtype]} per value its {dtype} shape {list(shape)} needs")
            self.entries[name] = (dtype, shape, begin, end)

    def raw(self, name: str) -> tuple[str, tuple[int, ...], np.ndarray]:
        dtype, shape, begin, end = self.entries[name]
        return dtype, shape, np.frombuffer(self._map, dtype=np.uint8, count=end - begin, offset=self.start + begin)


def write_safetensors(path: str | os.PathLike, tensors: dict[str, tuple[str, tuple[int, ...], bytes]],
                      metadata: dict[str, str] | None = None) -> None:
    """Write a safetensors file: name -> (dtype, shape, raw bytes), in order; atomically."""
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, (dtype, shape, blob) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    partial = Path(f"{os.fspath(path)}.partial")
    with open(partial, "wb") as fh:
        fh.write(len(encoded).to_bytes(8, "little") + encoded)
        for _, _, blob in tensors.values():
            fh.write(blob)
    os.replace(partial, path)


def floats(dtype: str, raw: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """A tensor's bytes as float32 of ``shape``."""
    if dtype == "BF16":
        values = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    else:
        values = raw.view(DTYPES[dtype][1]).astype(np.float32)
    return np.ascontiguousarray(values.reshape(shape), dtype=np.float32)


class NanochatCheckpoint:
    """A nanochat checkpoint directory behind the interface of ``GGUFFile``."""

    def __init__(self, path: str | os.PathLike, on_progress: Callable[[int, int], None] | None = None):
        self.path = os.fspath(path)
        self.on_progress = on_progress
        self.dense_fallbacks: dict[str, str] = {}
        folder = Path(self.path)
        if not folder.is_dir():
            raise ModelLoadError(f"nanochat checkpoint directory not found: {self.path}")
        weights = folder / "model.safetensors"
        if not weights.is_file():
            found = sorted(p.name for p in folder.glob("model_*.pt"))
            hint = (f" ({', '.join(found)} is a pickled torch checkpoint, which lmserve does not unpickle: "
                    "save its state dict with safetensors)") if found else ""
            raise ModelLoadError(f"{self.path} has no model.safetensors{hint}")
        self.file = SafetensorsFile(weights)
        self.names: dict[str, str] = {}  # GGUF name -> checkpoint name
        for name in self.file.entries:
            target = gguf_name(name)
            if target is not None:
                self.names[target] = name
        self._bytes_read = 0
        config = _config(folder)
        tokenizer = _tokenizer_metadata(folder)
        self.metadata = {"general.architecture": ARCH, "general.name": folder.name,
                         **self._hparams(config, tokenizer), **tokenizer}

    def _hparams(self, config: dict[str, Any], tokenizer: dict[str, Any]) -> dict[str, Any]:
        if "token_embd.weight" not in self.names or "blk.0.attn_q.weight" not in self.names:
            raise ModelLoadError(f"{self.file.path} holds no nanochat weights (no embedding or attention found)")
        n_layer = 1 + max(int(name.split(".")[1]) for name in self.names if name.startswith("blk."))
        n_embd = self.file.entries[self.names["token_embd.weight"]][1][1]
        n_ff = self.file.entries[self.names["blk.0.ffn_up.weight"]][1][0]
        n_head = int(config.get("num_attention_heads") or config.get("n_head") or 0)
        if not n_head:
            raise ModelLoadError(f"{self.path}: the config names no head count (num_attention_heads or n_head)")
        n_head_kv = int(config.get("num_key_value_heads") or config.get("n_kv_head") or n_head)
        rope = config.get("rope_parameters") or {}
        # nanochat's own checkpoints: RoPE's base went from 10000 to 100000 a few days before the
        # smear came in (March 2026); a checkpoint with the smear has the larger one
        default_base = 100000.0 if "smear_gate.weight" in self.names else 10000.0
        meta = {
            f"{ARCH}.block_count": n_layer, f"{ARCH}.embedding_length": n_embd,
            f"{ARCH}.feed_forward_length": n_ff, f"{ARCH}.attention.head_count": n_head,
            f"{ARCH}.attention.head_count_kv": n_head_kv,
            f"{ARCH}.context_length": int(config.get("max_position_embeddings") or config.get("sequence_len") or 2048),
            f"{ARCH}.rope.freq_base": float(rope.get("rope_theta") or config.get("rope_theta") or default_base),
            # nanochat's own norms take float32's epsilon (torch's default for its rms_norm)
            f"{ARCH}.attention.layer_norm_rms_epsilon": float(config.get("rms_norm_eps") or np.finfo(np.float32).eps),
            f"{ARCH}.final_logit_softcapping": float(config.get("final_logit_softcapping") or 15.0),
            f"{ARCH}.vocab_size": len(tokenizer["tokenizer.ggml.tokens"]),
        }
        if config.get("window_pattern"):
            meta[f"{ARCH}.window_pattern"] = str(config["window_pattern"])
        return meta

    # --- the interface of GGUFFile ------------------------------------------------------------

    @property
    def architecture(self) -> str:
        return ARCH

    @property
    def tensor_names(self) -> list[str]:
        return list(self.names)

    def matrix_weights(self) -> dict:
        """Weights of each block type repacked in panels: none (a checkpoint's weights are floats)."""
        return {}

    def head_type(self) -> None:
        return None

    def has_tensor(self, name: str) -> bool:
        return name in self.names

    def _raw(self, name: str, shape: tuple[int, ...] | None) -> tuple[str, tuple[int, ...], np.ndarray]:
        if name not in self.names:
            raise ModelLoadError(f"{self.file.path} lacks the tensor nanochat needs for {name!r}")
        dtype, found, raw = self.file.raw(self.names[name])
        if shape is not None and found != tuple(shape):
            raise ModelLoadError(f"tensor {self.names[name]!r} in {self.file.path} has shape {found}, "
                                 f"expected {tuple(shape)}")
        self._bytes_read += raw.nbytes
        if self.on_progress is not None:
            self.on_progress(self._bytes_read, self.total_bytes)
        return dtype, found, raw

    def tensor(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
        dtype, found, raw = self._raw(name, shape)
        return floats(dtype, raw, found)

    def weight(self, name: str, shape: tuple[int, ...] | None = None, dense: bool = False) -> Weight:
        dtype, found, raw = self._raw(name, shape)
        qtype = DTYPES[dtype][0]
        if dense or len(found) != 2 or not kernels.available() or not has_kernel(qtype, found[-1]):
            return DenseWeight(floats(dtype, raw, found))
        return QuantizedWeight(qtype, found, raw.reshape(found[0], -1))

    @property
    def total_bytes(self) -> int:
        return sum(end - begin for _, _, begin, end in self.file.entries.values())


def _config(folder: Path) -> dict[str, Any]:
    """The Hugging Face port's config.json, or the model_config of nanochat's latest meta file."""
    config = folder / "config.json"
    if config.is_file():
        return json.loads(config.read_text(encoding="utf-8"))
    metas = sorted(glob.glob(str(folder / "meta_*.json")))
    if metas:
        return json.loads(Path(metas[-1]).read_text(encoding="utf-8")).get("model_config", {})
    raise ModelLoadError(f"{folder} has neither config.json nor a nanochat meta_*.json with the model's shape")


def _tokenizer_metadata(folder: Path) -> dict[str, Any]:
    """GGUF ``tokenizer.*`` keys from ``tokenizer.json`` (byte-level BPE with nanochat's split)."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        if (folder / "tokenizer.pkl").is_file() or (folder / "tokenizer" / "tokenizer.pkl").is_file():
            raise ModelLoadError(
                f"{folder} has nanochat's tokenizer.pkl, a pickle: lmserve does not unpickle files (that runs "
                "any code they name). Provide the same vocabulary as tokenizer.json (Hugging Face tokenizers "
                "format, as the Hugging Face port of nanochat ships it)")
        raise ModelLoadError(f"{folder} has no tokenizer.json")
    try:
        spec = json.loads(path.read_text(encoding="utf-8"))
        model = spec["model"]
    except (ValueError, KeyError) as exc:
        raise ModelLoadError(f"{path} is not a tokenizers JSON file ({exc})") from exc
    if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        raise ModelLoadError(f"{path}: lmserve reads nanochat's byte-level BPE, not a {model.get('type')} model")
    patterns = re.findall(r'"Regex":\s*("(?:[^"\\]|\\.)*")', json.dumps(spec.get("pre_tokenizer")))
    if [json.loads(p) for p in patterns] != [SPLIT_PATTERN]:
        raise ModelLoadError(f"{path} splits text with {patterns or 'no regex'}, not nanochat's GPT-4 split")
    ids_used = [*model["vocab"].values(), *(t.get("id") for t in spec.get("added_tokens", []))]
    if not all(isinstance(i, int) and 0 <= i < MAX_VOCABULARY for i in ids_used):
        raise ModelLoadError(f"{path}: token ids must be whole numbers below {MAX_VOCABULARY}")
    size = max(ids_used) + 1
    tokens: list[str | None] = [None] * size
    types = [TOKEN_NORMAL] * size
    for piece, index in model["vocab"].items():
        tokens[index] = piece
    for added in spec.get("added_tokens", []):
        tokens[added["id"]] = added["content"]
        types[added["id"]] = TOKEN_USER_DEFINED if added["content"] in TOOL_TOKENS or not added.get("special") \
            else TOKEN_CONTROL
    if None in tokens:
        raise ModelLoadError(f"{path}: token id {tokens.index(None)} has no token")
    ids = {text: i for i, text in enumerate(tokens)}
    missing = [text for text in (*CONTROL_TOKENS, *TOOL_TOKENS) if text not in ids]
    if missing:
        raise ModelLoadError(f"{path} lacks nanochat's special tokens {', '.join(missing)}")
    alphabet = set(byte_level_alphabet())
    if not all(set(piece) <= alphabet for piece, t in zip(tokens, types) if t == TOKEN_NORMAL):
        raise ModelLoadError(f"{path}: its pieces are not byte-level (GPT-2's alphabet)")
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "nanochat",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": ids["<|bos|>"],
        "tokenizer.ggml.eos_token_id": ids["<|assistant_end|>"],
        "tokenizer.ggml.add_bos_token": False,  # the chat template writes <|bos|>
        "tokenizer.chat_template": CHAT_TEMPLATE,
    }


# nanochat's turns: <|bos|>, then <|user_start|>…<|user_end|> and <|assistant_start|>…<|assistant_end|>;
# a system message is put before the first user message's text. A call of the calculator is
# <|python_start|>code<|python_end|> inside the assistant's turn, and its result follows there as
# <|output_start|>…<|output_end|> before the turn goes on.
CHAT_TEMPLATE = """\
{%- macro text_of(content) -%}
    {%- if content is string -%}{{- content -}}
    {%- elif content is iterable and content is not mapping -%}
        {%- for part in content if part.type == 'text' -%}{{- part.text -}}{%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- set system = text_of(messages[0].content) if messages and messages[0].role in ['system', 'developer'] else '' -%}
{%- set state = namespace(open=false, first_user=true) -%}
{{- bos_token -}}
{%- for message in messages -%}
    {%- if message.role == 'user' -%}
        {%- if state.open -%}{{- '<|assistant_end|>' -}}{%- set state.open = false -%}{%- endif -%}
        {{- '<|user_start|>' -}}
        {%- if state.first_user and system -%}{{- system ~ '\\n\\n' -}}{%- endif -%}
        {%- set state.first_user = false -%}
        {{- text_of(message.content) ~ '<|user_end|>' -}}
    {%- elif message.role == 'assistant' -%}
        {%- if not state.open -%}{{- '<|assistant_start|>' -}}{%- endif -%}
        {{- text_of(message.content) -}}
        {%- for call in message.tool_calls or [] -%}
            {%- set arguments = (call.function if call.function is defined else call).arguments -%}
            {{- '<|python_start|>' ~ ((arguments.values() | list | first) if arguments is mapping
                                      else arguments) ~ '<|python_end|>' -}}
        {%- endfor -%}
        {%- set state.open = (message.tool_calls or []) | length > 0 -%}
        {%- if not state.open -%}{{- '<|assistant_end|>' -}}{%- endif -%}
    {%- elif message.role == 'tool' -%}
        {{- '<|output_start|>' ~ text_of(message.content) ~ '<|output_end|>' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt and not state.open -%}{{- '<|assistant_start|>' -}}{%- endif -%}
"""
