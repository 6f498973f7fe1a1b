"""The tokenizer as it travels: everything a gateway needs to rebuild the worker's tokenizer
(``shared.tokenizer.Tokenizer.from_spec``) without the model file, sent in the MODEL_CARD.

The token strings travel and stay as one UTF-8 blob with the offset where each ends, not as a
list of strings: a Python string costs some 75 bytes of a 262k-token vocabulary's 80 per token.

Kept apart from ``shared/tokenizer.py`` so that the wire protocol, which the light flag modules
import, does not import the tokenizers library.
"""

from __future__ import annotations

import sys
from array import array
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate, repeat
from typing import Any

SPEC_FORMAT = 2
PIECE_ERRORS = "surrogatepass"  # a string the file holds is carried whatever its code points


def _offsets(data: bytes) -> array:
    ends = array("I")
    ends.frombytes(data)
    if sys.byteorder == "big":
        ends.byteswap()  # carried little-endian
    return ends


def character_starts(blob: bytes):
    """Per byte of UTF-8 text, whether a character starts there (not a continuation byte)."""
    import numpy as np  # here: the light modules that import this one do not load numpy

    return (np.frombuffer(blob, dtype=np.uint8) & 0xC0) != 0x80


def cut_between_characters(starts, ends: array) -> bool:
    """Whether strings ending at ``ends`` in a text whose ``character_starts`` are ``starts``
    are cut only between characters (then each is UTF-8 where the whole text is)."""
    import numpy as np

    cuts = np.frombuffer(ends, dtype=np.uint32)
    return bool(starts[cuts[cuts < len(starts)]].all())


class PackedStrings(Sequence[str]):
    """Strings kept as one UTF-8 blob and the offset where each ends, each made only when read:
    how a GGUF reader hands over a vocabulary without a string object per token (objects that,
    freed later among the model's, would leave the memory they held scattered and unreturned)."""

    __slots__ = ("blob", "ends")

    def __init__(self, blob: bytes, ends: array):
        self.blob, self.ends = blob, ends

    def __len__(self) -> int:
        return len(self.ends)

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self.ends)
        if not 0 <= index < len(self.ends):
            raise IndexError("string index out of range")
        return self.blob[self.ends[index - 1] if index else 0:self.ends[index]].decode("utf-8", PIECE_ERRORS)

    def __iter__(self):
        ends = self.ends
        return map(bytes.decode, map(self.blob.__getitem__, map(slice, (0, *ends), ends)),
                   repeat("utf-8"), repeat(PIECE_ERRORS))

    def find(self, text: str) -> int | None:
        """The first string equal to ``text``, found in the blob (None: none is)."""
        wanted = text.encode("utf-8", PIECE_ERRORS)
        blob, ends = self.blob, self.ends
        at = blob.find(wanted)
        while at >= 0:
            # the strings that start at ``at``: those after each string that ends there
            first = 0 if at == 0 else bisect_left(ends, at) + 1
            for i in range(first, min(bisect_right(ends, at) + 1, len(ends))):
                if ends[i] == at + len(wanted) and (ends[i - 1] if i else 0) == at:
                    return i
            at = blob.find(wanted, at + 1)
        return None

    def to_list(self) -> list[str]:
        """Every string, each decoded from its bytes (measured as fast, on 151k- and 262k-token
        vocabularies, as decoding the blob once and cutting the text at the characters where the
        strings end, and it needs no numpy in a gateway)."""
        return list(self)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and len(other) == len(self) and all(a == b for a, b in zip(self, other))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"PackedStrings({len(self)} strings)"


def pack_pieces(tokens: Sequence[str]) -> dict[str, bytes]:
    """The ``pieces`` and ``piece_ends`` fields of a spec holding these token strings."""
    if isinstance(tokens, PackedStrings):
        blob, ends = tokens.blob, array("I", tokens.ends)  # a copy: the byte swap below must not reach it
    else:
        encoded = [token.encode("utf-8", PIECE_ERRORS) for token in tokens]
        blob, ends = b"".join(encoded), array("I", accumulate(map(len, encoded)))
    if sys.byteorder == "big":
        ends.byteswap()
    return {"pieces": bytes(blob), "piece_ends": ends.tobytes()}


@dataclass
class TokenizerSpec:
    model: str  # tokenizer.ggml.model: the kind of vocabulary (shared.tokenizer.VOCABULARY_MODELS)
    pieces: bytes  # every token's string, UTF-8, one after another (``pack_pieces``)
    piece_ends: bytes  # where each token's string ends in ``pieces``: uint32, little-endian
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

    @classmethod
    def of_tokens(cls, tokens: Sequence[str], **fields: Any) -> TokenizerSpec:
        return cls(**pack_pieces(tokens), **fields)

    @property
    def vocab_size(self) -> int:
        return len(self.piece_ends) // 4

    def piece_offsets(self) -> array:
        """The end of each token's string in ``pieces`` (an array of uint32)."""
        return _offsets(self.piece_ends)

    def tokens(self) -> list[str]:
        """The token strings, made anew (a large vocabulary's take tens of megabytes: a caller
        keeps them only while it needs them)."""
        return PackedStrings(self.pieces, self.piece_offsets()).to_list()
