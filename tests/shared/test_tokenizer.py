"""The tokenizer built from GGUF metadata, held to llama.cpp's ids (tests/fixtures/tokenizer_parity.json)."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import msgpack
import pytest

from shared import tokenizer as tokenizer_module
from shared.errors import TokenizerError
from shared.tokenizer import PRE_NAMES, TOKEN_CONTROL, TOKEN_USER_DEFINED, PieceIndex, Tokenizer
from shared.tokenizer_spec import PackedStrings, TokenizerSpec

VOCABS = ("smollm2", "qwen3", "gemma3", "gemma4")


def _with(meta: dict[str, Any], **changes: Any) -> dict[str, Any]:
    """A copy of GGUF metadata with some tokenizer keys changed (None removes a key)."""
    copy = dict(meta)
    for short, value in changes.items():
        key = "tokenizer.ggml." + short
        if value is None:
            copy.pop(key, None)
        else:
            copy[key] = value
    return copy


# --- parity with llama.cpp ----------------------------------------------------------------

@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("mode", ["parse_special", "plain"])
def test_encode_matches_llama_cpp(vocab, mode, parity, tokenizers):
    tokenizer = tokenizers[vocab]
    expected_all = parity["vocabularies"][vocab][mode]
    assert len(expected_all) == len(parity["corpus"])
    mismatches = []
    for text, expected in zip(parity["corpus"], expected_all):
        got = tokenizer.encode(text, add_special=False, parse_special=(mode == "parse_special"))
        if got != expected:
            mismatches.append(f"{text!r}\n  llama.cpp {expected}\n  lmserve   {got}")
    assert not mismatches, "\n".join(mismatches)


@pytest.mark.parametrize("vocab", VOCABS)
def test_add_special_matches_llama_cpp(vocab, parity, tokenizers):
    for index, expected in parity["vocabularies"][vocab]["add_special"].items():
        assert tokenizers[vocab].encode(parity["corpus"][int(index)], add_special=True) == expected


def test_add_bos_token_true_matches_llama_cpp(parity, qwen_metadata):
    tokenizer = Tokenizer.from_gguf_metadata(_with(qwen_metadata, add_bos_token=True))
    for index, expected in parity["qwen3_add_bos_token_true"].items():
        assert expected[0] == tokenizer.bos_id
        assert tokenizer.encode(parity["corpus"][int(index)], add_special=True) == expected


def test_fixture_exercises_both_modes(parity):
    # If parse_special and plain never differed, the fixture could not catch a matcher bug.
    for vocab in VOCABS:
        entry = parity["vocabularies"][vocab]
        assert entry["parse_special"] != entry["plain"]


# --- decoding -----------------------------------------------------------------------------

@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("parse_special", [True, False])
def test_decode_round_trips_the_corpus(vocab, parse_special, parity, tokenizers):
    tokenizer = tokenizers[vocab]
    for text in parity["corpus"]:
        assert tokenizer.decode(tokenizer.encode(text, add_special=False, parse_special=parse_special)) == text


@pytest.mark.parametrize("vocab", VOCABS)
def test_incremental_decoder_holds_back_partial_characters(vocab, tokenizers):
    tokenizer = tokenizers[vocab]
    # the last two no piece of Gemma's vocabulary covers: they come as byte tokens
    text = "Emoji 😀👩‍👩‍👧‍👦🇫🇷 and CJK 日本語のテキスト, 한국어 🤖! \u2fd5\U00010348"
    ids = tokenizer.encode(text, add_special=False)
    decoder = tokenizer.incremental_decoder()
    pieces = [decoder.push(i) for i in ids]
    assert "".join(pieces) + decoder.flush() == text
    assert not any("\ufffd" in piece for piece in pieces)
    # Some emoji are split across tokens: at least one push must have waited for more bytes.
    assert any(len(tokenizer.token_bytes(i).decode("utf-8", "ignore")) == 0 for i in ids)
    assert "" in pieces


def test_incremental_decoder_flushes_a_cut_character_as_replacement(smollm_tokenizer):
    ids = smollm_tokenizer.encode("😀")
    assert len(ids) > 1  # the emoji is several byte tokens
    decoder = smollm_tokenizer.incremental_decoder()
    assert decoder.push(ids[0]) == ""
    assert decoder.pending
    assert decoder.flush() == "\ufffd"


def test_incremental_decoder_skip_special(qwen_tokenizer):
    ids = qwen_tokenizer.encode("<think>hm</think>ok<|im_end|>")
    decoder = qwen_tokenizer.incremental_decoder(skip_special=True)
    assert decoder.push_many(ids) == "<think>hm</think>ok"
    ids = qwen_tokenizer.encode("<|im_start|>ok<|im_end|><|endoftext|>")
    keeping = qwen_tokenizer.incremental_decoder(skip_special=True, keep=frozenset({qwen_tokenizer.piece_to_id("<|im_end|>")}))
    assert keeping.push_many(ids) == "ok<|im_end|>"


def test_decode_skip_special_keeps_user_defined_tokens(qwen_tokenizer):
    ids = qwen_tokenizer.encode("<|im_start|>assistant\n<think>x</think>y<|im_end|>")
    assert qwen_tokenizer.decode(ids, skip_special=True) == "assistant\n<think>x</think>y"


def test_token_bytes(smollm_tokenizer, qwen_tokenizer):
    space_hello = smollm_tokenizer.encode(" hello", add_special=False)
    assert len(space_hello) == 1 and smollm_tokenizer.token_bytes(space_hello[0]) == b" hello"
    assert smollm_tokenizer.token_bytes(2) == b"<|im_end|>"
    assert qwen_tokenizer.token_bytes(151667) == b"<think>"
    emoji_ids = qwen_tokenizer.encode("😀😃")
    assert b"".join(qwen_tokenizer.token_bytes(i) for i in emoji_ids) == "😀😃".encode()


# --- special tokens and vocabulary facts -----------------------------------------------------

def test_parse_special_controls_control_tokens(smollm_tokenizer):
    assert smollm_tokenizer.encode("<|im_start|>", parse_special=True) == [1]
    plain = smollm_tokenizer.encode("<|im_start|>", parse_special=False)
    assert len(plain) > 1 and not set(plain) & smollm_tokenizer.special_ids


def test_user_defined_tokens_match_even_without_parse_special(qwen_tokenizer):
    # llama.cpp (and HF) always match user-defined added tokens; only control ones are gated.
    assert qwen_tokenizer.token_type(151667) == TOKEN_USER_DEFINED
    assert qwen_tokenizer.encode("<think>", parse_special=False) == [151667]
    assert qwen_tokenizer.encode("<tool_call>", parse_special=False) == [151657]
    assert 151645 not in qwen_tokenizer.encode("<|im_end|>", parse_special=False)


def test_vocabulary_facts(smollm_tokenizer, qwen_tokenizer):
    assert smollm_tokenizer.vocab_size == 49152
    assert (smollm_tokenizer.bos_id, smollm_tokenizer.eos_id) == (1, 2)
    assert smollm_tokenizer.stop_ids == {0, 2}  # <|endoftext|>, <|im_end|>
    assert smollm_tokenizer.special_ids == set(range(17))
    assert qwen_tokenizer.vocab_size == 151936
    assert (qwen_tokenizer.bos_id, qwen_tokenizer.eos_id) == (151643, 151645)
    assert qwen_tokenizer.stop_ids == {151643, 151645}
    assert qwen_tokenizer.token_type(151644) == TOKEN_CONTROL
    assert qwen_tokenizer.piece_to_id("<|im_end|>") == 151645
    assert qwen_tokenizer.id_to_piece(151668) == "</think>"
    assert qwen_tokenizer.piece_to_id("Hello") == 9707
    assert qwen_tokenizer.id_to_piece(220) == "Ġ"  # byte-level form of a space
    assert qwen_tokenizer.piece_to_id("no such piece") is None


def test_end_of_turn_token_not_marked_control_becomes_control(smollm_metadata):
    types = list(smollm_metadata["tokenizer.ggml.token_type"])
    types[2] = 1  # <|im_end|> as a normal token: a converter bug llama.cpp also corrects
    tokenizer = Tokenizer.from_gguf_metadata(_with(smollm_metadata, token_type=types))
    assert 2 in tokenizer.stop_ids and 2 in tokenizer.special_ids
    assert tokenizer.encode("<|im_end|>") == [2]


def test_eot_id_joins_stop_ids(smollm_metadata):
    tokenizer = Tokenizer.from_gguf_metadata(_with(smollm_metadata, eot_token_id=5))
    assert 5 in tokenizer.stop_ids


# --- BOS / EOS rules ------------------------------------------------------------------------

def test_add_bos_and_eos_follow_the_flags(smollm_metadata):
    tokenizer = Tokenizer.from_gguf_metadata(_with(smollm_metadata, add_bos_token=True,
                                                   add_eos_token=True))
    ids = tokenizer.encode("hi")
    assert ids[0] == 1 and ids[-1] == 2 and len(ids) == 3
    assert tokenizer.encode("hi", add_special=False) == ids[1:-1]
    assert tokenizer.encode("", add_special=True) == [1, 2]


def test_add_bos_defaults_per_pre_tokenizer(smollm_metadata):
    # llama-bpe vocabularies add BOS unless the file says otherwise; gpt2-style ones do not.
    llama3 = Tokenizer.from_gguf_metadata(_with(smollm_metadata, pre="llama-bpe", add_bos_token=None))
    assert llama3.add_bos and llama3.encode("hi")[0] == 1
    gpt2 = Tokenizer.from_gguf_metadata(_with(smollm_metadata, pre="gpt-2", add_bos_token=None))
    assert not gpt2.add_bos


# --- spec round trip ------------------------------------------------------------------------

@pytest.mark.parametrize("vocab", VOCABS)
def test_spec_round_trips_through_msgpack(vocab, parity, tokenizers):
    tokenizer = tokenizers[vocab]
    wire = msgpack.packb(tokenizer.spec_map(), use_bin_type=True)
    assert len(wire) < 5_000_000  # ~3.4 MB for Qwen's 151k tokens and merges
    rebuilt = Tokenizer.from_spec(msgpack.unpackb(wire, raw=False))
    assert rebuilt.stop_ids == tokenizer.stop_ids and rebuilt.special_ids == tokenizer.special_ids
    assert (rebuilt.bos_id, rebuilt.eos_id, rebuilt.add_bos) == \
        (tokenizer.bos_id, tokenizer.eos_id, tokenizer.add_bos)
    for text in parity["corpus"]:
        for parse_special in (True, False):
            assert rebuilt.encode(text, parse_special=parse_special) == \
                tokenizer.encode(text, parse_special=parse_special)


def test_spec_of_another_format_is_refused(smollm_tokenizer):
    spec = dict(smollm_tokenizer.spec_map(), format=99)
    with pytest.raises(TokenizerError, match="format 99"):
        Tokenizer.from_spec(spec)


def _spec(tokens: list[str], **fields: Any) -> TokenizerSpec:
    return TokenizerSpec.of_tokens(tokens, **{
        "model": "llama", "token_types": bytes([1] * len(tokens)), "bos_id": None, "eos_id": None, "add_bos": False,
        "add_eos": False, "scores": bytes(4 * len(tokens)), "add_space_prefix": True, **fields})


@pytest.mark.parametrize(("damage", "message"), [
    ({"piece_ends": b"\x01\x00\x00"}, "do not match their offsets"),
    ({"pieces": b"ab!"}, "do not match their offsets"),
    ({"pieces": b"\xffb"}, "not UTF-8"),
])
def test_a_spec_whose_pieces_do_not_read_is_refused(damage, message):
    with pytest.raises(TokenizerError, match=message):
        Tokenizer.from_spec({**dataclasses.asdict(_spec(["a", "b"])), **damage})


def test_the_vocabulary_is_held_as_one_blob_and_looked_up_by_hash(tokenizers):
    """No string object per token: the pieces stay in the spec's blob, ids are found through
    the sorted hash keys, and every id's piece finds it again (the first of equal pieces)."""
    tokenizer = tokenizers["gemma3"]
    spec = tokenizer.to_spec()
    tokens = spec.tokens()
    first: dict[str, int] = {}
    for index, piece in enumerate(tokens):
        first.setdefault(piece, index)
    assert all(tokenizer.id_to_piece(i) == piece for i, piece in enumerate(tokens))
    index = tokenizer.piece_index  # an encoder's, made on first use
    assert all(index.get(piece) == at for piece, at in first.items())
    assert index.get("no such piece \u2581\u2581") is None
    assert len(index.keys) == spec.vocab_size and index.keys.itemsize == 8
    # equal pieces and pieces beyond the BMP travel and are found
    odd = ["x", "\U0001f30d", "\u00e9", "x", "\u2581a"]
    rebuilt = Tokenizer.from_spec(msgpack.unpackb(msgpack.packb(dataclasses.asdict(_spec(odd))), raw=False))
    assert [rebuilt.id_to_piece(i) for i in range(5)] == odd
    assert [rebuilt.piece_to_id(piece) for piece in odd] == [0, 1, 2, 0, 4]


