"""The model's tokenizer, built from GGUF metadata alone.

``tokenizer.ggml.model`` names the kind of vocabulary, and ``VOCABULARY_MODELS`` maps it to
the class that builds it: what it reads from the metadata, how a token string maps to bytes,
and the encoder (in the ``tokenizers`` library). Byte-level BPE (``"gpt2"``) is the kind built
today. What a GGUF file says, and how we read it:

- ``tokenizer.ggml.pre`` names the pre-tokenizer: a list of split regexes applied one after
  another, each splitting the pieces the previous one left (matches and gaps both kept). The
  regexes per name follow llama.cpp (``llama-vocab.cpp``), which is the reference we test
  against. A missing name means ``default`` (with a warning, as llama.cpp does); a name we do
  not know is an error, because a wrong split gives the model token ids it was never trained
  on and the only symptom would be quietly worse text.
- ``token_type`` 3 (control) and 2 (unknown) tokens are matched as whole strings only when
  ``parse_special`` is on; type 4 (user-defined, e.g. Qwen's ``<think>``) is always matched,
  since it is an ordinary word of the vocabulary that happens not to come from merges.
- ``add_bos_token`` / ``add_eos_token`` decide what ``add_special`` adds; when absent the
  pre-tokenizer's own default applies (llama3-style vocabularies add BOS).

``to_spec()`` is a ``shared.tokenizer_spec.TokenizerSpec`` of plain values, so a gateway can
rebuild the same tokenizer without the model file.
"""

from __future__ import annotations

import codecs
import hashlib
import heapq
import logging
import operator
import re
import threading
from array import array
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, replace
from itertools import accumulate, islice, repeat
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from shared.errors import TokenizerError
from shared.tokenizer_spec import PIECE_ERRORS, SPEC_FORMAT, PackedStrings, TokenizerSpec
from shared.wire_types import WireTypeError, checked

if TYPE_CHECKING:
    from tokenizers import Tokenizer as _HFTokenizer

log = logging.getLogger(__name__)


def _hf() -> ModuleType:
    """The Hugging Face ``tokenizers`` library, imported when an encoder is first built from it:
    a process that only decodes (a worker), or whose vocabulary's encoder is our own (a
    SentencePiece vocabulary's), never loads it (3 MiB of a gateway serving gemma-3-270m)."""
    import tokenizers
    return tokenizers

TOKEN_NORMAL = 1
TOKEN_UNKNOWN = 2
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4
TOKEN_UNUSED = 5
TOKEN_BYTE = 6

# Token texts that end a turn in the families we serve. A vocabulary may carry them without
# marking them control (a converter bug); like llama.cpp we then treat them as control anyway.
END_OF_TURN_TEXTS = frozenset({
    "<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|end|>",
    "<|end_of_text|>", "<EOT>", "<turn|>", "<|assistant_end|>",
    # nanochat's calculator result is the caller's to write: the reply stops where it would begin
    "<|output_start|>",
})

# Fill-in-the-middle: the GGUF keys of the prefix, suffix and middle tokens, and, for files that
# lack them, the token texts of the families that spell them out (Qwen2.5-Coder, StarCoder,
# DeepSeek-Coder's ASCII form).
FIM_KEYS = ("tokenizer.ggml.fim_pre_token_id", "tokenizer.ggml.fim_suf_token_id", "tokenizer.ggml.fim_mid_token_id")
FIM_TEXTS = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
    ("<fim-prefix>", "<fim-suffix>", "<fim-middle>"),
)

# --- pre-tokenizer split regexes (llama.cpp's, per pre type) -------------------------------

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
# Contractions in any case, spelled out because the reference engine's regex has no (?i:).
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# nanochat's GPT-4-style split (digits in runs of up to two; possessive quantifiers).
_NANOCHAT = (r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}| ?[^\s\p{L}\p{N}]++[\r\n]*"
             r"|\s*[\r\n]|\s+(?!\S)|\s+")
# Qwen 3.5 keeps combining marks inside words.
_QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# o200k (GPT-4o, Llama 4, Inkling): a word is its capitalised head and lower-case tail, combining
# marks in both, with an optional contraction; digits in runs of up to three.
_UPPER, _LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_O200K = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?"
          rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclass(frozen=True)
class PreTokenizerKind:
    """One llama.cpp pre-tokenizer type: its splits and the BPE flags that go with it."""

    splits: tuple[str, ...]
    ignore_merges: bool = False  # a whole pre-token found in the vocabulary is taken as is
    add_bos_default: bool = False


PRE_KINDS: dict[str, PreTokenizerKind] = {
    "default": PreTokenizerKind((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")),
    "gpt2": PreTokenizerKind((_GPT2,)),
    # starcoder group: every digit on its own, then the gpt2 split
    "starcoder": PreTokenizerKind((r"\p{N}", _GPT2)),
    "llama3": PreTokenizerKind((_LLAMA3,), ignore_merges=True, add_bos_default=True),
    "qwen2": PreTokenizerKind((_QWEN2,)),
    "qwen35": PreTokenizerKind((_QWEN35,)),
    "nanochat": PreTokenizerKind((_NANOCHAT,)),
    "o200k": PreTokenizerKind((_O200K,)),
}

# tokenizer.ggml.pre value -> kind. Names as the GGUF converters write them.
PRE_NAMES: dict[str, str] = {
    "default": "default",
    **dict.fromkeys(("gpt2", "gpt-2", "phi-2", "mpt", "olmo", "jais", "exaone4"), "gpt2"),
    **dict.fromkeys(("starcoder", "smollm", "refact", "command-r", "codeshell", "exaone",
                     "minerva-7b"), "starcoder"),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral"), "llama3"),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2"), "qwen2"),
    "qwen35": "qwen35",
    "nanochat": "nanochat",
    **dict.fromkeys(("gpt-4o", "llama4", "inkling"), "o200k"),
}


