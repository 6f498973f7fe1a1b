"""Anthropic Messages through the real stack, driven by the official anthropic SDK."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import pytest

PARIS = [{"role": "user", "content": "Name the capital city of France."}]
HEADERS = {"anthropic-version": "2023-06-01"}
# anthropic 2.x dropped temperature from its signature; the server still honours it.
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def client(stack) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=stack.url, api_key="x", max_retries=0)


def text_of(message: Any) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def sse_records(stack, body: dict[str, Any], path: str = "/v1/messages") -> list[tuple[str | None, dict]]:
    """(event name, data) per SSE record, exactly as sent."""
    with httpx.stream("POST", stack.url + path, json={**body, "stream": True}, headers=HEADERS,
                      timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    records = []
    for chunk in raw.strip().split("\n\n"):
        lines = chunk.split("\n")
        name = next((line[len("event: "):] for line in lines if line.startswith("event: ")), None)
        data = next(line[len("data: "):] for line in lines if line.startswith("data: "))
        records.append((name, json.loads(data)))
    return records


def test_non_streaming_answer_and_usage(client):
    reply = client.messages.create(model="claude-sonnet-4-6", max_tokens=40, extra_body=GREEDY, messages=PARIS)
    assert reply.model == "claude-sonnet-4-6"
    assert reply.id.startswith("msg_") and reply.type == "message" and reply.role == "assistant"
    assert [block.type for block in reply.content] == ["text"]
    assert "Paris" in text_of(reply)
    assert reply.stop_reason == "end_turn" and reply.stop_sequence is None
    usage = reply.usage
    assert usage.input_tokens + usage.cache_read_input_tokens > 20
    assert usage.cache_creation_input_tokens == 0
    assert 3 <= usage.output_tokens <= 40


def test_max_tokens_reached(client):
    reply = client.messages.create(model="m", max_tokens=3, extra_body=GREEDY, messages=PARIS)
    assert reply.stop_reason == "max_tokens"
    assert reply.usage.output_tokens == 3


def test_streaming_with_the_sdk_helper(client):
    with client.messages.stream(model="m", max_tokens=40, extra_body=GREEDY, messages=PARIS) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(pieces) == text_of(final)
    assert "Paris" in text_of(final)
    assert final.stop_reason == "end_turn"
    assert final.usage.output_tokens >= 3
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens > 20


def test_raw_stream_order(stack):
    records = sse_records(stack, {"model": "m", "max_tokens": 5, "temperature": 0, "messages": PARIS})
    assert all(name is not None and name == data["type"] for name, data in records)
    names = [name for name, _ in records]
    assert names[0] == "message_start" and names[1] == "ping"
    assert names[-2:] == ["message_delta", "message_stop"]
    content = [(name, data) for name, data in records if name.startswith("content_block")]
    assert content[0][0] == "content_block_start"
    assert content[0][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    assert content[-1][1] == {"type": "content_block_stop", "index": 0}
    deltas = [data for name, data in content[1:-1]]
    assert deltas and all(d["type"] == "content_block_delta" and d["index"] == 0
                          and d["delta"]["type"] == "text_delta" for d in deltas)
    start = records[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["role"] == "assistant"
    delta = records[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 5
    assert (delta["usage"]["input_tokens"] + delta["usage"]["cache_read_input_tokens"]
            == start["usage"]["input_tokens"] + start["usage"]["cache_read_input_tokens"])


def test_second_turn_reads_the_cache(client):
    first = client.messages.create(model="m", max_tokens=20, extra_body=GREEDY, messages=PARIS)
    history = PARIS + [{"role": "assistant", "content": text_of(first)},
                       {"role": "user", "content": "And of Italy?"}]
    body = {"model": "m", "max_tokens": 3, "messages": history, "extra_body": GREEDY}
    prompt = client.messages.count_tokens(model="m", messages=history).input_tokens
    second = client.messages.create(**body)
    assert second.usage.cache_read_input_tokens > 0
    assert second.usage.input_tokens == prompt - second.usage.cache_read_input_tokens


def test_prefill_is_continued_and_not_repeated(client):
    prefill = "The capital of France is"
    reply = client.messages.create(model="m", max_tokens=10, extra_body=GREEDY,
                                   messages=PARIS + [{"role": "assistant", "content": prefill}])
    text = text_of(reply)
    assert not text.startswith(prefill)
    assert "Paris" in text


def test_stop_sequences_are_reported(client):
    reply = client.messages.create(model="m", max_tokens=40, extra_body=GREEDY, messages=PARIS,
                                   stop_sequences=["Paris"])
    assert reply.stop_reason == "stop_sequence"
    assert reply.stop_sequence == "Paris"
    assert "Paris" not in text_of(reply)


def test_system_as_string_blocks_and_mid_conversation(client):
    system = "You are a pirate. Always answer like a pirate."
    as_string = client.messages.count_tokens(model="m", system=system, messages=PARIS).input_tokens
    as_blocks = client.messages.count_tokens(
        model="m", messages=PARIS,
        system=[{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}]).input_tokens
    inside = client.messages.count_tokens(model="m", messages=[{"role": "system", "content": system}, *PARIS]).input_tokens
    bare = client.messages.count_tokens(model="m", messages=PARIS).input_tokens
    assert as_string == as_blocks == inside
    assert as_string != bare
    reply = client.messages.create(model="m", max_tokens=5, system=system, messages=PARIS)
    assert reply.usage.output_tokens >= 1
    later = client.messages.create(model="m", max_tokens=5, messages=[
        *PARIS, {"role": "assistant", "content": "Paris."}, {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "And Italy?"}])
    assert later.usage.output_tokens >= 1


def test_billing_header_is_left_out_of_the_prompt(client):
    plain = client.messages.count_tokens(model="m", system=[{"type": "text", "text": "Be brief."}],
                                         messages=PARIS).input_tokens
    with_header = client.messages.count_tokens(model="m", messages=PARIS, system=[
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.37.0d9; cch=fa690;"},
        {"type": "text", "text": "Be brief."}]).input_tokens
    assert plain == with_header


def test_thinking_on_a_model_without_a_reasoning_channel_is_a_no_op(client):
    # max_tokens below the budget is Anthropic's 400; here thinking is off, so it is no concern.
    reply = client.messages.create(model="m", max_tokens=5, messages=PARIS,
                                   thinking={"type": "enabled", "budget_tokens": 1024})
    assert [block.type for block in reply.content] == ["text"]
    adaptive = client.messages.create(model="m", max_tokens=3, messages=PARIS, thinking={"type": "adaptive"},
                                      extra_body={"output_config": {"effort": "high"}})
    assert adaptive.content and adaptive.content[0].type == "text"


def test_tools_history_and_server_tools_are_accepted(client):
    tools = [{"name": "get_weather", "description": "Weather for a city",
              "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}},
             {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}]
    history = [*PARIS,
               {"role": "assistant", "content": [
                   {"type": "thinking", "thinking": "Look it up.", "signature": "c2ln"},
                   {"type": "redacted_thinking", "data": "opaque"},
                   {"type": "tool_use", "id": "toolu_01", "name": "get_weather", "input": {"city": "Paris"}}]},
               {"role": "user", "content": [
                   {"type": "tool_result", "tool_use_id": "toolu_01", "content": [{"type": "text", "text": "Sunny"}]},
                   {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1", "content": []},
                   {"type": "text", "text": "Thanks. Summarise."}]}]
    reply = client.messages.create(model="m", max_tokens=3, messages=history, tools=tools,
                                   tool_choice={"type": "auto", "disable_parallel_tool_use": True})
    assert reply.stop_reason in ("max_tokens", "end_turn")
    only_server = client.messages.create(model="m", max_tokens=3, messages=PARIS,
                                         tools=[{"type": "web_search_20250305", "name": "web_search"}])
    assert only_server.usage.output_tokens >= 1


def test_beta_path_and_unknown_beta_headers(stack):
    headers = {**HEADERS, "anthropic-beta": "claude-code-20250219,made-up-beta-2099-01-01",
               "x-api-key": "x", "X-Claude-Code-Session-Id": "4b0e6e4c-session"}
    body = {"model": "claude-haiku-4-5", "max_tokens": 3, "messages": PARIS, "metadata": {"user_id": "u"},
            "context_management": {"edits": []}, "speed": "standard", "service_tier": "auto"}
    response = httpx.post(stack.url + "/v1/messages?beta=true", json=body, headers=headers, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["model"] == "claude-haiku-4-5"
    counted = httpx.post(stack.url + "/v1/messages/count_tokens?beta=true", headers=headers, timeout=30,
                         json={"model": "m", "messages": PARIS})
    assert counted.status_code == 200 and counted.json()["input_tokens"] > 20


def test_count_tokens_matches_the_generation(client):
    body = {"model": "m", "messages": PARIS, "system": "Be brief."}
    counted = client.messages.count_tokens(**body).input_tokens
    reply = client.messages.create(max_tokens=2, **body)
    assert counted == reply.usage.input_tokens + reply.usage.cache_read_input_tokens


def error_of(response: httpx.Response) -> dict[str, Any]:
    body = response.json()
    assert body["type"] == "error" and body["request_id"].startswith("req_")
    assert response.headers["request-id"]
    return body["error"]


@pytest.mark.parametrize("body, fragment", [
    ({"messages": PARIS}, "'max_tokens' is required"),
    ({"messages": PARIS, "max_tokens": 0}, "'max_tokens' must be at least 1"),
    ({"messages": PARIS, "max_tokens": "ten"}, "'max_tokens' must be an integer"),
    ({"messages": "hi", "max_tokens": 5}, "'messages' must be an array"),
    ({"messages": [], "max_tokens": 5}, "at least one message"),
    ({"messages": [{"role": "tool", "content": "x"}], "max_tokens": 5}, "messages[0].role"),
    ({"messages": PARIS, "max_tokens": 5, "temperature": 1.5}, "between 0 and 1"),
    ({"messages": PARIS, "max_tokens": 5, "system": 3}, "'system' must be"),
    ({"messages": PARIS, "max_tokens": 5, "thinking": {"type": "sometimes"}}, "thinking.type"),
    ({"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}],
      "max_tokens": 5}, "text only"),
    ({"messages": PARIS, "max_tokens": 5, "output_config": {"format": {"type": "json_object"}}},
     "must be json_schema"),
    ({"messages": PARIS, "max_tokens": 5, "output_format": {"type": "json_schema", "schema": {}},
      "output_config": {"format": {"type": "json_schema", "schema": {}}}}, "both constrain"),
])
def test_bad_requests_get_a_400_in_anthropic_shape(stack, body, fragment):
    response = httpx.post(stack.url + "/v1/messages", json={"model": "m", **body}, headers=HEADERS, timeout=30)
    assert response.status_code == 400
    error = error_of(response)
    assert error["type"] == "invalid_request_error"
    assert fragment in error["message"]


def test_sdk_raises_typed_errors(client):
    with pytest.raises(anthropic.BadRequestError) as raised:
        client.messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.png"}}]}])
    assert raised.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model="m", max_tokens=5, messages=PARIS, extra_body={"top_k": "many"})


def test_malformed_json_is_a_400(stack):
    response = httpx.post(stack.url + "/v1/messages", content=b'{"messages": [', timeout=30,
                          headers={**HEADERS, "content-type": "application/json"})
    assert response.status_code == 400
    assert "not valid JSON" in error_of(response)["message"]


def test_prompt_too_long_keeps_anthropics_wording(client):
    messages = [{"role": "user", "content": "word " * 3000}]
    with pytest.raises(anthropic.BadRequestError) as raised:
        client.messages.create(model="m", max_tokens=5, messages=messages)
    error = raised.value.body["error"]
    assert error["type"] == "invalid_request_error"
    tokens = client.messages.count_tokens(model="m", messages=messages).input_tokens
    assert error["message"] == f"prompt is too long: {tokens} tokens > 2047 maximum"


def test_unknown_path_is_a_404_in_anthropic_shape(stack):
    response = httpx.post(stack.url + "/v1/foo", json={}, headers=HEADERS, timeout=30)
    assert response.status_code == 404
    assert error_of(response)["type"] == "not_found_error"
