"""The wire's typed messages: each survives its frames unchanged, and a GENERATE no request may
send is refused with its request id, so the worker can answer it."""

from __future__ import annotations

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
    ({"sampling": {"temperature": "hot"}}, "could not be admitted"),
    ({"sampling": [1]}, "sampling must be a map"),
    ({"grammar": {"kind": "regex"}}, "grammar must be a map with kind and source"),
])
def test_an_impossible_generate_is_refused_with_its_request_id(body, words):
    with pytest.raises(InvalidGenerate) as refused:
        decode([b"G", msgpack.packb({"request_id": "r9", **body}), PROMPT_FRAME])
    assert refused.value.request_id == "r9" and words in refused.value.message


def test_an_unknown_finish_reason_does_not_parse():
    with pytest.raises(ProtocolError):
        decode([b"F", msgpack.packb({"request_id": "r1", "reason": "tired"})])
