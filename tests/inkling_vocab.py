"""An Inkling style vocabulary for tests, made from the real Qwen3 vocabulary.

No Inkling weights or tokenizer can be installed here, but its vocabulary is the same kind as
Qwen's: byte-level BPE. From ``qwen_vocab.py`` we keep every BPE token and merge, and write what
an ``inkling`` GGUF holds: ``tokenizer.ggml.pre = "inkling"`` (the o200k split), no BOS, and
Inkling's block tokens as control tokens, with ``<|content_model_end_sampling|>`` as EOS. Qwen's
own added tokens (``<|im_start|>``, ``<think>``, ``<tool_call>`` …) are not kept: their ids
become ``[PAD…]`` fillers like the rest of the rows past the BPE tokens.

Inkling's special tokens sit at ids from 199,999 on, past this vocabulary's 151,936 rows, so
each is placed ``ID_SHIFT`` lower: ``test id = real id - ID_SHIFT``, which puts
``<|endoftext|>`` (199,999) at Qwen's first added id (151,643) and keeps the tokens' order and
spacing. The chat template is our own (``templates/inkling.jinja``).

    inkling_vocab_metadata() -> dict of GGUF ``tokenizer.*`` keys (do not mutate its lists)
"""

from __future__ import annotations

import functools
import importlib
from pathlib import Path
from typing import Any

from shared.tokenizer import TOKEN_CONTROL, TOKEN_UNUSED

# the sibling module, imported the way this one was (``tests.inkling_vocab`` or ``inkling_vocab``)
qwen_vocab = importlib.import_module(f"{__package__}.qwen_vocab" if __package__ else "qwen_vocab")

TEMPLATE_PATH = Path(__file__).parent / "templates" / "inkling.jinja"

# Inkling's special tokens at their real ids
REAL_IDS: dict[str, int] = {
    "<|endoftext|>": 199_999,
    "<|message_user|>": 200_000,
    "<|message_model|>": 200_001,
    "<|message_system|>": 200_002,
    "<|message_tool|>": 200_003,
    "<|content_text|>": 200_004,
    "<|content_image|>": 200_005,
    "<|content_model_end_sampling|>": 200_006,  # EOS: the only token that ends a reply
    "<|content_thinking|>": 200_008,
    "<|end_message|>": 200_010,  # closes a block, not the reply
    "<|content_xml|>": 200_024,
    "<|content_invoke_tool_json|>": 200_049,
}
ID_SHIFT = REAL_IDS["<|endoftext|>"] - qwen_vocab.ENDOFTEXT_ID
SPECIAL_IDS = {text: real - ID_SHIFT for text, real in REAL_IDS.items()}
EOS_TEXT = "<|content_model_end_sampling|>"


@functools.lru_cache(maxsize=1)
def _metadata() -> dict[str, Any]:
    qwen = qwen_vocab.qwen_vocab_metadata()
    tokens = list(qwen["tokenizer.ggml.tokens"])
    types = list(qwen["tokenizer.ggml.token_type"])
    for token_id, _, _ in qwen_vocab.ADDED_TOKENS:
        tokens[token_id], types[token_id] = f"[PAD{token_id}]", TOKEN_UNUSED
    for text, token_id in SPECIAL_IDS.items():
        if not tokens[token_id].startswith("[PAD"):
            raise RuntimeError(f"id {token_id} of the Qwen vocabulary is not a filler")
        tokens[token_id], types[token_id] = text, TOKEN_CONTROL
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "inkling",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": qwen["tokenizer.ggml.merges"],
        "tokenizer.ggml.eos_token_id": SPECIAL_IDS[EOS_TEXT],
        "tokenizer.ggml.padding_token_id": SPECIAL_IDS["<|endoftext|>"],
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": TEMPLATE_PATH.read_text(encoding="utf-8"),
    }


def inkling_vocab_metadata() -> dict[str, Any]:
    """GGUF ``tokenizer.*`` keys and values of an Inkling style vocabulary (a fresh dict; shared
    lists)."""
    return dict(_metadata())
