"""The wire's typed messages: each survives its frames unchanged, and a GENERATE no request may
send is refused with its request id, so the worker can answer it."""

from __future__ import annotations

import dataclasses
import re

import msgpack
import numpy as np
import pytest

from shared.protocol import (
    MESSAGE_CLASSES,
    PROTOCOL_VERSION,
    Abort,
    Accepted,
    Busy,
    Capabilities,
    Embed,
    Embeddings,
    Finished,
    FinishReason,
    Generate,
    Grammar,
    GrammarKind,
    Heartbeat,
    Hello,
    InvalidEmbed,
    InvalidGenerate,
    ModelCard,
    ModelFacts,
    PromptLogprob,
    ProtocolError,
    Rejected,
    Tags,
    Tokens,
    TopLogprob,
    decode,
)
from shared.sampling_params import SamplingDefaults, SamplingParams
from shared.tokenizer import Tokenizer
from shared.tokenizer_spec import TokenizerSpec

PROMPT_FRAME = np.array([1, 2], dtype="<i4").tobytes()
SPEC = TokenizerSpec.of_tokens(["a", "b", "ab"], model="gpt2", token_types=bytes([1, 1, 1]), bos_id=None,
                               eos_id=None, add_bos=False, add_eos=False, pre="gpt2",
                               merges=["a b"])
CARD = ModelCard(PROTOCOL_VERSION, "m", "llama", 512, 3, SPEC, None, "fp", Capabilities(
    1024, Tags("<think>", "</think>"), reasoning=True, tool_call_tags=Tags("<tool_call>", "</tool_call>")))
TOKENS = Tokens("r1", [7, 8], [-0.25, -1.5], [[TopLogprob(7, -0.25), TopLogprob(3, -2.0)], [TopLogprob(8, -1.5)]],
                4, [PromptLogprob(None, []), PromptLogprob(-3.5, [TopLogprob(2, -0.5)])])


@pytest.mark.parametrize("message", [
    Hello(PROTOCOL_VERSION, "host:1"),
    CARD,
    Generate("r1", [1, 2, 3], SamplingParams(temperature=0.5, seed=7, logit_bias={5: -1.5}), 9,
             grammar=Grammar("regex", "[a-z]+"), grammar_after_reasoning=True),
    Generate("r2", [1], reasoning_budget=16),  # a reply that thinks for 16 tokens at most
    dataclasses.replace(CARD, sampling=SamplingDefaults(temperature=0.6, top_k=20)),  # the file's recommendation
    Accepted("r1", 2, ["doc"]),
    Busy("r1", 0.5, "full"),
    Rejected("r1", 413, "too_long", "long"),
    TOKENS,
    Finished("r1", FinishReason.LENGTH, 3, 1, 9),
    Abort("r1"),
    Heartbeat(1.5, "abc", 1, 2, 3, [b"\x01" * 8]),
    Embed("r1", [[1, 2, 3], [7]]),
    Embeddings("r1", [[0.5, -1.25, 3.0], [0.0, 2.0, -0.125]], 4),
], ids=lambda message: type(message).__name__)
def test_a_message_survives_its_frames(message):
    assert decode(message.frames()) == message


def test_logprobs_and_grammar_kinds_travel_as_plain_values():
    """The typed entries keep the wire as compact as lists and strings: a TopLogprob is [id,
    logprob], a PromptLogprob [logprob, alternatives], a GrammarKind its name."""
    body = msgpack.unpackb(TOKENS.frames()[1])
    assert body["top_logprobs"] == [[[7, -0.25], [3, -2.0]], [[8, -1.5]]]
    assert body["prompt_logprobs"] == [[None, []], [-3.5, [[2, -0.5]]]]
    generate = Generate("r1", [1], grammar=Grammar("json_object", ""))
    assert msgpack.unpackb(generate.frames()[1])["grammar"] == {"kind": "json_object", "source": ""}
    decoded = decode(generate.frames())
    assert decoded.grammar.kind is GrammarKind.JSON_OBJECT
    scored = decode(TOKENS.frames())
    assert scored.top_logprobs[0][1].token_id == 3 and scored.prompt_logprobs[1].top[0].logprob == -0.5