def byte_level_alphabet() -> tuple[str, ...]:
    """GPT-2's byte-to-character table: entry b is the character standing for byte b.

    Printable Latin-1 bytes stand for themselves; the rest (controls, space, soft hyphen...)
    are moved to U+0100 onwards so that every token string is printable and space-free.
    """
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(ord("¡"), ord("¬") + 1)) \
        | set(range(ord("®"), ord("ÿ") + 1))
    table: list[str] = []
    shifted = 0
    for byte in range(256):
        if byte in printable:
            table.append(chr(byte))
        else:
            table.append(chr(256 + shifted))
            shifted += 1
    return tuple(table)


_CHAR_TO_LATIN1 = {ord(char): byte for byte, char in enumerate(byte_level_alphabet())}


def _get(meta: dict[str, Any], key: str, kind: type, required: bool = True) -> Any:
    value = meta.get(key)
    if value is None:
        if required:
            raise TokenizerError(f"GGUF metadata lacks {key!r}: cannot build the tokenizer")
        return None
    if kind is list and isinstance(value, PackedStrings):
        return value  # a list of strings as the GGUF reader keeps one
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise TokenizerError(f"GGUF metadata {key!r} should be {kind.__name__}, got {type(value).__name__}")
    return value


def _fim_ids(meta: dict[str, Any], tokens: list[str], types: bytes) -> list[int] | None:
    """[prefix, suffix, middle] ids: from the GGUF keys when all three are there, else from the
    first family's texts that the vocabulary holds as control or user-defined tokens."""
    ids = [_optional_id(meta, key, len(tokens)) for key in FIM_KEYS]
    if all(i is not None for i in ids):
        return ids
    added = {tokens[i]: i for i in ids_of_types(types, (TOKEN_CONTROL, TOKEN_USER_DEFINED))}
    for texts in FIM_TEXTS:
        if all(text in added for text in texts):
            return [added[text] for text in texts]
    return None


def _strings(value: list[str]) -> list[str]:
    """A list of strings from the metadata, made at once from the reader's packed form."""
    return value.to_list() if isinstance(value, PackedStrings) else list(value)


def ids_of_types(types: bytes, kinds: tuple[int, ...]) -> list[int]:
    """The ids whose token type is one of ``kinds``, in order: one scan of the bytes by a
    pattern, so Python touches only the ids found (this module keeps numpy out of a gateway)."""
    pattern = re.compile(b"[" + b"".join(re.escape(bytes([kind])) for kind in kinds) + b"]")
    return [found.start() for found in pattern.finditer(types)]


def _optional_id(meta: dict[str, Any], key: str, vocab_size: int) -> int | None:
    value = _get(meta, key, int, required=False)
    if value is None:
        return None
    if not 0 <= value < vocab_size:
        log.warning("ignoring %s = %d: outside the vocabulary of %d tokens", key, value, vocab_size)
        return None
    return value


@dataclass(frozen=True)
class AddedTexts:
    """The added tokens an encoder matches before its model: control ones only when
    ``match_special``, user-defined ones always."""

    special: tuple[str, ...]
    user_defined: tuple[str, ...]
    match_special: bool


class VocabularyModel:
    """One kind of vocabulary (a ``tokenizer.ggml.model`` value): what it reads beyond the
    tokens, how a token string maps to bytes, and the encoder that splits text into them."""

    name: str
    always_bos = False  # BOS is added whatever the file's add_bos_token says

    @classmethod
    def read(cls, meta: dict[str, Any]) -> dict[str, Any]:
        """The spec entries of this kind from GGUF metadata; raises TokenizerError."""
        raise NotImplementedError

    @classmethod
    def check(cls, spec: TokenizerSpec, merges: bool = True) -> None:
        """Raise TokenizerError when a received spec lacks or garbles this kind's entries;
        ``merges`` False: all but whether the merges name pieces of the vocabulary (the encoder,
        built at once, refuses those itself)."""

    @classmethod
    def add_bos_default(cls, spec: TokenizerSpec) -> bool:
        return False

    @classmethod
    def piece_bytes(cls, piece: str, token_type: int) -> bytes:
        raise NotImplementedError

    @classmethod
    def all_piece_bytes(cls, tokens: list[str], types: bytes) -> list[bytes]:
        """``piece_bytes`` of every token (a kind may do it faster than one by one)."""
        return [cls.piece_bytes(piece, types[index]) for index, piece in enumerate(tokens)]

    @classmethod
    def encoder(cls, spec: TokenizerSpec, space_prefix: bool = True) -> _HFTokenizer:
        """The encoder over the ordinary tokens; added tokens are registered by ``encode_with``.
        ``space_prefix`` False: a text that continues another (no leading-space rule)."""
        raise NotImplementedError

    @classmethod
    def encode_with(cls, spec: TokenizerSpec, index: PieceIndex, space_prefix: bool,
                    added: AddedTexts) -> Callable[[str], list[int]]:
        """A function from text to ids: ``encoder`` with the added tokens matched first."""
        return with_added(cls.encoder(spec, space_prefix), added)


def piece_ids(spec: TokenizerSpec) -> dict[str, int]:
    """piece -> id as a dict (a Hugging Face encoder copies it in; the last of equal pieces wins)."""
    return {piece: index for index, piece in enumerate(spec.tokens())}