def test_a_tokenizer_that_only_decodes_finds_pieces_without_an_index(tokenizers):
    """A worker's tokenizer never encodes: ``piece_to_id`` finds a piece in the blob, with the
    index's answers (the first of equal pieces), and its 3 MB index is never made."""
    spec = tokenizers["gemma3"].to_spec()
    decoder = Tokenizer.from_spec(spec)
    index = PieceIndex(spec)
    tokens = spec.tokens()
    sample = tokens[:300] + tokens[1000::4999] + ["<start_of_turn>", "<end_of_turn>", "a", "\n", "no such piece"]
    assert [decoder.piece_to_id(piece) for piece in sample] == [index.get(piece) for piece in sample]
    assert not decoder.has_encoder and not decoder.has_piece_index
    odd = Tokenizer.from_spec(_spec(["x", "\U0001f30d", "\u00e9", "x", "\u2581a"]))
    assert [odd.piece_to_id(piece) for piece in ("x", "\U0001f30d", "\u00e9", "\u2581a", "y")] == [0, 1, 2, 4, None]
    assert not odd.has_piece_index


def test_the_hash_keys_are_those_of_unsigned_64_bit_words():
    """PieceIndex sorts plain integers; the keys are what numpy makes of the same hashes taken
    as unsigned 64-bit words (negative hashes included), in the same order."""
    import numpy as np

    tokens = [f"piece{i}" for i in range(3000)] + ["", "\u00e9", "\U0001f30d", "piece7"]
    index = PieceIndex(_spec(tokens))
    hashes = np.array([hash(t) for t in tokens], dtype=np.int64).view(np.uint64)
    assert (hashes >> np.uint64(63)).any(), "some hashes are negative"
    expected = np.sort((hashes & np.uint64(index.high)) | np.arange(len(tokens), dtype=np.uint64))
    assert index.keys.tolist() == expected.tolist()