def test_a_grammar_takes_only_a_kind_the_worker_compiles():
    assert Grammar("lark", "start: x").kind is GrammarKind.LARK
    with pytest.raises(ValueError):
        Grammar("cobol", "")


def test_the_card_carries_the_model_facts():
    facts = ModelFacts("gguf", "Q4_K_M", 4.89, 1 << 20, 135_000_000, "135M", "HuggingFaceTB", 576)
    card = decode(ModelCard(**{**CARD.__dict__, "facts": facts}).frames())
    assert card.facts == facts and decode(CARD.frames()).facts == ModelFacts()


def test_embed_inputs_and_vectors_travel_as_raw_frames():
    """The ids of every input in one int32 frame, the vectors in one float32 frame; the bodies
    carry only the lengths and the shape."""
    embed = Embed("r1", [[1, 2, 3], [7]])
    frames = embed.frames()
    assert msgpack.unpackb(frames[1]) == {"request_id": "r1", "lengths": [3, 1]}
    assert frames[2] == np.array([1, 2, 3, 7], dtype="<i4").tobytes()
    vectors = Embeddings("r1", [[0.5, -1.25], [2.0, 3.0]], 4).frames()
    assert msgpack.unpackb(vectors[1]) == {"request_id": "r1", "prompt_tokens": 4, "count": 2, "width": 2}
    assert vectors[2] == np.array([0.5, -1.25, 2.0, 3.0], dtype="<f4").tobytes()


@pytest.mark.parametrize("frames, words", [
    ([b"E", msgpack.packb({"request_id": "r9", "lengths": [2]}), PROMPT_FRAME[:4]], "one int32 frame"),
    ([b"E", msgpack.packb({"request_id": "r9", "lengths": [0, 2]}), PROMPT_FRAME], "at least one id each"),
    ([b"E", msgpack.packb({"request_id": "r9", "lengths": [2]})], "one int32 frame"),
    ([b"E", msgpack.packb({"request_id": "r9", "lengths": "2"}), PROMPT_FRAME], "lengths must be a list"),
    ([b"E", msgpack.packb({"request_id": "r9"}), PROMPT_FRAME], "lengths must be a list, not nil"),
])
def test_a_malformed_embed_is_refused_with_its_request_id(frames, words):
    with pytest.raises(InvalidEmbed, match=re.escape(words)) as refused:
        decode(frames)
    assert refused.value.request_id == "r9"


def test_the_card_carries_a_tokenizer_spec_the_gateway_rebuilds():
    card = decode(CARD.frames())
    assert isinstance(card.tokenizer, TokenizerSpec) and card.tokenizer == SPEC
    assert Tokenizer.from_spec(card.tokenizer).encode("ab", add_special=False) == [2]


@pytest.mark.parametrize("body, words", [
    ({"sampling": {"temperature": -1}}, "temperature"),
    ({"sampling": {"temperature": "hot"}}, "sampling.temperature must be a number, not a string"),
    ({"sampling": [1]}, "sampling must be a map, not a list"),
    ({"grammar": {"kind": "regex"}}, "grammar.source is missing"),
    ({"grammar": {"kind": "cobol", "source": ""}}, "grammar.kind must be one of 'json_schema', 'json_object'"),
    ({"grammar": {"kind": 1, "source": ""}}, "grammar.kind must be one of"),
    ({"grammar": "regex"}, "grammar must be a map or nil, not a string"),
    ({"prompt_logprobs": None}, "prompt_logprobs must be an integer, not nil"),
    ({"max_tokens": "many"}, "max_tokens must be an integer, not a string"),
    ({"max_tokens": 2.5}, "max_tokens must be an integer, not a number"),
    ({"stop_ids": [1, "x"]}, "stop_ids[1] must be an integer, not a string"),
    ({"stop_ids": {"a": 1}}, "stop_ids must be a list or nil, not a map"),
    ({"grammar_after_reasoning": 1}, "grammar_after_reasoning must be true or false, not an integer"),
    ({"cartridge_ids": "doc"}, "cartridge_ids must be a list, not a string"),
    ({"sampling": {"logit_bias": [[5, "up"]]}}, "sampling.logit_bias[0][1] must be a number, not a string"),
    ({"sampling": {"seed": True}}, "sampling.seed must be an integer or nil, not a boolean"),
])
def test_an_impossible_generate_is_refused_with_its_request_id(body, words):
    with pytest.raises(InvalidGenerate) as refused:
        decode([b"G", msgpack.packb({"request_id": "r9", **body}), PROMPT_FRAME])
    assert refused.value.request_id == "r9" and words in refused.value.message


