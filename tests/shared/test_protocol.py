"""The wire's typed messages: each survives its frames unchanged, and a GENERATE no request may
send is refused with its request id, so the worker can answer it."""

from __future__ import annotations

import re

import msgpack
import numpy as np
import pytest

from shared.protocol import (
    Capabilities,
    Finished,
    FinishReason,
    Generate,
    Grammar,
    InvalidGenerate,
    ModelCard,
    ProtocolError,
    Tags,
    decode,
)
from shared.sampling_params import SamplingParams

PROMPT_FRAME = np.array([1, 2], dtype="<i4").tobytes()


@pytest.mark.parametrize("message", [
    Generate("r1", [1, 2, 3], SamplingParams(temperature=0.5, seed=7, logit_bias={5: -1.5}), 9,
             grammar=Grammar("regex", "[a-z]+"), grammar_after_reasoning=True),
    Finished("r1", FinishReason.LENGTH, 3, 1, 9),
    ModelCard(2, "m", "llama", 512, 10, {}, None, "fp", Capabilities(
        1024, Tags("<think>", "</think>"), reasoning=True, tool_call_tags=Tags("<tool_call>", "</tool_call>"))),
])
def test_a_message_survives_its_frames(message):
    assert decode(message.frames()) == message


@pytest.mark.parametrize("body, words", [
    ({"sampling": {"temperature": -1}}, "temperature"),
    ({"sampling": {"temperature": "hot"}}, "sampling.temperature must be a number, not a string"),
    ({"sampling": [1]}, "sampling must be a map, not a list"),
    ({"grammar": {"kind": "regex"}}, "grammar.source is missing"),
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


def test_an_unknown_finish_reason_does_not_parse():
    with pytest.raises(ProtocolError):
        decode([b"F", msgpack.packb({"request_id": "r1", "reason": "tired"})])


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


@pytest.mark.parametrize("frames, words", [
    ([b"P", msgpack.packb({"sent_at": "now"})], "sent_at must be a number, not a string"),
    ([b"T", msgpack.packb({"request_id": "r1", "ids": [1, None]})], "ids[1] must be an integer, not nil"),
    ([b"X", msgpack.packb({"request_id": ["r1"]})], "request_id must be a string, not a list"),
    ([b"F", msgpack.packb({"request_id": "r1"})], "reason is missing"),
    ([b"C", msgpack.packb({**ModelCard(2, "m", "llama", 512, 10, {}, None, "fp", Capabilities(
        1024, Tags("<think>", "</think>"))).body(), "capabilities": {"context_length": 1024}})],
     "capabilities.reasoning_tags is missing"),
])
def test_every_message_is_type_checked_on_decode(frames, words):
    with pytest.raises(ProtocolError, match=re.escape(words)):
        decode(frames)