def test_ids_of_types_finds_every_id_of_the_kinds_asked():
    import random

    from shared.tokenizer import ids_of_types
    rng = random.Random(3)
    types = bytes(rng.choice([1, 1, 1, 2, 3, 4, 5, 6]) for _ in range(20000))
    for kinds in ((3,), (3, 4), (1,), (6, 2)):
        assert ids_of_types(types, kinds) == [i for i, kind in enumerate(types) if kind in kinds]
    assert ids_of_types(b"", (3,)) == [] and ids_of_types(bytes([93, 92, 45]), (92, 93)) == [0, 1]


# A gateway's process: the card's tokenizer rebuilt, an encoder and a decoder used, and numpy
# (15 MiB of a gateway's memory) never imported.
GATEWAY_SIDE = r"""
import sys
import msgpack
import gateway.main  # what a gateway imports
from shared.tokenizer import Tokenizer
with open(sys.argv[1], "rb") as fh:
    spec = msgpack.unpackb(fh.read(), raw=False)
tokenizer = Tokenizer.from_spec(spec, encoder=True)
ids = tokenizer.encode("Hello there, how are you doing today?", add_special=False)
print(tokenizer.decode(ids))
print("numpy" in sys.modules)
"""


@pytest.mark.parametrize("vocab", ["smollm2", "qwen3", "gemma3"])
def test_a_gateway_builds_its_tokenizer_without_numpy(vocab, tokenizers, tmp_path):
    import subprocess
    import sys

    spec = tmp_path / "spec.msgpack"
    spec.write_bytes(msgpack.packb(tokenizers[vocab].spec_map(), use_bin_type=True))
    done = subprocess.run([sys.executable, "-c", GATEWAY_SIDE, str(spec)], capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr
    decoded, numpy_loaded = done.stdout.splitlines()[-2:]
    assert decoded.strip() == "Hello there, how are you doing today?"
    assert numpy_loaded == "False"


def test_packed_strings_read_as_the_list_they_hold():
    tokens = ["a", "", "\u00e9t\u00e9", "\U0001f30d"]
    spec = _spec(tokens)
    packed = PackedStrings(spec.pieces, spec.piece_offsets())
    assert packed == tokens and list(packed) == tokens and len(packed) == 4
    assert packed[-1] == tokens[-1] and packed[1:3] == tokens[1:3]
    with pytest.raises(IndexError):
        packed[4]


# --- pre-tokenizers and errors ----------------------------------------------------------------

@pytest.mark.parametrize("pre", sorted(PRE_NAMES))
def test_every_known_pre_tokenizer_builds_and_round_trips(pre, smollm_metadata, parity):
    tokenizer = Tokenizer.from_gguf_metadata(_with(smollm_metadata, pre=pre))
    for text in parity["corpus"]:
        assert tokenizer.decode(tokenizer.encode(text, add_special=False)) == text


@pytest.mark.parametrize(("damage", "message"), [
    ({"merges": None}, "lacks merges"), ({"pre": "martian"}, "'martian'"), ({"model": "mamba"}, "'mamba'"), ({"model": "llama"}, "one score per token")])
def test_a_received_spec_is_checked_by_its_kind_of_vocabulary(smollm_tokenizer, damage, message):
    """The kind named by ``model`` checks its own entries (byte-level BPE: merges and pre;
    SentencePiece: scores)."""
    with pytest.raises(TokenizerError, match=message):
        Tokenizer.from_spec({**smollm_tokenizer.spec_map(), **damage})


def test_unknown_tokenizer_model_is_a_clear_error(smollm_metadata):
    with pytest.raises(TokenizerError) as info:
        Tokenizer.from_gguf_metadata(_with(smollm_metadata, model="rwkv"))
    assert "'rwkv'" in info.value.message and "gpt2" in info.value.message


def test_unknown_pre_tokenizer_is_a_clear_error(smollm_metadata):
    with pytest.raises(TokenizerError) as info:
        Tokenizer.from_gguf_metadata(_with(smollm_metadata, pre="martian"))
    assert "'martian'" in info.value.message and "qwen2" in info.value.message


def test_missing_pre_tokenizer_falls_back_to_default_with_a_warning(smollm_metadata, caplog):
    with caplog.at_level(logging.WARNING, logger="shared.tokenizer"):
        tokenizer = Tokenizer.from_gguf_metadata(_with(smollm_metadata, pre=None))
    assert tokenizer.pre == "default"
    assert "tokenizer.ggml.pre" in caplog.text


def test_missing_vocabulary_is_a_clear_error(smollm_metadata):
    with pytest.raises(TokenizerError, match="tokenizer.ggml.merges"):
        Tokenizer.from_gguf_metadata(_with(smollm_metadata, merges=None))


def test_inconsistent_merges_are_a_clear_error(smollm_metadata):
    with pytest.raises(TokenizerError, match="merges"):
        Tokenizer.from_gguf_metadata(_with(smollm_metadata, merges=["notatoken Ġt"]))


@pytest.mark.parametrize("merge", ["notatoken Ġt", "Ġt Ġt"])  # a part, then only the union, not in the vocabulary
def test_a_gateway_building_its_encoder_refuses_inconsistent_merges_too(smollm_metadata, merge):
    """A gateway builds its encoder with the tokenizer and leaves the merges' check to it."""
    spec = Tokenizer.from_gguf_metadata(smollm_metadata).to_spec()
    assert "ĠtĠt" not in spec.tokens()
    spec.merges = [*spec.merges, merge]
    for encoder in (False, True):
        with pytest.raises(TokenizerError, match="merges are inconsistent"):
            Tokenizer.from_spec(spec, encoder=encoder)


def test_merges_that_passed_once_leave_a_mark_that_only_the_same_vocabulary_finds(smollm_metadata, tmp_path,
                                                                                   monkeypatch):
    """A worker's later start skips the merges' check: the first leaves a mark named by the
    pieces and merges, the second finds it and checks nothing; a vocabulary whose merges differ
    by one line (or by where a line breaks), or that fails, finds none and leaves none."""
    monkeypatch.setenv("LMSERVE_CACHE", str(tmp_path))
    spec = Tokenizer.from_gguf_metadata(smollm_metadata).to_spec()
    mark = tokenizer_module.checked_mark(spec)
    assert mark.exists() and mark.parent == tmp_path / "vocabularies"

    def no_check(_spec):
        raise AssertionError("checked again")
    monkeypatch.setattr(tokenizer_module, "_merges_name_pieces", no_check)
    Tokenizer.from_spec(spec)  # the mark spares the check
    moved = dataclasses.replace(spec, merges=[spec.merges[0] + spec.merges[1], *spec.merges[2:]])
    fewer = dataclasses.replace(spec, merges=spec.merges[:-1])
    assert len({mark, tokenizer_module.checked_mark(moved), tokenizer_module.checked_mark(fewer)}) == 3
    with pytest.raises(AssertionError, match="checked again"):
        Tokenizer.from_spec(fewer)
    monkeypatch.undo()
    monkeypatch.setenv("LMSERVE_CACHE", str(tmp_path))
    broken = dataclasses.replace(spec, merges=[*spec.merges, "notatoken Ġt"])
    with pytest.raises(TokenizerError, match="merges are inconsistent"):
        Tokenizer.from_spec(broken)
    assert not tokenizer_module.checked_mark(broken).exists()
    Tokenizer.from_spec(fewer)
    assert tokenizer_module.checked_mark(fewer).exists()


def test_add_bos_without_bos_id_is_refused(smollm_metadata):
    meta = _with(smollm_metadata, add_bos_token=True, bos_token_id=None)
    with pytest.raises(TokenizerError, match="BOS"):
        Tokenizer.from_gguf_metadata(meta)


def test_a_continuation_takes_no_leading_space(gemma3_model):
    """SentencePiece adds its leading space at the start of a text and after a control token,
    not where a prompt's text resumes after a piece tokenized apart (gateway/prompting.py)."""
    from worker.engine.gguf_file import GGUFFile

    meta = {**GGUFFile(gemma3_model).metadata, "tokenizer.ggml.add_space_prefix": True}  # as Llama 2's files
    tokenizer = Tokenizer.from_gguf_metadata(meta)
    start = tokenizer.encode("x now", add_special=False)
    resumed = tokenizer.encode("x now", add_special=False, continuation=True)
    assert tokenizer.id_to_piece(start[0]).startswith("\u2581") and resumed[0] != start[0]
    assert tokenizer.decode(resumed) == "x now" and tokenizer.decode(start) == " x now"


def test_fill_in_the_middle_tokens_from_the_keys_or_the_texts(qwen_metadata, smollm_tokenizer):
    by_text = Tokenizer.from_gguf_metadata(qwen_metadata)
    assert [by_text.id_to_piece(i) for i in by_text.fim_ids] == ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"]
    keyed = Tokenizer.from_gguf_metadata({**qwen_metadata, "tokenizer.ggml.fim_pre_token_id": 10,
                                          "tokenizer.ggml.fim_suf_token_id": 11, "tokenizer.ggml.fim_mid_token_id": 12})
    assert keyed.fim_ids == (10, 11, 12)
    # the keys win only all together; and a vocabulary without the tokens has none
    partial = Tokenizer.from_gguf_metadata({**qwen_metadata, "tokenizer.ggml.fim_pre_token_id": 10})
    assert partial.fim_ids == by_text.fim_ids
    assert smollm_tokenizer.fim_ids is None
    # the ids travel with the spec a worker sends its gateways
    assert Tokenizer.from_spec(msgpack.unpackb(msgpack.packb(keyed.spec_map()))).fim_ids == (10, 11, 12)


def test_sentencepiece_without_merges_equals_the_bpe_of_every_split(tokenizers):
    """The SentencePiece encoder that ranks a pair by its union's score (no table of merges)
    against a Hugging Face BPE whose merges are every split of every piece ranked the same way,
    on text of every kind: prose, code, whitespace runs, scripts without pieces, emoji, and
    control tokens with and without parsing."""
    import random

    from shared.tokenizer import AddedTexts, SentencePieceBPE, SentencePieceEncoder, with_added

    tokenizer = tokenizers["gemma3"]
    rng = random.Random(0)
    text = (Path(__file__).read_text() + Path(__file__).parents[2].joinpath("README.md").read_text())
    samples = [text[at:at + rng.randint(1, 300)] for at in (rng.randrange(len(text)) for _ in range(600))]
    alphabet = ([chr(c) for c in range(32, 127)] + [chr(c) for c in range(0x400, 0x450)] + ["\n", "\t", "  "]
                + [chr(c) for c in range(0x4e00, 0x4e40)] + [chr(c) for c in range(0x1f600, 0x1f610)])
    samples += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 80))) for _ in range(400)]
    samples += ["<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n", "a<unused0>b  c", "\n\n\n"]
    index = tokenizer.piece_index
    for prefix, match_special in ((False, True), (True, True), (True, False)):  # Gemma's rule, then Llama 2's
        spec = dataclasses.replace(tokenizer.to_spec(), add_space_prefix=prefix)
        added = AddedTexts(tuple(tokenizer.id_to_piece(i) for i in sorted(tokenizer.special_ids)),
                           tuple(tokenizer.id_to_piece(i) for i in sorted(tokenizer.user_defined_ids)), match_special)
        ours = SentencePieceEncoder(spec, index, prefix, added)
        reference = with_added(SentencePieceBPE.encoder(spec, True), added)
        for sample in samples:
            assert ours(sample) == reference(sample), sample


