"""The Responses API through the real stack, driven by the official openai SDK (and raw SSE)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import openai
import pydantic
import pytest
from openai.types.responses import Response, ResponseStreamEvent

from gateway.dialects import openai_responses
from gateway.generation import Completion
from gateway.neutral import (
    Finish,
    LogprobsDelta,
    Ping,
    ReasoningDelta,
    Started,
    TextDelta,
    TokenLogprob,
    Usage,
)
from gateway.prompting import ModelView
from shared.errors import ContextOverflowError, WorkerUnavailableError

QUESTION = "Name the capital city of France."
TERMINAL = {"response.completed", "response.incomplete", "response.failed"}
# Strict schema checks: stricter than the SDK's own lenient parsing, as typed clients in other
# languages are.
STREAM_EVENT = pydantic.TypeAdapter(ResponseStreamEvent)


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0)


def sse_events(stack, body: dict[str, Any]) -> list[tuple[str | None, dict[str, Any]]]:
    """POST a streaming request and return (event line, data) pairs; comments are dropped."""
    events: list[tuple[str | None, dict[str, Any]]] = []
    name: str | None = None
    with httpx.stream("POST", stack.url + "/v1/responses", json={**body, "stream": True}, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                events.append((name, json.loads(line[len("data: "):])))
                name = None
    return events


def test_non_streaming_answer_and_usage(client):
    reply = client.responses.create(model="anything-goes", input=QUESTION, temperature=0, max_output_tokens=16)
    assert reply.model == "anything-goes"
    assert reply.object == "response"
    assert reply.id.startswith("resp_")
    assert reply.status == "completed"
    assert reply.incomplete_details is None and reply.error is None
    assert "Paris" in reply.output_text
    [message] = reply.output
    assert message.type == "message" and message.id.startswith("msg_") and message.status == "completed"
    assert message.content[0].annotations == []
    usage = reply.usage
    assert usage.input_tokens > 20 and usage.output_tokens >= 3
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens <= usage.input_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0
    assert reply.text.format.type == "text"
    assert reply.completed_at is not None and reply.completed_at >= reply.created_at


def test_instructions_are_the_leading_system_message(client):
    rule = "You only ever answer in French."
    steered = client.responses.create(model="m", input=QUESTION, instructions=rule, temperature=0,
                                      max_output_tokens=2)
    # The same text as a developer message (read as system) must build the very same prompt.
    spelled_out = client.responses.create(
        model="m", temperature=0, max_output_tokens=2,
        input=[{"role": "developer", "content": rule}, {"role": "user", "content": QUESTION}])
    plain = client.responses.create(model="m", input=QUESTION, temperature=0, max_output_tokens=2)
    assert steered.instructions == rule and spelled_out.instructions is None
    assert steered.usage.input_tokens == spelled_out.usage.input_tokens != plain.usage.input_tokens
    assert steered.output_text == spelled_out.output_text


def test_streaming_with_the_sdk_helper(client):
    with client.responses.stream(model="m", input=QUESTION, temperature=0, max_output_tokens=16) as stream:
        deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed"
    assert "".join(deltas) == final.output_text
    assert "Paris" in final.output_text
    assert final.usage.output_tokens >= 3


def test_raw_stream_shape(stack):
    events = sse_events(stack, {"model": "m", "input": QUESTION, "temperature": 0, "max_output_tokens": 16})
    names = [data["type"] for _, data in events]
    assert all(name == data["type"] for name, data in events)  # every event has its event: line
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    assert names[:2] == ["response.created", "response.in_progress"]
    for _, data in events:
        STREAM_EVENT.validate_python(data)
    assert events[0][1]["response"]["status"] == "in_progress" and events[0][1]["response"]["output"] == []
    assert names[-1] == "response.completed"
    assert sum(name in TERMINAL for name in names) == 1
    assert names[2:5] == ["response.output_item.added", "response.content_part.added", "response.output_text.delta"]
    assert names[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    by_name = {name: data for name, data in events}
    added, done = by_name["response.output_item.added"]["item"], by_name["response.output_item.done"]["item"]
    completed = by_name["response.completed"]["response"]
    assert added["id"] == done["id"] == completed["output"][0]["id"]
    assert completed["id"] == events[0][1]["response"]["id"]
    deltas = [data for _, data in events if data["type"] == "response.output_text.delta"]
    assert all(d["logprobs"] == [] and d["item_id"] == added["id"] for d in deltas)
    assert "".join(d["delta"] for d in deltas) == by_name["response.output_text.done"]["text"]
    assert completed["output"][0]["content"][0]["text"] == by_name["response.output_text.done"]["text"]


def test_small_max_output_tokens_is_incomplete(client, stack):
    reply = client.responses.create(model="m", input=QUESTION, temperature=0, max_output_tokens=2)
    assert reply.status == "incomplete"
    assert reply.incomplete_details.reason == "max_output_tokens"
    assert reply.usage.output_tokens == 2
    names = [data["type"] for _, data in sse_events(stack, {"model": "m", "input": QUESTION, "max_output_tokens": 2})]
    assert names[-1] == "response.incomplete" and sum(name in TERMINAL for name in names) == 1
    assert names.count("response.output_item.added") == names.count("response.output_item.done") == 1


CODEX_TOOLS = [
    {"type": "function", "name": "exec_command", "description": "Run a shell command.", "strict": False,
     "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}},
    {"type": "namespace", "name": "mcp__files__", "description": "File tools.",
     "tools": [{"type": "function", "name": "read_file", "description": "Read a file.",
                "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}]},
    {"type": "custom", "name": "apply_patch", "description": "Apply a patch.",
     "format": {"type": "grammar", "syntax": "lark", "definition": 'start: "*** Begin Patch" /(.|\\n)*/'}},
    {"type": "web_search", "external_web_access": True},
]


def codex_body(cache_key: str, extra_input: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A request shaped like the ones Codex sends (its 12 fields, a history of every item kind)."""
    history = [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "List the files."}]},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "I should run ls."}], "encrypted_content": None},
        {"type": "message", "role": "assistant", "id": "msg_1", "content": []},
        {"type": "function_call", "call_id": "call_1", "name": "exec_command", "arguments": '{"cmd": "ls"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "README.md\nsetup.py"},
        {"type": "function_call", "call_id": "call_2", "name": "read_file", "namespace": "mcp__files__",
         "arguments": '{"path": "README.md"}'},
        {"type": "function_call_output", "call_id": "call_2",
         "output": [{"type": "input_text", "text": "# Demo project"}]},
        {"type": "additional_tools", "role": "developer", "tools": [
            {"type": "function", "name": "update_plan", "parameters": {"type": "object", "properties": {}}}]},
        {"type": "item_reference", "id": "msg_0"},
        *(extra_input or [{"type": "message", "role": "user", "content": "Say hello."}]),
    ]
    return {"model": "codex-model", "instructions": "You are a coding agent.", "input": history,
            "tools": CODEX_TOOLS, "tool_choice": "auto", "parallel_tool_calls": False,
            "reasoning": {"effort": "medium", "summary": "auto"}, "store": False, "stream": True,
            "include": ["reasoning.encrypted_content"], "prompt_cache_key": cache_key,
            "client_metadata": {"x-codex-turn": "1"},
            # Codex sends neither; they keep this test short and its answer finished.
            "temperature": 0, "max_output_tokens": 60}


