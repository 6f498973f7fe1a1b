"""The tokenizer as it travels: everything a gateway needs to rebuild the worker's tokenizer
(``shared.tokenizer.Tokenizer.from_spec``) without the model file, sent in the MODEL_CARD.

Kept apart from ``shared/tokenizer.py`` so that the wire protocol, which the light flag modules
import, does not import the tokenizers library.
"""

from __future__ import annotations

from dataclasses import dataclass

SPEC_FORMAT = 1


@dataclass
class TokenizerSpec:
    model: str  # tokenizer.ggml.model: the kind of vocabulary (shared.tokenizer.VOCABULARY_MODELS)
    tokens: list[str]
    token_types: bytes  # the GGUF token type of each token, one byte each
    bos_id: int | None
    eos_id: int | None
    add_bos: bool  # what encode(add_special=True) puts first
    add_eos: bool
    format: int = SPEC_FORMAT
    eot_id: int | None = None
    eom_id: int | None = None
    fim_ids: list[int] | None = None  # fill-in-the-middle [prefix, suffix, middle]
    # the entries of the kind of vocabulary (its VocabularyModel.read), None where the kind has none
    pre: str | None = None  # byte-level BPE: the pre-tokenizer's name
    merges: list[str] | None = None  # byte-level BPE and gemma4: ranked "left right" merges
    scores: bytes | None = None  # SentencePiece: a float32 score per token
    add_space_prefix: bool | None = None  # SentencePiece: a space goes before a text