@pytest.mark.parametrize("body, words", [
    ({"request_id": {"a": 1}}, "request_id must be a string, not a map"),
    ({"request_id": 7}, "request_id must be a string, not an integer"),
    ({}, "request_id is missing"),
])
def test_a_generate_without_a_usable_request_id_is_refused_under_an_empty_one(body, words):
    with pytest.raises(InvalidGenerate) as refused:
        decode([b"G", msgpack.packb(body), PROMPT_FRAME])
    assert refused.value.request_id == "" and refused.value.message == words


def test_a_generate_without_its_prompt_frame_is_refused_with_its_request_id():
    with pytest.raises(InvalidGenerate) as refused:
        decode([b"G", msgpack.packb({"request_id": "r9"})])
    assert refused.value.request_id == "r9" and "prompt ids" in refused.value.message


def card_with(**fields) -> list[bytes]:
    return [b"C", msgpack.packb({**CARD.body(), **fields}, use_bin_type=True)]


def spec_with(**fields) -> dict:
    return {**CARD.body()["tokenizer"], **fields}


# per message type: a field of the wrong type, a field missing, a value outside an enum
MALFORMED = [
    ([b"H", msgpack.packb({"version": "3"})], "version must be an integer, not a string"),
    ([b"H", msgpack.packb({"version": 3, "gateway": None})], "gateway must be a string, not nil"),
    (card_with(context_budget=None), "context_budget must be an integer, not nil"),
    (card_with(capabilities={"context_length": 1024}), "capabilities.reasoning_tags is missing"),
    (card_with(tokenizer=[]), "tokenizer must be a map, not a list"),
    (card_with(tokenizer=spec_with(token_types=[1, 1, 1])), "tokenizer.token_types must be bytes, not a list"),
    (card_with(tokenizer=spec_with(pieces=["a", "b", "ab"])), "tokenizer.pieces must be bytes, not a list"),
    (card_with(tokenizer=spec_with(merges="a b")), "tokenizer.merges must be a list or nil, not a string"),
    (card_with(tokenizer={k: v for k, v in spec_with().items() if k != "bos_id"}), "tokenizer.bos_id is missing"),
    ([b"A", msgpack.packb({"request_id": "r1", "queue_position": "2"})],
     "queue_position must be an integer, not a string"),
    ([b"A", msgpack.packb({"request_id": "r1", "cartridges": [b"doc"]})], "cartridges[0] must be a string, not bytes"),
    ([b"B", msgpack.packb({"request_id": "r1", "retry_after": "soon"})], "retry_after must be a number, not a string"),
    ([b"B", msgpack.packb({})], "request_id is missing"),
    ([b"R", msgpack.packb({"request_id": "r1", "status": 4.5})], "status must be an integer, not a number"),
    ([b"R", msgpack.packb({"request_id": "r1", "message": ["why"]})], "message must be a string, not a list"),
    ([b"T", msgpack.packb({"request_id": "r1", "ids": [1, None]})], "ids[1] must be an integer, not nil"),
    ([b"T", msgpack.packb({"request_id": "r1", "logprobs": ["x"]})], "logprobs[0] must be a number, not a string"),
    ([b"T", msgpack.packb({"request_id": "r1", "top_logprobs": [[[1, -0.5, 9]]]})],
     "top_logprobs[0][0] must be a list of 2, not of 3"),
    ([b"T", msgpack.packb({"request_id": "r1", "top_logprobs": [[["a", -0.5]]]})],
     "top_logprobs[0][0][0] must be an integer, not a string"),
    ([b"T", msgpack.packb({"request_id": "r1", "top_logprobs": [[{"token_id": 1, "logprob": 0}]]})],
     "top_logprobs[0][0] must be a list, not a map"),
    ([b"T", msgpack.packb({"request_id": "r1", "prompt_logprobs": [["-1", []]]})],
     "prompt_logprobs[0][0] must be a number or nil, not a string"),
    ([b"T", msgpack.packb({"request_id": "r1", "prompt_logprobs": [[-1.0, [[1, None]]]]})],
     "prompt_logprobs[0][1][0][1] must be a number, not nil"),
    ([b"F", msgpack.packb({"request_id": "r1"})], "reason is missing"),
    ([b"F", msgpack.packb({"request_id": "r1", "reason": "tired"})], "reason must be one of 'stop', 'length'"),
    ([b"F", msgpack.packb({"request_id": "r1", "reason": "stop", "error": 5})], "error must be a string or nil"),
    ([b"X", msgpack.packb({"request_id": ["r1"]})], "request_id must be a string, not a list"),
    ([b"X", msgpack.packb({})], "request_id is missing"),
    ([b"P", msgpack.packb({"sent_at": "now"})], "sent_at must be a number, not a string"),
    ([b"P", msgpack.packb({"prefixes": ["text"]})], "prefixes[0] must be bytes, not a string"),
    ([b"P", msgpack.packb({"waiting": True})], "waiting must be an integer, not a boolean"),
    ([b"E", msgpack.packb({"request_id": "r1", "lengths": [1, "2"]}), PROMPT_FRAME],
     "lengths[1] must be an integer, not a string"),
    ([b"V", msgpack.packb({"request_id": "r1", "count": "1", "width": 1}), b"\0" * 4],
     "count must be an integer, not a string"),
    ([b"V", msgpack.packb({"request_id": "r1", "count": 2, "width": 3}), b"\0" * 4],
     "EMBEDDINGS needs one float32 frame of 2 x 3 values"),
    ([b"V", msgpack.packb({"count": 0, "width": 0}), b""], "request_id is missing"),
    (card_with(facts={"quantization": 4}), "facts.quantization must be a string, not an integer"),
]