class PieceIndex:
    """A vocabulary's piece -> id, kept as one sorted array of 64-bit keys, a piece's hash in
    the high bits and its id in the low ones: eight bytes a token where a dict of strings takes
    over a hundred (2 MB against 34 for Gemma's 262k pieces). A lookup bisects the keys and
    compares its candidates' UTF-8 with the spec's blob; of equal pieces the first wins."""

    def __init__(self, spec: TokenizerSpec, tokens: list[str] | None = None, ends: array | None = None):
        """``tokens``: the spec's strings, and ``ends`` their offsets, where the caller has them
        made already (a megabyte of offsets for Gemma's vocabulary, not held twice)."""
        n = spec.vocab_size
        self.id_mask = (1 << max(1, n.bit_length())) - 1
        self.high = ((1 << 64) - 1) ^ self.id_mask
        # the sort compares plain integers: no key function, no tuple per token (a hash's sign
        # bits and'ed away as an unsigned 64-bit word's would be)
        high = self.high
        self.keys = array("Q", sorted([(code & high) | index for index, code in
                                       enumerate(map(hash, spec.tokens() if tokens is None else tokens))]))
        self.blob, self.ends = spec.pieces, spec.piece_offsets() if ends is None else ends

    def get(self, piece: str) -> int | None:
        keys, high, code = self.keys, self.high, hash(piece) & self.high
        at = bisect_left(keys, code)
        encoded = None
        while at < len(keys) and keys[at] & high == code:
            index = keys[at] & self.id_mask
            encoded = encoded if encoded is not None else piece.encode("utf-8", PIECE_ERRORS)
            if self.blob[self.ends[index - 1] if index else 0:self.ends[index]] == encoded:
                return index
            at += 1
        return None


def with_added(backend: _HFTokenizer, added: AddedTexts) -> Callable[[str], list[int]]:
    """A Hugging Face encoder with the added tokens registered, as a function from text to ids."""
    added_token = _hf().AddedToken
    backend.add_special_tokens([added_token(text, special=True, normalized=False) for text in added.special])
    backend.add_tokens([added_token(text, special=False, normalized=False) for text in added.user_defined])
    # When off, tokens added as "special" are not matched; user-defined ones still are.
    backend.encode_special_tokens = not added.match_special
    return lambda text: backend.encode(text, add_special_tokens=False).ids