def test_a_codex_shaped_request_completes_and_the_next_turn_hits_the_cache(stack):
    events = sse_events(stack, codex_body("conv-1"))
    terminal = events[-1][1]
    assert terminal["type"] == "response.completed", terminal
    response = terminal["response"]
    assert response["status"] == "completed"
    # No reasoning channel on this model: the effort was a no-op, and the echo says so.
    assert response["reasoning"] == {"effort": None, "summary": None}
    assert response["store"] is False and response["parallel_tool_calls"] is False
    assert response["tools"] == CODEX_TOOLS and response["tool_choice"] == "auto"
    assert [item["type"] for item in response["output"]] == ["message"]
    Response.model_validate(response)
    assert isinstance(response["usage"]["total_tokens"], int)

    answer = response["output"][0]
    second = sse_events(stack, codex_body("conv-1", [
        {"type": "message", "role": "assistant", "content": answer["content"]},
        {"type": "message", "role": "user", "content": "Thanks."}]))[-1][1]["response"]
    assert second["usage"]["input_tokens_details"]["cached_tokens"] > 0
    assert second["usage"]["input_tokens"] > response["usage"]["input_tokens"]


def test_reasoning_off_is_echoed(client):
    reply = client.responses.create(model="m", input=QUESTION, max_output_tokens=2, reasoning={"effort": "none"})
    assert reply.reasoning.effort == "none"


