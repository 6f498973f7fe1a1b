"""Chat Completions through the real stack, driven by the official openai SDK."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

PARIS = [{"role": "user", "content": "Name the capital city of France."}]


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)


def test_non_streaming_answer_and_usage(client):
    reply = client.chat.completions.create(model="anything-goes", messages=PARIS, temperature=0, max_tokens=40)
    assert reply.model == "anything-goes"
    assert reply.object == "chat.completion"
    assert reply.id.startswith("chatcmpl-")
    choice = reply.choices[0]
    assert "Paris" in choice.message.content
    assert choice.finish_reason == "stop"
    usage = reply.usage
    assert usage.prompt_tokens > 20
    assert usage.completion_tokens >= 5
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens <= usage.prompt_tokens


def test_streaming_with_the_sdk_helper_and_usage(client):
    with client.chat.completions.stream(model="m", messages=PARIS, temperature=0, max_tokens=40,
                                        stream_options={"include_usage": True}) as stream:
        deltas = [event.delta for event in stream if event.type == "content.delta"]
        final = stream.get_final_completion()
    assert "".join(deltas) == final.choices[0].message.content
    assert "Paris" in final.choices[0].message.content
    assert final.choices[0].finish_reason == "stop"
    assert final.usage.completion_tokens >= 5


def test_raw_stream_shape(stack):
    body = {"model": "m", "messages": PARIS, "temperature": 0, "max_tokens": 5, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", stack.url + "/v1/chat/completions", json=body, timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert all(c["usage"] is None for c in chunks[:-1])


def test_second_turn_reports_cached_tokens(client):
    first = client.chat.completions.create(model="m", messages=PARIS, temperature=0, max_tokens=30)
    history = PARIS + [{"role": "assistant", "content": first.choices[0].message.content},
                       {"role": "user", "content": "And of Italy?"}]
    second = client.chat.completions.create(model="m", messages=history, temperature=0, max_tokens=5)
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1


def test_stop_strings_end_the_answer(client):
    reply = client.chat.completions.create(model="m", messages=PARIS, temperature=0, max_tokens=40, stop=["Paris"])
    assert "Paris" not in reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens < 40


def test_logprobs(client):
    reply = client.chat.completions.create(model="m", messages=PARIS, temperature=0, max_tokens=5,
                                           logprobs=True, top_logprobs=3)
    entries = reply.choices[0].logprobs.content
    assert len(entries) == 5
    for entry in entries:
        assert entry.logprob <= 0
        assert len(entry.top_logprobs) == 3
        # greedy: the chosen token is the most likely one
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)
    assert "".join(e.token for e in entries) == reply.choices[0].message.content


def test_seeded_sampling_is_reproducible(client):
    args = dict(model="m", messages=PARIS, temperature=1.0, top_p=0.9, seed=1234, max_tokens=12)
    a = client.chat.completions.create(**args).choices[0].message.content
    b = client.chat.completions.create(**args).choices[0].message.content
    assert a == b


@pytest.mark.parametrize("body, fragment, param", [
    ({"messages": PARIS, "n": 2}, "'n' must be 1", "n"),
    ({"messages": "hi"}, "'messages' must be an array", "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "role", "messages[0].role"),
    ({"messages": PARIS, "temperature": "hot"}, "'temperature' must be a number", "temperature"),
    ({"messages": PARIS, "temperature": 3}, "between 0 and 2", "temperature"),
    ({"messages": PARIS, "reasoning_effort": "high"}, "no reasoning channel", "reasoning_effort"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "text only", "messages[0].content[0].type"),
])
def test_bad_requests_get_a_400_in_openai_shape(stack, body, fragment, param):
    response = httpx.post(stack.url + "/v1/chat/completions", json={"model": "m", **body}, timeout=30)
    assert response.status_code == 400
    error = response.json()["error"]
    assert fragment in error["message"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param


def test_reasoning_off_is_always_fine(client):
    reply = client.chat.completions.create(model="m", messages=PARIS, max_tokens=3, reasoning_effort="none",
                                           temperature=0)
    assert reply.choices[0].finish_reason == "length"


def test_malformed_json_is_a_400(stack):
    response = httpx.post(stack.url + "/v1/chat/completions", content=b'{"messages": [', timeout=30,
                          headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert "not valid JSON" in response.json()["error"]["message"]


def test_prompt_beyond_the_context_is_context_length_exceeded(client):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "word " * 3000}])
    assert error.value.code == "context_length_exceeded"
    assert "maximum context length is 2048 tokens" in error.value.message


def test_long_prefill_sends_keep_alives_before_the_first_token(stack):
    # a fresh ~1,400-token prompt (no cached prefix) takes several ping intervals (0.5 s) to read
    words = " ".join(f"w{i}x{i * 7919 % 10007}" for i in range(200))
    body = {"model": "m", "messages": [{"role": "user", "content": words}], "max_tokens": 2, "stream": True}
    with httpx.stream("POST", stack.url + "/v1/chat/completions", json=body, timeout=120) as response:
        lines = [line for line in response.iter_lines() if line]
    first_content = next(i for i, line in enumerate(lines) if line.startswith("data: {") and "\"role\"" not in line)
    assert any(line == ": keep-alive" for line in lines[:first_content]), lines[:first_content + 1]
    assert lines[-1] == "data: [DONE]"


def test_any_64_bit_seed_works_and_a_larger_one_is_a_400(client, stack):
    negative = client.chat.completions.create(model="m", messages=PARIS, temperature=1.0, seed=-5, max_tokens=3)
    assert negative.usage.completion_tokens == 3
    too_big = httpx.post(stack.url + "/v1/chat/completions", timeout=30,
                         json={"model": "m", "messages": PARIS, "seed": 2**64, "max_tokens": 2})
    assert too_big.status_code == 400 and "64 bits" in too_big.json()["error"]["message"]
    # the worker is still serving
    assert client.chat.completions.create(model="m", messages=PARIS, max_tokens=2).usage.completion_tokens == 2


def test_x_api_key_on_chat_still_gets_openai_errors(stack):
    response = httpx.post(stack.url + "/v1/chat/completions", json={"model": "m", "messages": "x"},
                          headers={"x-api-key": "k"}, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"


def test_refusal_parts_in_history_are_read(client):
    """A refusal part is the assistant's words: the prompt is the one the same words as text give."""
    def prompt_tokens(assistant_content) -> int:
        history = PARIS + [{"role": "assistant", "content": assistant_content}, {"role": "user", "content": "Please?"}]
        return client.chat.completions.create(model="m", messages=history, max_tokens=1).usage.prompt_tokens

    refused = prompt_tokens([{"type": "refusal", "refusal": "I cannot name cities today."}])
    assert refused == prompt_tokens("I cannot name cities today.")
    assert refused > prompt_tokens("No.")