@pytest.mark.parametrize("frames, words", MALFORMED, ids=lambda value: value[0].decode() if isinstance(value, list)
                         else None)
def test_every_message_is_type_checked_on_decode(frames, words):
    with pytest.raises(ProtocolError, match=re.escape(words)):
        decode(frames)


def test_every_type_is_among_the_malformed_cases():
    assert {frames[0] for frames, _ in MALFORMED} | {b"G"} == set(MESSAGE_CLASSES)


@pytest.mark.parametrize("kind", sorted(MESSAGE_CLASSES))
@pytest.mark.parametrize("body, words", [
    (msgpack.packb([1, 2]), "body must be a map"), (msgpack.packb("text"), "body must be a map"),
    (msgpack.packb(None), "body must be a map"), (b"\xc1", "not valid msgpack"), (b"\x92\x01", "not valid msgpack"),
])
def test_a_body_that_is_no_map_is_refused_for_every_type(kind, body, words):
    with pytest.raises(ProtocolError, match=words) as refused:
        decode([kind, body, PROMPT_FRAME])
    assert not isinstance(refused.value, InvalidGenerate)  # no request id to answer under


@pytest.mark.parametrize("frames, words", [
    ([b"Z", msgpack.packb({})], "unknown message type"),
    ([b"T"], "needs a type frame and a body"),
    ([], "needs a type frame and a body"),
])
def test_frames_of_no_message_are_refused(frames, words):
    with pytest.raises(ProtocolError, match=words):
        decode(frames)


def test_a_malformed_reply_names_its_request_when_it_can():
    """The gateway fails the request a broken reply was for, instead of waiting on it."""
    with pytest.raises(ProtocolError) as named:
        decode([b"T", msgpack.packb({"request_id": "r1", "ids": "many"})])
    assert named.value.request_id == "r1"
    with pytest.raises(ProtocolError) as unnamed:
        decode([b"T", msgpack.packb({"request_id": 1, "ids": []})])
    assert unnamed.value.request_id is None
