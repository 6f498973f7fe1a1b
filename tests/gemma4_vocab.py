"""A Gemma 4 style vocabulary for tests, cut from the real Gemma 3 vocabulary.

No Gemma 4 weights can be installed here, but Gemma 3 270M can (the ``gemma-3-270m`` known
model), and the two families share their SentencePiece lineage. From Gemma 3's vocabulary we
keep its first ``VOCAB_SIZE`` ids (the control tokens, the runs of line breaks and spaces, the
256 byte tokens and the best-scored pieces) and its ``SINGLE_CHARACTERS`` most frequent
one-character pieces (▁, ASCII, common Latin letters: SentencePiece lists them last), and write what a ``gemma4`` GGUF holds: the pieces,
BPE merges (every split of a kept piece into two kept pieces, ranked by the piece's score, as
SentencePiece merges), ``tokenizer.ggml.model = "gemma4"``, and Gemma 4's turn, channel and
tool tokens in place of unused ones. The chat template is our own (``templates/gemma4.jinja``).

The result is cached as JSON under the lmserve cache directory, keyed by the source file.

    gemma4_vocab_metadata() -> dict of GGUF ``tokenizer.*`` keys (do not mutate its lists)

The tiny gemma4 models (``tiny_models``) carry it, so llama.cpp is checked on one of them.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

from shared.default_model import cache_dir, model_path
from shared.tokenizer import TOKEN_NORMAL, TOKEN_USER_DEFINED, sentencepiece_merges

CACHE_VERSION = 2  # bump when the derived vocabulary changes
VOCAB_SIZE = 6144
SINGLE_CHARACTERS = 512
TEMPLATE_PATH = Path(__file__).parent / "templates" / "gemma4.jinja"

BOS_ID, EOS_ID = 2, 1
TURN_OPEN_ID, TURN_CLOSE_ID = 105, 106  # Gemma 3's <start_of_turn> and <end_of_turn> ids
# Gemma 4's other added tokens, in place of Gemma 3's <unused0>… (ids 6…): user-defined, as
# its converter types them, so they are part of what a reply says
ADDED_TEXTS = ("<|think|>", "<|channel>", "<channel|>", "<|tool>", "<tool|>", "<|tool_call>", "<tool_call|>",
               "<|tool_response>", "<tool_response|>", '<|"|>')
FIRST_ADDED_ID = 6


def _source_metadata() -> tuple[Path, dict[str, Any]]:
    from worker.engine.gguf_file import GGUFFile

    source = model_path("gemma-3-270m")
    return source, GGUFFile(source).metadata


def _derive(meta: dict[str, Any]) -> dict[str, Any]:
    all_tokens, all_types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    singles = [i for i in range(VOCAB_SIZE, len(all_tokens))
               if all_types[i] == TOKEN_NORMAL and len(all_tokens[i]) == 1][:SINGLE_CHARACTERS]
    kept = list(range(VOCAB_SIZE)) + singles
    tokens = [all_tokens[i] for i in kept]
    types = [int(all_types[i]) for i in kept]
    scores = [meta["tokenizer.ggml.scores"][i] for i in kept]
    tokens[TURN_OPEN_ID], tokens[TURN_CLOSE_ID] = "<|turn>", "<turn|>"
    for offset, text in enumerate(ADDED_TEXTS):
        if not tokens[FIRST_ADDED_ID + offset].startswith("<unused"):
            raise RuntimeError(f"id {FIRST_ADDED_ID + offset} of the source is not an unused token")
        tokens[FIRST_ADDED_ID + offset] = text
        types[FIRST_ADDED_ID + offset] = TOKEN_USER_DEFINED
    merges = [f"{left} {right}" for left, right in sentencepiece_merges(tokens, types, scores)]
    return {
        "tokenizer.ggml.model": "gemma4",
        "tokenizer.ggml.pre": "gemma4",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": BOS_ID,
        "tokenizer.ggml.eos_token_id": EOS_ID,
        "tokenizer.ggml.eot_token_id": TURN_CLOSE_ID,
        "tokenizer.ggml.unknown_token_id": 3,
        "tokenizer.ggml.padding_token_id": 0,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_eos_token": False,
        "tokenizer.chat_template": TEMPLATE_PATH.read_text(encoding="utf-8"),
    }


@functools.lru_cache(maxsize=1)
def gemma4_vocab_metadata() -> dict[str, Any]:
    source = model_path("gemma-3-270m")
    stat = source.stat()
    template = TEMPLATE_PATH.read_text(encoding="utf-8")
    cached = cache_dir() / "vocab" / f"gemma4-v{CACHE_VERSION}-{stat.st_size}-{stat.st_mtime_ns}.json"
    if cached.is_file():
        meta = json.loads(cached.read_text(encoding="utf-8"))
    else:
        meta = _derive(_source_metadata()[1])
        cached.parent.mkdir(parents=True, exist_ok=True)
        partial = cached.with_suffix(f".{os.getpid()}.partial")
        partial.write_text(json.dumps(meta, ensure_ascii=False), encoding="utf-8")
        os.replace(partial, cached)  # atomic, so a concurrent reader never sees half a file
    meta["tokenizer.chat_template"] = template  # the template as it is now, not as cached
    return meta
