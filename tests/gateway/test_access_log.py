"""The access log: one line per request, streams logged when they end, text or JSON."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest
from access_logs import access_entries
from conftest import wait_until

from gateway.access_log import AccessRecord, text_line

PARIS = [{"role": "user", "content": "Name the capital city of France."}]


def _access_entries(gateway) -> list[dict]:
    return access_entries(gateway.log_path)


@pytest.fixture(scope="module")
def json_gateway(start_gateway, stack_worker):
    return start_gateway(stack_worker, "--log-format", "json", "--api-key", "k")


def test_json_lines_carry_dialect_tokens_and_timings(json_gateway):
    chat = openai.OpenAI(base_url=json_gateway.url + "/v1", api_key="k", max_retries=0)
    messages = anthropic.Anthropic(base_url=json_gateway.url, api_key="k", max_retries=0)
    answer = chat.chat.completions.create(model="m", messages=PARIS, max_tokens=8)
    with chat.responses.stream(model="m", input="Say hi.", max_output_tokens=6) as stream:
        # six tokens may cut the answer short: then the last event is response.incomplete
        streamed = [e for e in stream if e.type in ("response.completed", "response.incomplete")][-1].response
    with messages.messages.stream(model="m", max_tokens=7, messages=PARIS) as stream:
        final = stream.get_final_message()
    refused = httpx.post(json_gateway.url + "/v1/messages", json={}, headers={"x-api-key": "wrong"})
    assert refused.status_code == 401
    assert wait_until(lambda: len([e for e in _access_entries(json_gateway) if e["path"].startswith("/v1/")]) >= 4)

    # every line is one JSON object (uvicorn's own records included)
    lines = [line for line in json_gateway.log_path.read_text().splitlines() if line.strip()]
    assert all(isinstance(json.loads(line), dict) for line in lines)

    by_path = {e["path"]: e for e in _access_entries(json_gateway) if e["status"] != 401}
    chat_entry = by_path["/v1/chat/completions"]
    assert chat_entry["dialect"] == "chat" and chat_entry["status"] == 200 and chat_entry["stream"] is False
    assert chat_entry["prompt_tokens"] == answer.usage.prompt_tokens
    assert chat_entry["completion_tokens"] == answer.usage.completion_tokens
    assert chat_entry["cached_tokens"] == answer.usage.prompt_tokens_details.cached_tokens
    assert 0 < chat_entry["ttft_ms"] <= chat_entry["total_ms"]
    # one worker: its name from its card, and the route the only candidate won by
    assert chat_entry["worker"] and chat_entry["route"] in ("hash", "load")

    responses_entry = by_path["/v1/responses"]
    assert responses_entry["dialect"] == "responses" and responses_entry["stream"] is True
    assert responses_entry["completion_tokens"] == streamed.usage.output_tokens
    assert responses_entry["finish"] in ("stop", "length")

    messages_entry = by_path["/v1/messages"]
    assert messages_entry["dialect"] == "anthropic" and messages_entry["stream"] is True
    assert messages_entry["completion_tokens"] == final.usage.output_tokens
    assert messages_entry["cached_tokens"] == final.usage.cache_read_input_tokens
    assert messages_entry["prompt_tokens"] == final.usage.input_tokens + final.usage.cache_read_input_tokens

    # refusals at the edge are logged too, with the gateway that refused
    (refusal,) = [e for e in _access_entries(json_gateway) if e["status"] == 401]
    assert refusal["dialect"] == "anthropic" and refusal["prompt_tokens"] is None
    assert refusal["gateway"] == refused.headers["x-lmserve-gateway"]
    assert refusal["gateway"].endswith(f":{json_gateway.proc.pid}")


def test_a_stream_the_client_leaves_is_logged_when_it_ends(json_gateway):
    body = {"model": "m", "messages": PARIS, "max_tokens": 400, "stream": True,
            "logit_bias": {"0": -100, "2": -100}}
    before = len(_access_entries(json_gateway))
    with httpx.stream("POST", json_gateway.url + "/v1/chat/completions", json=body,
                      headers={"authorization": "Bearer k"}, timeout=60) as response:
        for line in response.iter_lines():
            if '"content":"' in line and '"content":""' not in line:
                break  # one token, then hang up
    assert wait_until(lambda: len(_access_entries(json_gateway)) > before)
    entry = _access_entries(json_gateway)[-1]
    assert entry["status"] == 499 and entry["ttft_ms"] is not None  # the client closed the request
    assert entry["finish"] is None  # never finished: cut by the client


def test_a_whole_reply_the_client_leaves_is_an_access_line_not_an_error(json_gateway):
    """A client that gives up on a non-streamed reply (its timeout runs out) ends the request: the
    gateway logs it as a 499 access line, with no ERROR and no CancelledError traceback."""
    body = {"model": "m", "messages": PARIS, "max_tokens": 400, "logit_bias": {"0": -100, "2": -100}}
    before = len(_access_entries(json_gateway))
    log_size = json_gateway.log_path.stat().st_size
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(json_gateway.url + "/v1/chat/completions", json=body, headers={"authorization": "Bearer k"},
                   timeout=httpx.Timeout(10, read=1.0))
    assert wait_until(lambda: len(_access_entries(json_gateway)) > before)
    entry = _access_entries(json_gateway)[-1]
    assert (entry["path"], entry["status"], entry["stream"], entry["finish"]) == ("/v1/chat/completions", 499,
                                                                                 False, None)
    # the worker was told: the next request is served at once, not after 400 tokens
    answer = httpx.post(json_gateway.url + "/v1/chat/completions", headers={"authorization": "Bearer k"},
                        json={"model": "m", "messages": PARIS, "max_tokens": 2}, timeout=60)
    assert answer.status_code == 200
    with json_gateway.log_path.open("rb") as log:
        log.seek(log_size)
        written = log.read().decode("utf-8", errors="replace")
    levels = [json.loads(line).get("level") for line in written.splitlines() if line.startswith("{")]
    assert "error" not in levels and "Traceback" not in written and "CancelledError" not in written, written[-3000:]


def test_text_lines_are_one_readable_line_per_request(stack):
    httpx.post(stack.url + "/v1/chat/completions", json={"model": "m", "messages": PARIS, "max_tokens": 3},
               timeout=60).raise_for_status()
    assert wait_until(lambda: "POST /v1/chat/completions 200 dialect=chat" in stack.log_path.read_text())
    line = next(line for line in stack.log_path.read_text().splitlines()
                if "POST /v1/chat/completions 200 dialect=chat" in line)
    assert "lmserve.access INFO" in line and "stream=no" in line and " total_ms=" in line


def test_text_line_shows_missing_values_as_dashes():
    record = AccessRecord("GET", "/nowhere", started=0.0, status=404)
    line = text_line(record.fields("host:1", ended=0.0125))
    assert line == ("GET /nowhere 404 dialect=- stream=- prompt=- cached=- completion=- finish=- "
                    "ttft_ms=- total_ms=12.5 worker=- route=- key=-")