class ByteLevelBPE(VocabularyModel):
    """GPT-2-style byte-level BPE: token strings in the byte alphabet, ranked merges, and a
    pre-tokenizer named by ``tokenizer.ggml.pre``."""

    name = "gpt2"

    @classmethod
    def read(cls, meta: dict[str, Any]) -> dict[str, Any]:
        merges = _strings(_get(meta, "tokenizer.ggml.merges", list))
        pre = meta.get("tokenizer.ggml.pre") or ""
        if not pre:
            log.warning("GGUF has no tokenizer.ggml.pre; using the 'default' pre-tokenizer, "
                        "which may not match how the model was trained")
            pre = "default"
        _check_pre(pre)
        return {"pre": pre, "merges": merges}

    @classmethod
    def check(cls, spec: TokenizerSpec, merges: bool = True) -> None:
        if spec.merges is None:
            raise TokenizerError("tokenizer spec lacks merges")
        _check_pre(spec.pre)
        if merges:
            _check_merges(spec)

    @classmethod
    def add_bos_default(cls, spec: TokenizerSpec) -> bool:
        return PRE_KINDS[PRE_NAMES[spec.pre]].add_bos_default

    @classmethod
    def piece_bytes(cls, piece: str, token_type: int) -> bytes:
        try:
            return piece.translate(_CHAR_TO_LATIN1).encode("latin-1")
        except UnicodeEncodeError:
            # A character outside the byte alphabet: the converter stored raw text; keep it.
            return piece.encode("utf-8")

    @classmethod
    def all_piece_bytes(cls, tokens: list[str], types: bytes) -> list[bytes]:
        # one translation of the whole vocabulary: every character of the byte alphabet is one
        # byte, so the pieces end where their strings do
        try:
            joined = "".join(tokens).translate(_CHAR_TO_LATIN1).encode("latin-1")
        except UnicodeEncodeError:  # raw text somewhere: piece by piece
            return super().all_piece_bytes(tokens, types)
        ends = list(accumulate(map(len, tokens)))
        return list(map(joined.__getitem__, map(slice, [0, *ends], ends)))

    @classmethod
    def encoder(cls, spec: TokenizerSpec, space_prefix: bool = True) -> _HFTokenizer:
        kind = PRE_KINDS[PRE_NAMES[spec.pre]]
        backend = _stored_merges_bpe(piece_ids(spec), spec.merges, ignore_merges=kind.ignore_merges)
        hf = _hf()
        backend.pre_tokenizer = hf.pre_tokenizers.Sequence(
            [hf.pre_tokenizers.Split(hf.Regex(pattern), behavior="isolated") for pattern in kind.splits]
            + [hf.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
        return backend


def _stored_merges_bpe(vocab: dict[str, int], lines: list[str], **options: Any) -> _HFTokenizer:
    """A BPE encoder from a file's merges ("left right" strings)."""
    try:
        hf = _hf()
        return hf.Tokenizer(hf.models.BPE(vocab=vocab, merges=_merge_pairs(lines), **options))
    except Exception as exc:  # the tokenizers library raises a bare Exception here
        raise TokenizerError(f"the vocabulary's BPE merges are inconsistent: {exc}") from exc


def _check_merges(spec: TokenizerSpec) -> None:
    """Every merge is "left right" with left, right and their union in the vocabulary (what the
    encoder, built on first use, would refuse later). A vocabulary that passed once leaves a mark
    named by a digest of its pieces and merges (``checked_mark``): a later start of the same file
    skips the half second of checking 150k merges."""
    mark = checked_mark(spec)
    if mark.exists():
        return
    _merges_name_pieces(spec)
    try:
        mark.parent.mkdir(parents=True, exist_ok=True)
        mark.touch()
    except OSError:  # a cache one cannot write: check again next time
        pass


def checked_mark(spec: TokenizerSpec) -> Path:
    """The file marking that a vocabulary's merges passed ``_check_merges``, under lmserve's
    cache: named by a digest of the pieces, their ends, and the merges with their lengths."""
    from shared.default_model import cache_dir  # here: the gateway never checks merges
    digest = hashlib.sha256(spec.pieces)
    digest.update(spec.piece_ends)
    digest.update(array("Q", map(len, spec.merges)).tobytes())
    digest.update("".join(spec.merges).encode("utf-8", "surrogatepass"))
    return cache_dir() / "vocabularies" / f"{digest.hexdigest()[:32]}.merges-checked"


def _merges_name_pieces(spec: TokenizerSpec) -> None:
    pieces = set(spec.tokens())
    pairs = _merge_pairs(spec.merges)
    lefts, rights = [left for left, _ in pairs], [right for _, right in pairs]
    if pieces.issuperset(lefts) and pieces.issuperset(rights) and pieces.issuperset(map(str.__add__, lefts, rights)):
        return
    for left, right in pairs:  # which one: for the message
        if left not in pieces or right not in pieces or left + right not in pieces:
            raise TokenizerError(f"the vocabulary's BPE merges are inconsistent: {left!r} + {right!r} "
                                 "names a piece the vocabulary lacks")


def _merge_pairs(lines: list[str]) -> list[tuple[str, str]]:
    # Split at the first space after the first character, so a merge whose left part is itself
    # a space (raw-text vocabularies) still parses: partition in one map, the few lines that
    # start with a space cut again.
    parts = list(map(str.partition, lines, repeat(" ")))
    merges = [(left, right) for left, _, right in parts]
    for index in [i for i, (left, space, _) in enumerate(parts) if not (left and space)]:
        line = lines[index]
        cut = line.find(" ", 1)
        if cut < 0:
            raise TokenizerError(f"malformed BPE merge {line!r}: expected 'left right'")
        merges[index] = (line[:cut], line[cut + 1:])
    return merges


def trie_pattern(texts: set[str]) -> str:
    """One regex for a set of literals, nested by shared prefixes (longest match first), so that
    a scan tests each position against a branch per first character, not against every text:
    a vocabulary such as Gemma's has thousands of control tokens."""
    trie: dict = {}
    for text in texts:
        node = trie
        for char in text:
            node = node.setdefault(char, {})
        node[""] = {}

    def pattern(node: dict) -> str:
        branches = [re.escape(char) + pattern(child) for char, child in sorted(node.items()) if char]
        if "" in node:
            branches.append("")  # a text ends here; longer ones were tried first
        if len(branches) == 1:
            return branches[0]
        return "(?:" + "|".join(branches) + ")"

    return pattern(trie)


def sentencepiece_merges(tokens: list[str], types: bytes | list[int], scores: Any) -> list[tuple[str, str]]:
    """SentencePiece's merges as ranked BPE merges: every split of an ordinary piece into two
    ordinary pieces, ranked by the score of their union (best first; ties by the union's id)."""
    ordinary = {piece for piece, t in zip(tokens, types) if t == TOKEN_NORMAL}
    ranked = []
    for index, piece in enumerate(tokens):
        if types[index] != TOKEN_NORMAL or len(piece) < 2:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in ordinary and right in ordinary:
                ranked.append((-scores[index], index, cut, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


class SentencePieceBPE(VocabularyModel):
    """SentencePiece's BPE vocabularies (Llama 2, Gemma): pieces spell a space as ▁, each piece
    has a score, and ``<0xAB>`` tokens stand for the bytes no piece covers.

    SentencePiece merges, again and again, the adjacent pair whose union is the best-scored
    piece. That is BPE whose merges are every split of every piece into two pieces, ranked by
    the score of their union (ties by the union's id), which is how the encoder is built here;
    unknown characters fall back to byte tokens. Only ordinary pieces are merge results, so no
    text a client writes can merge into a control token. A space is prepended to the text
    where ``tokenizer.ggml.add_space_prefix`` says so (its default is yes)."""

    name = "llama"

    @classmethod
    def read(cls, meta: dict[str, Any]) -> dict[str, Any]:
        scores = _get(meta, "tokenizer.ggml.scores", list)
        prefix = meta.get("tokenizer.ggml.add_space_prefix")
        # float32 bytes: a quarter of a megabyte per 65k tokens on the wire, not nine bytes each
        return {"scores": array("f", scores).tobytes(), "add_space_prefix": True if prefix is None else bool(prefix)}

    @classmethod
    def check(cls, spec: TokenizerSpec, merges: bool = True) -> None:
        if spec.scores is None or len(spec.scores) != 4 * spec.vocab_size:
            raise TokenizerError("tokenizer spec lacks one score per token")

    @classmethod
    def add_bos_default(cls, spec: TokenizerSpec) -> bool:
        return True

    @classmethod
    def piece_bytes(cls, piece: str, token_type: int) -> bytes:
        if token_type == TOKEN_BYTE and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])
        return piece.replace("\u2581", " ").encode("utf-8")

    @classmethod
    def all_piece_bytes(cls, tokens: list[str], types: bytes) -> list[bytes]:
        # one replace and one encode of the whole vocabulary, cut at a separator no piece holds
        separator = "\x00"
        joined = separator.join(tokens)
        if not tokens or joined.count(separator) != len(tokens) - 1:  # a piece holds the separator
            return super().all_piece_bytes(tokens, types)
        pieces = joined.replace("\u2581", " ").encode("utf-8").split(separator.encode())
        for index in ids_of_types(types, (TOKEN_BYTE,)):
            pieces[index] = cls.piece_bytes(tokens[index], TOKEN_BYTE)
        return pieces

    @classmethod
    def encoder(cls, spec: TokenizerSpec, space_prefix: bool = True) -> _HFTokenizer:
        """The same encoder as a Hugging Face BPE of every split (``sentencepiece_merges``):
        for parity checks; ``encode_with`` serves without the table of merges."""
        scores = array("f")
        scores.frombytes(spec.scores)
        merges = sentencepiece_merges(spec.tokens(), spec.token_types, scores)
        hf = _hf()
        backend = hf.Tokenizer(hf.models.BPE(vocab=piece_ids(spec), merges=merges, byte_fallback=True,
                                             fuse_unk=False))
        steps = [hf.normalizers.Replace(" ", "\u2581")]
        if spec.add_space_prefix and space_prefix:
            steps.insert(0, hf.normalizers.Prepend(" "))
        backend.normalizer = hf.normalizers.Sequence(steps)
        return backend

    @classmethod
    def encode_with(cls, spec: TokenizerSpec, index: PieceIndex, space_prefix: bool,
                    added: AddedTexts) -> Callable[[str], list[int]]:
        return SentencePieceEncoder(spec, index, bool(spec.add_space_prefix) and space_prefix, added)


class RecentPieces:
    """The ids of the pieces encoded lately, the least recently used forgotten first once their
    texts exceed ``BUDGET`` characters. Gemma's pieces are mostly lines (its runs of line breaks
    are tokens of their own): a 3.6k-token prompt of this README encodes in 60 ms, and again,
    from here, in under 2 ms. Shared by the threads of one encoder."""

    SHORTEST = 16  # characters; a shorter piece encodes in a few microseconds
    BUDGET = 1 << 20  # characters remembered, some 250k tokens: about 6 MiB with their ids

    def __init__(self, budget: int = BUDGET):
        self.budget = budget
        self.chars = 0
        self._entries: OrderedDict[str, array] = OrderedDict()  # the latest used last
        self._lock = threading.Lock()

    def get(self, text: str) -> array | None:
        with self._lock:
            ids = self._entries.get(text)
            if ids is not None:
                self._entries.move_to_end(text)
            return ids

    def put(self, text: str, ids: array) -> None:
        if len(text) > self.budget:
            return
        with self._lock:
            if text in self._entries:
                return
            self._entries[text] = ids
            self.chars += len(text)
            while self.chars > self.budget:
                oldest, _ = self._entries.popitem(last=False)
                self.chars -= len(oldest)

    def __len__(self) -> int:
        return len(self._entries)


class SentencePieceEncoder:
    """SentencePiece's BPE without a table of merges.

    The text is cut at the added tokens (the longest first at each place; control tokens only
    with ``match_special``), then each piece between them takes its leading space (where the
    rule says) with spaces spelled ▁, starts as one symbol per character (a character outside
    the vocabulary as its UTF-8 bytes' ``<0xAB>`` tokens), and merges again and again the
    adjacent pair whose union is an ordinary piece, best first: the highest score, then the
    lowest id of the union, then the shorter left part, then the leftmost place. That is the
    order of a BPE whose merges are every split of every piece ranked so (``encoder``), which a
    Hugging Face tokenizer holds as a table of half a million merges for Gemma's vocabulary
    (a hundred megabytes); here a pair's rank is computed from the union's score and id."""

    def __init__(self, spec: TokenizerSpec, vocab: PieceIndex, space_prefix: bool, added: AddedTexts):
        self.vocab = vocab
        self.types = spec.token_types
        self.scores = array("f")
        self.scores.frombytes(spec.scores)
        self.space_prefix = space_prefix
        self.byte_ids = [vocab.get(f"<0x{b:02X}>") for b in range(256)]
        texts = set(added.user_defined) | (set(added.special) if added.match_special else set())
        self.added = re.compile(trie_pattern(texts)) if texts else None
        self.recent = RecentPieces()

    def __call__(self, text: str) -> list[int]:
        if self.added is None:
            return list(self._remembered(text))
        ids: list[int] = []
        at = 0
        for match in self.added.finditer(text):
            ids += self._remembered(text[at:match.start()])
            ids.append(self.vocab.get(match.group()))
            at = match.end()
        return ids + list(self._remembered(text[at:]))

    def _remembered(self, text: str) -> Iterable[int]:
        """``encode_piece(text)``, from ``recent`` where the piece was encoded lately: a piece's ids
        depend on its text alone, and a conversation's next turn repeats its earlier messages."""
        if len(text) < RecentPieces.SHORTEST:
            return self.encode_piece(text)
        ids = self.recent.get(text)
        if ids is None:
            ids = array("I", self.encode_piece(text))
            self.recent.put(text, ids)
        return ids

    def _mergeable(self, union: str) -> int | None:
        index = self.vocab.get(union)
        return index if index is not None and self.types[index] == TOKEN_NORMAL else None

    def encode_piece(self, text: str) -> list[int]:
        """The ids of one piece (a text between added tokens), from scratch."""
        if not text:
            return []
        if self.space_prefix:
            text = " " + text
        text = text.replace(" ", "\u2581")
        vocab, types, scores = self.vocab, self.types, self.scores
        pieces: list[str] = []  # each symbol's text ("" for a byte, which never merges)
        ids: list[int] = []
        for char in text:
            index = vocab.get(char)
            if index is not None:
                pieces.append(char)
                ids.append(index)
                continue
            fallback = [self.byte_ids[b] for b in char.encode("utf-8")]
            if all(i is not None for i in fallback):
                pieces += [""] * len(fallback)
                ids += fallback
        n = len(ids)
        after = list(range(1, n + 1))
        before = list(range(-1, n - 1))
        queue: list[tuple[float, int, int, int]] = []

        def offer(left: int) -> None:
            right = after[left]
            if right >= n or not pieces[left] or not pieces[right] or types[ids[left]] != TOKEN_NORMAL \
                    or types[ids[right]] != TOKEN_NORMAL:
                return
            union = self._mergeable(pieces[left] + pieces[right])
            if union is not None:
                heapq.heappush(queue, (-scores[union], union, len(pieces[left]), left))

        for left in range(n - 1):
            offer(left)
        while queue:
            _, union, _, left = heapq.heappop(queue)
            right = after[left]
            # an entry whose place has changed since is passed over, unless the pair there now
            # makes the same union
            if not pieces[left] or right >= n or not pieces[right] \
                    or self._mergeable(pieces[left] + pieces[right]) != union:
                continue
            pieces[left] += pieces[right]
            ids[left] = union
            pieces[right] = ""
            ids[right] = -1
            after[left] = after[right]
            if after[left] < n:
                before[after[left]] = left
            if before[left] >= 0:
                offer(before[left])
            offer(left)
        return [i for i in ids if i >= 0]


class Gemma4BPE(SentencePieceBPE):
    """Gemma 4's vocabulary: SentencePiece's pieces (a space spelled ▁, ``<0xAB>`` tokens for
    the bytes no piece covers) joined by the ranked BPE merges the file stores, over the raw
    text cut only into runs of line breaks and the lines between them (llama.cpp's split for
    it). No leading space is added; BOS always is (llama.cpp overrides a file that says no).
    A run of line breaks that is a token is one: Gemma's runs are user-defined tokens, which
    are matched before any merge."""

    name = "gemma4"
    always_bos = True

    @classmethod
    def read(cls, meta: dict[str, Any]) -> dict[str, Any]:
        return {"merges": _strings(_get(meta, "tokenizer.ggml.merges", list))}

    @classmethod
    def check(cls, spec: TokenizerSpec, merges: bool = True) -> None:
        if spec.merges is None:
            raise TokenizerError("tokenizer spec lacks merges")
        if merges:
            _check_merges(spec)

    @classmethod
    def encode_with(cls, spec: TokenizerSpec, index: PieceIndex, space_prefix: bool,
                    added: AddedTexts) -> Callable[[str], list[int]]:
        return with_added(cls.encoder(spec, space_prefix), added)  # the file's own merges

    @classmethod
    def encoder(cls, spec: TokenizerSpec, space_prefix: bool = True) -> _HFTokenizer:
        backend = _stored_merges_bpe(piece_ids(spec), spec.merges, byte_fallback=True, fuse_unk=False)
        hf = _hf()
        backend.normalizer = hf.normalizers.Replace(" ", "\u2581")
        backend.pre_tokenizer = hf.pre_tokenizers.Split(hf.Regex(r"[^\n]+|\n+"), behavior="isolated")
        return backend


# tokenizer.ggml.model -> the kind that builds it
VOCABULARY_MODELS: dict[str, type[VocabularyModel]] = {
    model.name: model for model in (ByteLevelBPE, SentencePieceBPE, Gemma4BPE)}


class Tokenizer:
    """Text <-> token ids, exactly as the model was trained to see them."""

    def __init__(self, spec: TokenizerSpec, index: bool = False):
        """Build from a spec (see ``to_spec``); use ``from_gguf_metadata`` or ``from_spec``.
        ``index``: make piece -> id now, from the strings made here anyway (an encoder needs it)."""
        self._spec = spec
        self._pieces = PackedStrings(spec.pieces, spec.piece_offsets())  # the strings stay in the spec's blob
        self._types: bytes = bytes(spec.token_types)
        self._model = VOCABULARY_MODELS[spec.model]
        self._bos_id: int | None = spec.bos_id
        self._eos_id: int | None = spec.eos_id
        self._add_bos: bool = spec.add_bos
        self._add_eos: bool = spec.add_eos

        # the few texts looked up here, in one pass over the vocabulary
        found = {text: at for text in END_OF_TURN_TEXTS if (at := self._pieces.find(text)) is not None}
        types = bytearray(self._types)
        stop_ids = {i for i in (self._eos_id, spec.eot_id, spec.eom_id) if i is not None}
        for text in END_OF_TURN_TEXTS:
            at = found.get(text)
            if at is not None:
                stop_ids.add(at)
                types[at] = TOKEN_CONTROL
        self._effective_types = bytes(types)
        self._stop_ids = frozenset(stop_ids)
        self._special_ids = frozenset(ids_of_types(self._effective_types, (TOKEN_CONTROL, TOKEN_UNKNOWN)))
        self._user_defined_ids = frozenset(ids_of_types(self._effective_types, (TOKEN_USER_DEFINED,)))
        # The strings, only while the tables below are made, and made after the small objects
        # kept (the ids' sets): a 262k vocabulary's strings fill some 17 MB of the interpreter's
        # small-object arenas, and an arena goes back only when nothing in it lives on. Made
        # before the sets, they left 1.5-2 MiB more of a Gemma tokenizer in each process.
        tokens = spec.tokens()
        # Added tokens are raw text; everything else is a byte-level string. All of them in one
        # blob (a bytes object per token would cost five times as much for a large vocabulary).
        pieces = self._model.all_piece_bytes(tokens, self._types)
        for token_id in self._special_ids | self._user_defined_ids:
            pieces[token_id] = tokens[token_id].encode("utf-8")
        self._blob = b"".join(pieces)
        self._ends = array("I", accumulate(map(len, pieces)))
        self._max_token_chars = max(map(len, tokens), default=1) or 1
        # piece -> id and the encoders are built on first use: a process that only decodes (a
        # worker) never pays for them
        self._index: PieceIndex | None = PieceIndex(spec, tokens, self._pieces.ends) if index else None
        del pieces, tokens
        # (match_special, space_prefix) -> encoder
        self._backends: dict[tuple[bool, bool], Callable[[str], list[int]]] = {}
        self._backends_lock = threading.Lock()

    # --- construction ---------------------------------------------------------------------

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any]) -> Tokenizer:
        """Build from ``GGUFFile(path).metadata``. Raises TokenizerError naming what is wrong."""
        model = meta.get("tokenizer.ggml.model")
        if model not in VOCABULARY_MODELS:
            raise TokenizerError(
                f"tokenizer.ggml.model is {model!r}, a kind of vocabulary lmserve does not build "
                f"(supported: {', '.join(VOCABULARY_MODELS)})"
            )
        vocabulary = VOCABULARY_MODELS[model]
        tokens = _get(meta, "tokenizer.ggml.tokens", list)
        types = _get(meta, "tokenizer.ggml.token_type", list, required=False)
        if types is None:
            types = [TOKEN_NORMAL] * len(tokens)
        if len(types) < len(tokens):
            raise TokenizerError(
                f"tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens"
            )
        entries = vocabulary.read(meta)
        add_bos = meta.get("tokenizer.ggml.add_bos_token")
        add_eos = meta.get("tokenizer.ggml.add_eos_token")
        size = len(tokens)
        try:
            type_bytes = bytes(types[:size])
        except (TypeError, ValueError) as exc:
            raise TokenizerError(f"tokenizer.ggml.token_type is malformed: {exc}") from exc
        spec = TokenizerSpec.of_tokens(
            tokens, model=model, token_types=type_bytes,
            bos_id=_optional_id(meta, "tokenizer.ggml.bos_token_id", size),
            eos_id=_optional_id(meta, "tokenizer.ggml.eos_token_id", size),
            eot_id=_optional_id(meta, "tokenizer.ggml.eot_token_id", size),
            eom_id=_optional_id(meta, "tokenizer.ggml.eom_token_id", size),
            add_bos=bool(add_bos) or vocabulary.always_bos, add_eos=bool(add_eos),
            fim_ids=_fim_ids(meta, tokens, type_bytes), **entries)
        if add_bos is None:
            spec.add_bos = vocabulary.add_bos_default(spec)
        return cls.from_spec(spec)

    @classmethod
    def from_spec(cls, spec: TokenizerSpec | dict[str, Any], encoder: bool = False) -> Tokenizer:
        """Rebuild from ``to_spec()`` output, or its map as msgpack carries it (``spec_map``).
        ``encoder``: build the encoder now (``warm``), as a gateway does before it serves."""
        if isinstance(spec, dict):
            try:
                spec = checked(spec, TokenizerSpec, "tokenizer spec")
            except WireTypeError as exc:
                raise TokenizerError(exc.message) from exc
        if spec.format != SPEC_FORMAT:
            raise TokenizerError(
                f"tokenizer spec format {spec.format!r} is not the supported format {SPEC_FORMAT}"
            )
        if spec.model not in VOCABULARY_MODELS:
            raise TokenizerError(
                f"tokenizer spec model {spec.model!r} is not supported "
                f"(supported: {', '.join(VOCABULARY_MODELS)})"
            )
        ends = spec.piece_offsets() if len(spec.piece_ends) % 4 == 0 else None
        if ends is None or (ends[-1] if ends else 0) != len(spec.pieces) or \
                not all(map(operator.le, ends, islice(ends, 1, None))):
            raise TokenizerError("tokenizer spec's pieces do not match their offsets")
        try:
            spec.pieces.decode("utf-8", PIECE_ERRORS)
        except UnicodeDecodeError as exc:
            raise TokenizerError(f"tokenizer spec's pieces are not UTF-8: {exc}") from exc
        VOCABULARY_MODELS[spec.model].check(spec, merges=not encoder)
        size = spec.vocab_size
        if len(spec.token_types) != size:
            raise TokenizerError(f"tokenizer spec has {len(spec.token_types)} token types "
                                 f"for {size} tokens")
        if spec.add_bos and spec.bos_id is None:
            raise TokenizerError("the vocabulary asks for a BOS token but names none "
                                 "(tokenizer.ggml.bos_token_id)")
        if spec.add_eos and spec.eos_id is None:
            raise TokenizerError("the vocabulary asks for an EOS token but names none "
                                 "(tokenizer.ggml.eos_token_id)")
        tokenizer = cls(spec, index=encoder)
        if encoder:
            tokenizer.warm()
        return tokenizer

    def to_spec(self) -> TokenizerSpec:
        """Everything needed to rebuild this tokenizer, as plain values (a copy: the caller may
        change it)."""
        return replace(self._spec)

    def spec_map(self) -> dict[str, Any]:
        """``to_spec()`` as the map msgpack carries."""
        return asdict(self._spec)

    @property
    def piece_index(self) -> PieceIndex:
        """piece -> id (built on first use)."""
        if self._index is None:
            self._index = PieceIndex(self._spec, ends=self._pieces.ends)
        return self._index

    @property
    def has_piece_index(self) -> bool:
        """Whether piece -> id has been made (``piece_to_id`` in a process that only decodes
        reads the blob instead)."""
        return self._index is not None

    @property
    def has_encoder(self) -> bool:
        """Whether an encoder has been built (a process that only decodes never builds one)."""
        return bool(self._backends)

    def warm(self) -> None:
        """Build the encoder now rather than on the first ``encode`` (a gateway, before it serves)."""
        self._backend(True, True)

    def _build_backend(self, match_special: bool, space_prefix: bool = True) -> Callable[[str], list[int]]:
        added = AddedTexts(tuple(self.id_to_piece(i) for i in sorted(self._special_ids)),
                           tuple(self.id_to_piece(i) for i in sorted(self._user_defined_ids)), match_special)
        return self._model.encode_with(self._spec, self.piece_index, space_prefix, added)

    def _backend(self, match_special: bool, space_prefix: bool) -> Callable[[str], list[int]]:
        if not self._spec.add_space_prefix:
            space_prefix = True  # no such rule: one encoder serves both
        key = (match_special, space_prefix)
        with self._backends_lock:
            if key not in self._backends:
                self._backends[key] = self._build_backend(match_special, space_prefix)
            return self._backends[key]

    # --- encode / decode ------------------------------------------------------------------

    def encode(self, text: str, add_special: bool = True, parse_special: bool = True,
               continuation: bool = False) -> list[int]:
        """Token ids for ``text``.

        add_special: add BOS/EOS as the vocabulary's add_bos/add_eos flags say.
        parse_special: control-token text such as ``<|im_start|>`` becomes its id; when off it
        is tokenized as ordinary text (use this for user-supplied content).
        continuation: ``text`` follows other text of the same prompt directly (not a start and
        not a control token), so a SentencePiece vocabulary's leading space is not added.
        """
        ids = self._backend(parse_special, not continuation)(text) if text else []
        if add_special and self._add_bos:
            ids.insert(0, self._bos_id)
        if add_special and self._add_eos:
            ids.append(self._eos_id)
        return ids

    def encode_prompt(self, text: str) -> list[int]:
        """A rendered prompt's ids: the vocabulary's BOS unless the text writes it itself (a
        template that does must not get a second), and no closing EOS (a prompt never ends the
        turn it asks the model to write)."""
        bos = self._bos_id
        already = bos is not None and text.startswith(self.id_to_piece(bos))
        ids = self.encode(text, add_special=not already)
        if self._add_eos and ids and ids[-1] == self._eos_id:
            ids.pop()
        return ids

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes a token stands for (added tokens: their text as UTF-8)."""
        return self._blob[self._ends[token_id - 1] if token_id else 0:self._ends[token_id]]

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text for ``ids``; bytes that are not valid UTF-8 become U+FFFD.

        skip_special drops control tokens (``<|im_end|>``...) but keeps user-defined ones
        such as ``<think>``, which are part of what the model says.
        """
        blob, ends, special = self._blob, self._ends, self._special_ids
        data = b"".join(blob[ends[i - 1] if i else 0:ends[i]] for i in ids if not (skip_special and i in special))
        return data.decode("utf-8", errors="replace")

    def incremental_decoder(self, skip_special: bool = False, keep: frozenset[int] = frozenset()) -> IncrementalDecoder:
        """``keep``: control tokens that skip_special leaves in the text all the same (the
        markers a reply's reader needs to see)."""
        return IncrementalDecoder(self, skip_special, keep)

    # --- vocabulary facts -----------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return len(self._pieces)

    @property
    def bos_id(self) -> int | None:
        return self._bos_id

    @property
    def eos_id(self) -> int | None:
        return self._eos_id

    @property
    def add_bos(self) -> bool:
        return self._add_bos

    @property
    def fim_ids(self) -> tuple[int, int, int] | None:
        """The fill-in-the-middle tokens (prefix, suffix, middle), where the vocabulary has them."""
        ids = self._spec.fim_ids
        return tuple(ids) if ids else None

    @property
    def add_eos(self) -> bool:
        return self._add_eos

    @property
    def pre(self) -> str | None:
        """The pre-tokenizer's name, for the kinds of vocabulary that have one."""
        return self._spec.pre

    @property
    def stop_ids(self) -> frozenset[int]:
        """Ids that end a turn: EOS, EOT/EOM when named, and end-of-turn control tokens."""
        return self._stop_ids

    @property
    def special_ids(self) -> frozenset[int]:
        """Control (and unknown) tokens: matched only with parse_special, dropped by skip_special."""
        return self._special_ids

    @property
    def user_defined_ids(self) -> frozenset[int]:
        """User-defined added tokens (e.g. ``<think>``): always matched, always decoded."""
        return self._user_defined_ids

    @property
    def max_token_chars(self) -> int:
        """No token stands for more characters of text than this, so a text of n characters
        is at least n / max_token_chars tokens (a bound found without tokenizing it)."""
        return self._max_token_chars

    def token_type(self, token_id: int) -> int:
        """GGUF token type (1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte)."""
        return self._effective_types[token_id]

    def id_to_piece(self, token_id: int) -> str:
        """The vocabulary's string for an id (byte-level form for ordinary tokens)."""
        if not 0 <= token_id < len(self._pieces):
            raise IndexError(f"token id {token_id} is outside the vocabulary of {len(self._pieces)}")
        return self._pieces[token_id]

    def piece_to_id(self, piece: str) -> int | None:
        """The id of a vocabulary string, or None (e.g. ``piece_to_id("<|im_end|>")``); of
        equal strings, the first. Where no encoder needed the index (a worker, which looks up a
        few dozen tags), the string is found in the vocabulary's blob instead (a millisecond
        for Gemma's 262k pieces), and the index's 3 MB are never made."""
        index = self._index
        return index.get(piece) if index is not None else self._pieces.find(piece)


class IncrementalDecoder:
    """Turns a stream of ids into text, emitting only complete UTF-8 characters.

    A multi-byte character split across tokens (emoji, CJK) is held back until its last byte
    arrives; invalid bytes become U+FFFD once it is certain they cannot complete.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False, keep: frozenset[int] = frozenset()):
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._keep = keep
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Feed one id; return the text it completes (possibly empty)."""
        if self._skip_special and token_id in self._tokenizer.special_ids and token_id not in self._keep:
            return ""
        return self._utf8.decode(self._tokenizer.token_bytes(token_id))

    def push_many(self, ids: Iterable[int]) -> str:
        return "".join(self.push(i) for i in ids)

    def flush(self) -> str:
        """End of stream: whatever is held back, with U+FFFD for an incomplete character."""
        return self._utf8.decode(b"", final=True)

    @property
    def pending(self) -> bool:
        """True while bytes of an unfinished character are held back."""
        return bool(self._utf8.getstate()[0])


def _check_pre(pre: object) -> None:
    if pre not in PRE_NAMES:
        raise TokenizerError(
            f"tokenizer.ggml.pre is {pre!r}, a pre-tokenizer lmserve does not know "
            f"(supported: {', '.join(sorted(PRE_NAMES))})"
        )