def test_previous_response_id_is_refused(client):
    with pytest.raises(openai.BadRequestError) as error:
        client.responses.create(model="m", input=QUESTION, previous_response_id="resp_123")
    assert error.value.param == "previous_response_id"
    assert error.value.body["type"] == "invalid_request_error"
    assert "stateless" in error.value.message


@pytest.mark.parametrize("body, fragment, param", [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]},
     "text only", "input[0].content[0].type"),
    ({"input": QUESTION, "text": {"format": {"type": "xml"}}},
     "must be text, json_object or json_schema", "text.format.type"),
    ({"input": QUESTION, "conversation": "conv_1"}, "stateless", "conversation"),
    ({"input": QUESTION, "background": True}, "stateless", "background"),
    ({"input": QUESTION, "max_output_tokens": 0}, "at least 1", "max_output_tokens"),
    ({"input": QUESTION, "reasoning": {"effort": "enormous"}}, "must be one of", "reasoning.effort"),
    ({"input": [{"role": "wizard", "content": "x"}]}, "role", "input[0].role"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "cannot be replayed", "input[0].type"),
    ({"input": []}, "nothing to answer", "input"),
])
def test_bad_requests_get_a_400_in_openai_shape(stack, body, fragment, param):
    response = httpx.post(stack.url + "/v1/responses", json={"model": "m", **body}, timeout=30)
    assert response.status_code == 400
    error = response.json()["error"]
    assert fragment in error["message"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param


def test_an_unknown_field_is_400_under_strict_fields(strict_stack):
    response = httpx.post(strict_stack.url + "/v1/responses", json={"model": "m", "input": QUESTION, "frobnicate": 1},
                          timeout=30)
    assert response.status_code == 400
    error = response.json()["error"]
    assert "unknown field 'frobnicate'" in error["message"] and error["param"] == "frobnicate"


def test_malformed_json_is_a_400(stack):
    response = httpx.post(stack.url + "/v1/responses", content=b'{"input": [', timeout=30,
                          headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert "not valid JSON" in response.json()["error"]["message"]


def test_prompt_beyond_the_context_is_context_length_exceeded(client):
    with pytest.raises(openai.BadRequestError) as error:
        client.responses.create(model="m", input="word " * 3000, stream=True)
    assert error.value.code == "context_length_exceeded"
    assert "maximum context length is 2048 tokens" in error.value.message


def test_stored_responses_do_not_exist(client):
    with pytest.raises(openai.NotFoundError) as error:
        client.responses.retrieve("resp_x")
    assert error.value.code == "not_found"


# --- the dialect's event rendering, on event sequences the default model never produces ---------
# SmolLM2 has no reasoning channel and a healthy worker never fails mid-stream, so these feed the
# dialect neutral events directly and let the real SDK stream helper consume what it writes.

@pytest.fixture(scope="module")
def view(stack_worker) -> ModelView:
    """The model as a gateway sees it, from the shared worker's own card."""
    return ModelView.from_card(stack_worker.card())


def render_stream(view: ModelView, events: list[Any], **body: Any) -> bytes:
    async def replay():
        for event in events:
            if isinstance(event, Exception):
                raise event
            yield event

    async def run_stream() -> bytes:
        request = openai_responses.parse({"model": "m", "input": QUESTION, "stream": True, **body}, view, {})
        return b"".join([chunk async for chunk in openai_responses.stream(request, view, replay())])

    return asyncio.run(run_stream())


def sdk_over(raw: bytes) -> openai.OpenAI:
    transport = httpx.MockTransport(lambda request: httpx.Response(
        200, content=raw, headers={"content-type": "text/event-stream"}))
    return openai.OpenAI(base_url="http://responses.test/v1", api_key="x", max_retries=0,
                         http_client=httpx.Client(transport=transport))


def test_reasoning_comes_as_its_own_item_before_the_message(view):
    usage = Usage(prompt_tokens=12, cached_tokens=4, completion_tokens=6, reasoning_tokens=3)
    raw = render_stream(view, [Started(12), Ping(), ReasoningDelta("Think"), ReasoningDelta("ing."),
                         TextDelta("Paris"), TextDelta("."), Finish("stop", usage)])
    assert b"\n: keep-alive\n\n" in raw  # the Ping, as an SSE comment
    with sdk_over(raw).responses.stream(model="m", input=QUESTION) as stream:
        names = [event.type for event in stream]
        final = stream.get_final_response()
    reasoning, message = final.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_")
    assert reasoning.content[0].text == "Thinking." and reasoning.summary == []
    assert message.type == "message" and final.output_text == "Paris."
    assert names.index("response.reasoning_text.done") < names.index("response.output_item.done") \
        < names.index("response.output_text.delta")
    assert names.count("response.output_item.added") == names.count("response.output_item.done") == 2
    assert final.usage.output_tokens_details.reasoning_tokens == 3
    assert final.usage.input_tokens_details.cached_tokens == 4


def test_logprobs_ride_on_the_text_deltas(view):
    items = [TokenLogprob("Par", -0.5, [80, 97, 114], [("Par", -0.5, [80, 97, 114])]),
             TokenLogprob("is", -0.25, [105, 115], [("is", -0.25, [105, 115])])]
    raw = render_stream(view, [Started(5), LogprobsDelta(items[:1]), TextDelta("Par"), LogprobsDelta(items[1:]),
                         TextDelta("is"), Finish("stop", Usage(5, 0, 2, 0))],
                        include=["message.output_text.logprobs"], top_logprobs=1)
    with sdk_over(raw).responses.stream(model="m", input=QUESTION) as stream:
        deltas = [event for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert [[lp.token for lp in d.logprobs] for d in deltas] == [["Par"], ["is"]]
    assert [lp.logprob for lp in final.output[0].content[0].logprobs] == [-0.5, -0.25]


@pytest.mark.parametrize("failure, code", [
    (WorkerUnavailableError("the worker went silent"), "service_unavailable"),
    (ContextOverflowError(2100, 2048), "context_length_exceeded"),
])
def test_a_failure_mid_stream_ends_with_response_failed(view, failure, code):
    raw = render_stream(view, [Started(5), TextDelta("Par"), failure])
    events = [json.loads(line[len("data: "):]) for line in raw.decode().splitlines() if line.startswith("data: ")]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    names = [e["type"] for e in events]
    assert names[-1] == "response.failed" and sum(name in TERMINAL for name in names) == 1
    assert names.count("response.output_item.added") == names.count("response.output_item.done") == 1
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == code
    assert failed["output"][0]["status"] == "incomplete"


def test_running_out_of_context_is_incomplete(view):
    raw = render_stream(view, [Started(5), ReasoningDelta("Hm"), Finish("context", Usage(5, 0, 1, 1))])
    events = [json.loads(line[len("data: "):]) for line in raw.decode().splitlines() if line.startswith("data: ")]
    last = events[-1]
    assert last["type"] == "response.incomplete"
    assert last["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [item["type"] for item in last["response"]["output"]] == ["reasoning"]


def test_non_streaming_reasoning_and_message_items(view):
    completion = Completion()
    for event in [Started(5), ReasoningDelta("Hm."), TextDelta("Paris."), Finish("stop", Usage(5, 0, 3, 1))]:
        completion.add(event)
    request = openai_responses.parse({"model": "m", "input": QUESTION}, view, {})
    body = openai_responses.render(request, view, completion)
    assert [item["type"] for item in body["output"]] == ["reasoning", "message"]
    parsed = Response.model_validate(body)
    assert parsed.output_text == "Paris." and parsed.status == "completed"


def test_codex_history_folds_into_template_messages(view):
    body = codex_body("conv-2")
    body["tools"] = CODEX_TOOLS + [{"type": "function", "name": "read_file", "parameters": {"type": "object"}}]
    request = openai_responses.parse(body, view, {})
    names = [tool["function"]["name"] for tool in request.tools]
    # The namespace member clashes with a plain tool of the same name, so it is qualified.
    # The freeform apply_patch is shown to the model as a function of one string.
    assert names == ["exec_command", "mcp__files__.read_file", "apply_patch", "read_file", "update_plan"]
    assert request.echo.namespaced_tools == {
        "mcp__files__.read_file": {"namespace": "mcp__files__", "name": "read_file"}}
    assert request.echo.custom_tool_names == ["apply_patch"]
    assert request.reasoning is False and request.cache_hint == "conv-2"
    roles = [message["role"] for message in request.messages]
    assert roles == ["system", "system", "user", "assistant", "tool", "assistant", "tool", "user"]
    first_turn, second_turn = request.messages[3], request.messages[5]
    assert first_turn["reasoning_content"] == "I should run ls." and first_turn["content"] == ""
    assert first_turn["tool_calls"][0]["function"] == {"name": "exec_command", "arguments": {"cmd": "ls"}}
    assert second_turn["tool_calls"][0]["function"]["name"] == "mcp__files__.read_file"
    assert request.messages[6] == {"role": "tool", "tool_call_id": "call_2", "content": "# Demo project"}