def test_a_conversations_earlier_messages_are_encoded_once(tokenizers, monkeypatch):
    """SentencePiece's pieces (the texts between added tokens: for Gemma, mostly lines) encode
    on their own, so one encoded lately is taken from the encoder's recent pieces: a next turn
    that repeats the conversation encodes only what is new, and its ids are those of an
    encoder that remembers nothing (the BPE of every split)."""
    from shared.tokenizer import AddedTexts, RecentPieces, SentencePieceBPE, SentencePieceEncoder, with_added

    tokenizer = tokenizers["gemma3"]
    spec = tokenizer.to_spec()
    added = AddedTexts(tuple(tokenizer.id_to_piece(i) for i in sorted(tokenizer.special_ids)),
                       tuple(tokenizer.id_to_piece(i) for i in sorted(tokenizer.user_defined_ids)), True)
    ours = SentencePieceEncoder(spec, tokenizer.piece_index, bool(spec.add_space_prefix), added)  # Gemma: none
    reference = with_added(SentencePieceBPE.encoder(spec, True), added)
    encoded: list[str] = []
    piece = ours.encode_piece
    monkeypatch.setattr(ours, "encode_piece", lambda text: encoded.append(text) or piece(text))

    def long_pieces_encoded(text: str) -> set[str]:
        encoded.clear()
        assert ours(text) == reference(text)
        return {t for t in encoded if len(t) >= RecentPieces.SHORTEST}

    readme = Path(__file__).parents[2].joinpath("README.md").read_text()
    first, reply = readme[:6000], readme[6000:7500]
    turn = f"<start_of_turn>user\n{first}<end_of_turn>\n<start_of_turn>model\n"
    earlier = long_pieces_encoded(turn)
    assert len(earlier) > 20 and len(ours.recent) == len(earlier)
    again = turn + f"{reply}<end_of_turn>\n<start_of_turn>user\nAnd the rest of it, please?<end_of_turn>\n"
    new = long_pieces_encoded(again)
    assert new and not new & earlier and all(t in reply or t in "And the rest of it, please?" for t in new)
    assert not long_pieces_encoded(again)  # every long piece of it came from the recent pieces


def test_recent_pieces_forget_the_least_recently_used_past_their_budget():
    from array import array

    from shared.tokenizer import RecentPieces

    recent = RecentPieces(budget=1000)
    a, b, c = "a" * 400, "b" * 400, "c" * 400
    recent.put(a, array("I", [1]))
    recent.put(b, array("I", [2]))
    assert list(recent.get(a)) == [1]  # a is now the latest used
    recent.put(c, array("I", [3]))
    assert recent.get(b) is None and list(recent.get(a)) == [1] and list(recent.get(c)) == [3]
    assert recent.chars == 800 <= recent.budget
    recent.put("d" * 1001, array("I", [4]))  # longer than the whole budget: not kept
    assert recent.get("d" * 1001) is None and len(recent) == 2
    recent.put(a, array("I", [9]))  # already held: kept as it was, counted once
    assert list(recent.get(a)) == [1] and recent.chars == 800
