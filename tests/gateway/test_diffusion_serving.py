"""A text-diffusion model (the tiny random diffusion-gemma, Gemma 4's vocabulary and template)
served through the real stack: each written block streams as deltas, which the three SDKs'
stream helpers put together into what a non-streamed reply says; stop sequences and max_tokens
hold; what it cannot do is refused in the caller's dialect."""

from __future__ import annotations

from typing import Any

import anthropic
import openai
import pytest
from tiny_models import write_tiny_gguf

MAX_TOKENS = 16  # two canvases of 8
HELLO = [{"role": "user", "content": "Write a line about the sea."}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory, start_worker, start_gateway):
    model = tmp_path_factory.mktemp("diffusion") / "tiny-diffusion-gemma.gguf"
    write_tiny_gguf(model, "diffusion-gemma", context_length=1024)
    worker = start_worker(model, "--ctx", "1024", "--batch", "2")
    return start_gateway(worker)


@pytest.fixture(scope="module")
def oai(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def claude(stack) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=stack.url, api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def reference(oai) -> Any:
    """The greedy reply, not streamed: what every stream must put together."""
    reply = oai.chat.completions.create(model="m", messages=HELLO, max_tokens=MAX_TOKENS, temperature=0)
    choice = reply.choices[0]
    assert choice.message.content
    assert (choice.finish_reason, reply.usage.completion_tokens) in (("length", MAX_TOKENS),) or \
        choice.finish_reason == "stop"
    return choice


def _stop_string(text: str) -> tuple[str, int]:
    """Three characters of the reply's second half that first occur there, and where."""
    for k in range(len(text) // 2, len(text) - 3):
        piece = text[k:k + 3]
        if not any(c.isspace() for c in piece) and text.find(piece) == k:
            return piece, k
    raise AssertionError(f"no stop string to choose in {text!r}")


def test_the_openai_chat_stream_helper_puts_the_blocks_together(oai, reference):
    # the helper refuses a reply cut by max_tokens (it parses the final message): a stop sequence
    # ends this one, in its second block
    stop, at = _stop_string(reference.message.content)
    deltas = []
    with oai.chat.completions.stream(model="m", messages=HELLO, max_tokens=MAX_TOKENS, temperature=0,
                                     stop=[stop]) as stream:
        for event in stream:
            if event.type == "content.delta":
                deltas.append(event.delta)
        final = stream.get_final_completion()
    assert "".join(deltas) == final.choices[0].message.content == reference.message.content[:at]
    assert final.choices[0].finish_reason == "stop"
    assert len(deltas) >= 2  # a block at a time: more than one delta, not one per reply


def test_the_responses_stream_helper_puts_the_blocks_together(oai, reference):
    deltas, ended = [], None
    with oai.responses.stream(model="m", input=HELLO, max_output_tokens=MAX_TOKENS, temperature=0) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
            elif event.type in ("response.completed", "response.incomplete"):
                ended = event.response
    assert "".join(deltas) == ended.output_text == reference.message.content
    if reference.finish_reason == "length":  # cut by max_output_tokens: incomplete, and why
        assert ended.status == "incomplete" and ended.incomplete_details.reason == "max_output_tokens"


def test_the_anthropic_stream_helper_puts_the_blocks_together(claude, reference):
    with claude.messages.stream(model="m", max_tokens=MAX_TOKENS, messages=HELLO,
                                extra_body={"temperature": 0}) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == reference.message.content
    expected = {"length": "max_tokens", "stop": "end_turn"}[reference.finish_reason]
    assert final.stop_reason == expected and final.usage.output_tokens <= MAX_TOKENS


def test_a_stop_sequence_ends_the_reply_in_every_dialect(oai, claude, reference):
    stop, at = _stop_string(reference.message.content)
    chat = oai.chat.completions.create(model="m", messages=HELLO, max_tokens=MAX_TOKENS, temperature=0, stop=[stop])
    assert chat.choices[0].message.content == reference.message.content[:at]
    assert chat.choices[0].finish_reason == "stop"
    with claude.messages.stream(model="m", max_tokens=MAX_TOKENS, messages=HELLO, stop_sequences=[stop],
                                extra_body={"temperature": 0}) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == reference.message.content[:at]
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop


def test_max_tokens_shorter_than_a_block_cuts_it(oai, reference):
    reply = oai.chat.completions.create(model="m", messages=HELLO, max_tokens=3, temperature=0)
    assert reply.usage.completion_tokens == 3 and reply.choices[0].finish_reason == "length"
    assert reference.message.content.startswith(reply.choices[0].message.content)


def test_constrained_output_is_refused_in_the_callers_dialect(oai, claude):
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    with pytest.raises(openai.BadRequestError) as refused:
        oai.chat.completions.create(model="m", messages=HELLO, max_tokens=8, response_format={
            "type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
    assert "text diffusion" in refused.value.message
    tool = {"name": "f", "description": "f", "input_schema": schema}
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude.messages.create(model="m", max_tokens=8, messages=HELLO, tools=[tool],
                               tool_choice={"type": "tool", "name": "f"})
    assert "text diffusion" in refused.value.message
