"""Tool calling and reasoning through the real stack, in all three dialects, with the official SDKs.

The model is the tiny random qwen3 (real Qwen vocabulary, Hermes-convention template). Random
weights choose nothing useful, so its worker runs with ``--scripted-replies``: every step still
runs the engine, but the tokens come from the script below. Each reply is keyed by a marker in
the prompt (the latest marker wins), so tests may run in any order: a round trip's second turn
carries the marker of the final answer inside the tool result, which therefore also proves that
the result reached the prompt.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pydantic
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from test_openai_responses import (
    CODEX_TOOLS,  # namespace, custom and hosted tools, as Codex sends them
)
from tiny_models import write_tiny_gguf
from weather_tools import THINKING, weather_tools

from gateway import tool_calls
from gateway.dialects import anthropic_messages, openai_chat, openai_responses
from gateway.prompting import ModelView
from shared.tokenizer import Tokenizer

WEATHER_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOKYO_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tōkyō"}}\n</tool_call>'
BAD_CALL = 'Let me try.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'
READ_CALL = '<tool_call>\n{"name": "read_file", "arguments": {"path": "README.md"}}\n</tool_call>'
PATCH = "*** Begin Patch\n*** End Patch"
PATCH_CALL = '<tool_call>\n' + json.dumps({"name": "apply_patch", "arguments": {"input": PATCH}}) + '\n</tool_call>'
TWO_CALLS = "Checking both.\n" + WEATHER_CALL + "\n" + TOKYO_CALL
THOUGHT = "I should call the tool."
ANSWER = "It is 22C and sunny in Paris."

# marker -> reply text ("ids" in the file for CALL_PLAIN, to exercise token-id replies)
SCRIPT = {
    "[[call-weather]]": f"<think>\n{THOUGHT}\n</think>\n\n{WEATHER_CALL}",
    "[[weather-result]]": ANSWER,
    "[[two-calls]]": TWO_CALLS,
    "[[bad-call]]": BAD_CALL,
    "[[call-plain]]": WEATHER_CALL,
    "[[think-answer]]": "<think>\nThe user greets me.\n</think>\n\nHello there.",
    "[[codex]]": READ_CALL + "\n" + PATCH_CALL,
}
# marker -> the start of a reply the model then goes on with by itself ("then": "sample"), held
# to the request's grammar once the script is said
SAMPLED = {
    "[[auto-paint]]": '<tool_call>\n{"name": "paint", "arguments": {"input": "',
    "[[auto-strict]]": '<tool_call>\n{"name": "get_weather", "arguments": ',
    "[[think-json]]": "<think>\nI will answer in JSON.\n</think>",
}
BROKEN_JSON = '{"answer": "yes", oops}'  # scripted under a JSON grammar: the matcher refuses "oops"
SCRIPT["[[broken-json]]"] = BROKEN_JSON
RESULT = "22C and sunny [[weather-result]]"
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CHAT_TOOLS, RESPONSES_TOOLS, ANTHROPIC_TOOLS = weather_tools(WEATHER_SCHEMA)
STREAM_EVENT = pydantic.TypeAdapter(ResponseStreamEvent)


def script_file_entries(tokenizer: Tokenizer) -> list[Any]:
    entries: list[Any] = []
    for marker, text in SCRIPT.items():
        if marker == "[[call-plain]]":
            ids = tokenizer.encode(text, add_special=False)
            # the tags are single tokens of the Qwen vocabulary
            assert ids[0] == tokenizer.piece_to_id("<tool_call>") and ids[-1] == tokenizer.piece_to_id("</tool_call>")
            entries.append({"when": marker, "ids": ids})
        else:
            entries.append({"when": marker, "text": text})
    entries += [{"when": marker, "text": text, "then": "sample"} for marker, text in SAMPLED.items()]
    entries.append({"text": "There is no script for this."})
    return entries


@pytest.fixture(scope="module")
def qwen_stack(tmp_path_factory, start_worker, start_gateway, qwen_tokenizer):
    folder = tmp_path_factory.mktemp("scripted-qwen3")
    model = folder / "tiny-qwen3.gguf"
    write_tiny_gguf(model, "qwen3", context_length=4096)
    script = folder / "replies.json"
    script.write_text(json.dumps(script_file_entries(qwen_tokenizer)), encoding="utf-8")
    worker = start_worker(model, "--scripted-replies", str(script), "--batch", "2", "--ctx", "4096")
    return start_gateway(worker, "--ping-interval", "0.5"), worker


@pytest.fixture(scope="module")
def oai(qwen_stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=qwen_stack[0].url + "/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def claude(qwen_stack) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=qwen_stack[0].url, api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def view(qwen_stack) -> ModelView:
    return ModelView.from_card(qwen_stack[1].card())


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def final_answer(stream: bool, create: Any, stream_with: Any, final: str, **kwargs: Any) -> Any:
    """The answer whole, or streamed through the SDK's own stream helper and then assembled."""
    if not stream:
        return create(**kwargs)
    with stream_with(**kwargs) as events:
        for _ in events:
            pass
        return getattr(events, final)()


def sse_data(url: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=60) as response:
        assert response.status_code == 200, response.read()
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    return [json.loads(line[len("data: "):]) for line in lines if line != "data: [DONE]"]


# --- Chat Completions ---------------------------------------------------------------------------

def chat(oai: openai.OpenAI, stream: bool, messages: list[dict[str, Any]], **extra: Any):
    """The final completion, through the SDK's stream helper when streaming."""
    if stream:
        extra["stream_options"] = {"include_usage": True}
    return final_answer(stream, oai.chat.completions.create, oai.chat.completions.stream, "get_final_completion",
                        model="qwen", messages=messages, **{"tools": CHAT_TOOLS, "max_tokens": 120, **extra})


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_round_trip_with_thinking(oai, stream):
    question = [user("What is the weather in Paris? [[call-weather]]")]
    first = chat(oai, stream, question, reasoning_effort="medium")
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.reasoning_content == THOUGHT
    assert not choice.message.content
    [call] = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}

    history = question + [
        {"role": "assistant", "content": None, "reasoning_content": THOUGHT,
         "tool_calls": [{"id": call.id, "type": "function",
                         "function": {"name": "get_weather", "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": RESULT}]
    second = chat(oai, stream, history, reasoning_effort="none")
    assert second.choices[0].message.content == ANSWER
    assert second.choices[0].finish_reason == "stop" and not second.choices[0].message.tool_calls


def test_chat_stream_shape_of_tool_call_deltas(qwen_stack):
    chunks = sse_data(qwen_stack[0].url, "/v1/chat/completions", {
        "model": "q", "messages": [user("[[call-plain]]")], "tools": CHAT_TOOLS, "max_tokens": 120})
    deltas = [c["choices"][0]["delta"]["tool_calls"][0] for c in chunks
              if c["choices"] and c["choices"][0]["delta"].get("tool_calls")]
    first, rest = deltas[0], deltas[1:]
    assert first["index"] == 0 and first["id"].startswith("call_") and first["type"] == "function"
    assert first["function"] == {"name": "get_weather", "arguments": ""}
    assert len(rest) >= 2 and all(set(d) == {"index", "function"} and "arguments" in d["function"] for d in rest)
    assert json.loads("".join(d["function"]["arguments"] for d in rest)) == {"city": "Paris"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert not any(c["choices"][0]["delta"].get("content") for c in chunks if c["choices"])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_parallel_calls_and_the_single_call_cut(oai, stream):
    both = chat(oai, stream, [user("Paris and Tokyo? [[two-calls]]")])
    message = both.choices[0].message
    assert message.content == "Checking both."
    assert [json.loads(c.function.arguments)["city"] for c in message.tool_calls] == ["Paris", "Tōkyō"]
    assert len({c.id for c in message.tool_calls}) == 2

    one = chat(oai, stream, [user("Paris and Tokyo? [[two-calls]]")], parallel_tool_calls=False)
    assert one.choices[0].finish_reason == "tool_calls"
    assert [json.loads(c.function.arguments)["city"] for c in one.choices[0].message.tool_calls] == ["Paris"]
    # the reply was ended in the worker right after the first call, not read to its end
    assert one.usage.completion_tokens < both.usage.completion_tokens


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_malformed_call_comes_back_as_text(oai, stream):
    reply = chat(oai, stream, [user("[[bad-call]]")])
    assert reply.choices[0].message.content == BAD_CALL
    assert reply.choices[0].finish_reason == "stop" and not reply.choices[0].message.tool_calls


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_thinking_on_and_off(oai, stream):
    thought = chat(oai, stream, [user("Hi [[think-answer]]")], reasoning_effort="high").choices[0].message
    assert thought.reasoning_content == "The user greets me." and thought.content == "Hello there."
    plain = chat(oai, stream, [user("[[call-plain]]")], reasoning_effort="none").choices[0]
    assert plain.finish_reason == "tool_calls" and getattr(plain.message, "reasoning_content", None) is None
    assert plain.message.tool_calls[0].function.name == "get_weather"


def test_chat_tool_choice_none_leaves_calls_as_text(oai):
    reply = chat(oai, False, [user("[[call-plain]]")], tool_choice="none")
    assert reply.choices[0].message.content == WEATHER_CALL and reply.choices[0].finish_reason == "stop"


def test_tool_choice_none_makes_no_call(oai, claude):
    """On a model with a convention, a reply that is a call under auto ([[call-plain]]) is no
    call in any dialect when the client says none: the tools are not shown and the reply is not
    read for calls."""
    assert chat(oai, False, [user("[[call-plain]]")]).choices[0].message.tool_calls  # auto: a call
    reply = chat(oai, False, [user("[[call-plain]]")], tool_choice="none").choices[0]
    assert not reply.message.tool_calls and reply.finish_reason == "stop"
    response = respond(oai, False, "[[call-plain]]", tool_choice="none")
    assert "function_call" not in [item.type for item in response.output]
    answer = message(claude, False, [user("[[call-plain]]")], tool_choice={"type": "none"})
    assert answer.stop_reason == "end_turn" and "tool_use" not in [block.type for block in answer.content]


# --- Responses ----------------------------------------------------------------------------------

def respond(oai: openai.OpenAI, stream: bool, items: list[dict[str, Any]] | str, **extra: Any) -> Response:
    kwargs = {"model": "qwen", "input": items, "tools": RESPONSES_TOOLS, "max_output_tokens": 120, **extra}
    return final_answer(stream, oai.responses.create, oai.responses.stream, "get_final_response", **kwargs)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_responses_round_trip_with_thinking(oai, stream):
    question = [{"role": "user", "content": "Weather in Paris? [[call-weather]]"}]
    first = respond(oai, stream, question, reasoning={"effort": "medium"})
    assert first.status == "completed"
    reasoning, call = first.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == THOUGHT
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    assert json.loads(call.arguments) == {"city": "Paris"}

    # Codex's way: the output items go back as they came, then the result.
    history = question + [item.model_dump(exclude_none=True) for item in first.output] + [
        {"type": "function_call_output", "call_id": call.call_id, "output": RESULT}]
    second = respond(oai, stream, history, reasoning={"effort": "none"})
    assert second.output_text == ANSWER and [item.type for item in second.output] == ["message"]


def test_responses_stream_events_for_a_call(qwen_stack):
    events = sse_data(qwen_stack[0].url, "/v1/responses", {
        "model": "q", "input": "[[call-plain]]", "tools": RESPONSES_TOOLS, "max_output_tokens": 120})
    for event in events:
        STREAM_EVENT.validate_python(event)
    names = [e["type"] for e in events]
    assert names.count("response.function_call_arguments.delta") >= 2
    added = next(e for e in events if e["type"] == "response.output_item.added")
    done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
    final = events[-1]["response"]
    assert added["item"]["arguments"] == "" and added["item"]["status"] == "in_progress"
    assert done["item_id"] == added["item"]["id"] == final["output"][0]["id"]
    assert final["output"][0]["call_id"] == added["item"]["call_id"]
    assert json.loads(done["arguments"]) == {"city": "Paris"}
    assert names[-1] == "response.completed" and [i["type"] for i in final["output"]] == ["function_call"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_responses_parallel_calls_and_the_single_call_cut(oai, stream):
    both = respond(oai, stream, "Paris and Tokyo? [[two-calls]]")
    assert [item.type for item in both.output] == ["message", "function_call", "function_call"]
    assert both.output_text == "Checking both."
    assert [json.loads(item.arguments)["city"] for item in both.output[1:]] == ["Paris", "Tōkyō"]
    one = respond(oai, stream, "Paris and Tokyo? [[two-calls]]", parallel_tool_calls=False)
    assert [item.type for item in one.output] == ["message", "function_call"]
    assert one.usage.output_tokens < both.usage.output_tokens



@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_responses_namespace_and_custom_tool_calls(oai, stream):
    reply = respond(oai, stream, "Read and patch. [[codex]]", tools=CODEX_TOOLS)
    read, patch = reply.output
    assert (read.type, read.name, read.namespace) == ("function_call", "read_file", "mcp__files__")
    assert json.loads(read.arguments) == {"path": "README.md"}
    assert (patch.type, patch.name, patch.input) == ("custom_tool_call", "apply_patch", PATCH)
    assert patch.call_id.startswith("call_")

    # and the calls go back into the history as Codex sends them
    history = [{"role": "user", "content": "Read and patch. [[codex]]"},
               *[item.model_dump(exclude_none=True) for item in reply.output],
               {"type": "function_call_output", "call_id": read.call_id, "output": "# Demo"},
               {"type": "custom_tool_call_output", "call_id": patch.call_id, "output": "Done [[weather-result]]"}]
    assert respond(oai, stream, history, tools=CODEX_TOOLS).output_text == ANSWER


def test_responses_stream_events_for_namespace_and_custom_calls(qwen_stack):
    events = sse_data(qwen_stack[0].url, "/v1/responses", {
        "model": "q", "input": "[[codex]]", "tools": CODEX_TOOLS, "max_output_tokens": 120})
    for event in events:
        STREAM_EVENT.validate_python(event)
    by_type = {e["type"]: e for e in events}
    assert by_type["response.function_call_arguments.done"]["name"] == "read_file"
    assert by_type["response.custom_tool_call_input.done"]["input"] == PATCH
    # the freeform input streams as it is written, in pieces that join into it
    deltas = [e["delta"] for e in events if e["type"] == "response.custom_tool_call_input.delta"]
    assert "".join(deltas) == PATCH and len(deltas) > 1
    output = events[-1]["response"]["output"]
    assert [(i["type"], i["name"], i.get("namespace")) for i in output] == [
        ("function_call", "read_file", "mcp__files__"), ("custom_tool_call", "apply_patch", None)]
    Response.model_validate(events[-1]["response"])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_responses_malformed_call_and_thinking_off(oai, stream):
    bad = respond(oai, stream, "[[bad-call]]")
    assert [item.type for item in bad.output] == ["message"] and bad.output_text == BAD_CALL
    plain = respond(oai, stream, "[[call-plain]]", reasoning={"effort": "none"})
    assert [item.type for item in plain.output] == ["function_call"]
    thought = respond(oai, stream, "Hi [[think-answer]]", reasoning={"effort": "low"})
    assert [item.type for item in thought.output] == ["reasoning", "message"]
    assert thought.output[0].content[0].text == "The user greets me." and thought.output_text == "Hello there."


# --- Anthropic Messages -------------------------------------------------------------------------

def message(claude: anthropic.Anthropic, stream: bool, messages: list[dict[str, Any]], **extra: Any):
    kwargs = {"model": "claude-sonnet-4-6", "messages": messages, "tools": ANTHROPIC_TOOLS, "max_tokens": 2000,
              **extra}
    return final_answer(stream, claude.messages.create, claude.messages.stream, "get_final_message", **kwargs)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_anthropic_round_trip_with_thinking(claude, stream):
    question = [user("Weather in Paris? [[call-weather]]")]
    first = message(claude, stream, question, thinking=THINKING)
    assert first.stop_reason == "tool_use"
    thinking, call = first.content
    assert thinking.type == "thinking" and thinking.thinking == THOUGHT and thinking.signature
    assert call.type == "tool_use" and call.name == "get_weather" and call.input == {"city": "Paris"}
    assert re.fullmatch(r"toolu_[a-zA-Z0-9_-]+", call.id)

    history = question + [
        {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                      "content": [{"type": "text", "text": RESULT}]}]}]
    second = message(claude, stream, history)
    assert [block.type for block in second.content] == ["text"] and second.content[0].text == ANSWER
    assert second.stop_reason == "end_turn"


def test_anthropic_stream_of_a_call_has_no_empty_text_block_and_json_chunks(qwen_stack):
    records = sse_data(qwen_stack[0].url, "/v1/messages", {
        "model": "m", "max_tokens": 100, "messages": [user("[[call-plain]]")], "tools": ANTHROPIC_TOOLS})
    starts = [r["content_block"] for r in records if r["type"] == "content_block_start"]
    assert [block["type"] for block in starts] == ["tool_use"]
    chunks = [r["delta"]["partial_json"] for r in records
              if r["type"] == "content_block_delta" and r["delta"]["type"] == "input_json_delta"]
    assert len(chunks) >= 2 and json.loads("".join(chunks)) == {"city": "Paris"}
    assert next(r for r in records if r["type"] == "message_delta")["delta"]["stop_reason"] == "tool_use"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_anthropic_parallel_calls_and_disable_parallel_tool_use(claude, stream):
    both = message(claude, stream, [user("Paris and Tokyo? [[two-calls]]")])
    assert [block.type for block in both.content] == ["text", "tool_use", "tool_use"]
    assert [block.input["city"] for block in both.content[1:]] == ["Paris", "Tōkyō"]
    one = message(claude, stream, [user("Paris and Tokyo? [[two-calls]]")],
                  tool_choice={"type": "auto", "disable_parallel_tool_use": True})
    assert [block.type for block in one.content] == ["text", "tool_use"] and one.stop_reason == "tool_use"
    assert one.usage.output_tokens < both.usage.output_tokens


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_anthropic_malformed_call_and_thinking_off(claude, stream):
    bad = message(claude, stream, [user("[[bad-call]]")])
    assert [block.type for block in bad.content] == ["text"] and bad.content[0].text == BAD_CALL
    assert bad.stop_reason == "end_turn"
    plain = message(claude, stream, [user("[[call-plain]]")], thinking={"type": "disabled"})
    assert [block.type for block in plain.content] == ["tool_use"]
    thought = message(claude, stream, [user("Hi [[think-answer]]")], thinking=THINKING)
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in thought.content] == [
        ("thinking", "The user greets me."), ("text", "Hello there.")]


# --- what each dialect's history becomes in the Qwen prompt -----------------------------------------

EXPECTED_TURN = (f"<|im_start|>assistant\n<think>\n{THOUGHT}\n</think>\n\n{WEATHER_CALL}<|im_end|>\n"
                 f"<|im_start|>user\n<tool_response>\n22C and sunny\n</tool_response><|im_end|>\n"
                 f"<|im_start|>assistant\n")
HISTORIES = {
    openai_chat: {"messages": [
        user("Earlier."), {"role": "assistant", "content": "Old.", "reasoning_content": "Old thought."},
        user("Weather?"),
        {"role": "assistant", "content": None, "reasoning_content": THOUGHT, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "22C and sunny"}]}],
        "tools": CHAT_TOOLS, "reasoning_effort": "medium"},
    openai_responses: {"input": [
        user("Earlier."),
        {"type": "reasoning", "id": "rs_0", "summary": [{"type": "summary_text", "text": "Old thought."}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Old."}]},
        user("Weather?"),
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": THOUGHT}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "22C and sunny"}],
        "tools": RESPONSES_TOOLS, "reasoning": {"effort": "medium"}},
    anthropic_messages: {"messages": [
        user("Earlier."), {"role": "assistant", "content": [{"type": "thinking", "thinking": "Old thought."},
                                                            {"type": "text", "text": "Old."}]},
        user("Weather?"),
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": THOUGHT, "signature": "c2ln"},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "22C and sunny"}]}],
        "tools": ANTHROPIC_TOOLS, "max_tokens": 50, "thinking": THINKING},
}


@pytest.mark.parametrize("dialect", list(HISTORIES), ids=lambda d: d.__name__.rsplit(".", 1)[-1])
def test_history_renders_the_qwen_way(view, dialect):
    request = dialect.parse({"model": "m", **HISTORIES[dialect]}, view, {})
    plan = tool_calls.plan(view, request)
    assert plan.parse and plan.limit is None
    prompt = view.render(request.messages, plan.declared, request.reasoning, request.prefill)
    assert prompt.endswith(EXPECTED_TURN), prompt
    assert '{"type": "function", "function": {"name": "get_weather"' in prompt
    # reasoning of turns before the latest user message is dropped, as the template does
    assert "Old thought." not in prompt and "<|im_start|>assistant\nOld.<|im_end|>" in prompt


# --- the default model has no tool convention -----------------------------------------------------

def test_tools_are_dropped_on_a_model_without_a_tool_convention(stack):
    oai = openai.OpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0)
    claude = anthropic.Anthropic(base_url=stack.url, api_key="x", max_retries=0)
    # (not "Which city is ...?": its first word is a near tie that int8 rounding may flip)
    question = "Name the capital city of France."
    reply = oai.chat.completions.create(model="m", messages=[user(question)], tools=CHAT_TOOLS,
                                        temperature=0, max_tokens=30)
    assert "Paris" in reply.choices[0].message.content and not reply.choices[0].message.tool_calls
    plain = oai.chat.completions.create(model="m", messages=[user(question)], temperature=0, max_tokens=30)
    # the declarations never reached the prompt
    assert reply.usage.prompt_tokens == plain.usage.prompt_tokens
    answer = oai.responses.create(model="m", input=question, tools=CODEX_TOOLS,
                                  temperature=0, max_output_tokens=30)
    assert "Paris" in answer.output_text
    counted = claude.messages.count_tokens(model="m", messages=[user(question)], tools=ANTHROPIC_TOOLS)
    assert counted.input_tokens == claude.messages.count_tokens(model="m", messages=[user(question)]).input_tokens


# --- constraints on calls the model chooses, after reasoning, and a matcher failing mid-stream ---

PAINT_LARK = ('start: "*** Begin Patch\\n" line{1,3} "*** End Patch"\n'
              'line: ("+" | "-") WORD LF\n'
              'WORD: /[a-z]{1,6}/\n'
              '%import common.LF\n')
PAINT_TOOL = {"type": "custom", "name": "paint", "description": "Paint a wall by patch",
              "format": {"type": "grammar", "syntax": "lark", "definition": PAINT_LARK}}
CITY_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]}},
               "required": ["city"], "additionalProperties": False}
ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
                 "required": ["answer"], "additionalProperties": False}


def in_lark(grammar: str, text: str) -> bool:
    """Whether text is a sentence of the Lark grammar, checked byte by byte by llguidance."""
    import llguidance as llg
    matcher = llg.LLMatcher(llg.LLTokenizer("byte"), llg.LLMatcher.grammar_from_lark(grammar), log_level=0)
    return matcher.consume_tokens(list(text.encode())) and matcher.is_accepting()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_custom_tool_called_under_auto_keeps_to_its_grammar(oai, stream):
    """The script opens the call and its input string; the model writes the input itself, held to
    the tool's Lark grammar (rewritten as the JSON string's pattern), and the call closes."""
    reply = respond(oai, stream, "Paint it. [[auto-paint]]", tools=[*RESPONSES_TOOLS, PAINT_TOOL],
                    tool_choice="auto", max_output_tokens=200, temperature=1.0,
                    parallel_tool_calls=False)  # the grammar ends the reply after this call
    assert reply.status == "completed", reply
    (call,) = [item for item in reply.output if item.type == "custom_tool_call"]
    assert call.name == "paint" and call.input.startswith("*** Begin Patch\n")
    assert in_lark(PAINT_LARK, call.input), call.input


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_strict_function_called_under_auto_keeps_to_its_schema(oai, claude, stream):
    strict_chat = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY_SCHEMA,
                                                     "strict": True}}]
    reply = chat(oai, stream, [user("Weather? [[auto-strict]]")], tools=strict_chat, temperature=1.0,
                 parallel_tool_calls=False)  # one call: the grammar ends the reply after it
    (call,) = reply.choices[0].message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), CITY_SCHEMA)
    strict_responses = [{"type": "function", "name": "get_weather", "parameters": CITY_SCHEMA, "strict": True}]
    response = respond(oai, stream, "Weather? [[auto-strict]]", tools=strict_responses, temperature=1.0,
                       parallel_tool_calls=False)
    (item,) = response.output
    jsonschema.validate(json.loads(item.arguments), CITY_SCHEMA)
    strict_anthropic = [{"name": "get_weather", "input_schema": CITY_SCHEMA, "strict": True}]
    answer = message(claude, stream, [user("Weather? [[auto-strict]]")], tools=strict_anthropic,
                     tool_choice={"type": "auto", "disable_parallel_tool_use": True})
    (block,) = answer.content
    assert block.type == "tool_use" and answer.stop_reason == "tool_use"
    jsonschema.validate(block.input, CITY_SCHEMA)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_format_holds_only_after_the_reasoning_block(oai, claude, stream):
    """The scripted reasoning is prose a JSON grammar would refuse; the grammar starts at
    </think>, and what the model then writes validates."""
    thought = "I will answer in JSON."
    reply = chat(oai, stream, [user("Sure? [[think-json]]")], reasoning_effort="high", temperature=1.0,
                 response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER_SCHEMA}})
    assert reply.choices[0].message.reasoning_content == thought
    jsonschema.validate(json.loads(reply.choices[0].message.content), ANSWER_SCHEMA)
    response = respond(oai, stream, "Sure? [[think-json]]", reasoning={"effort": "high"}, temperature=1.0,
                       text={"format": {"type": "json_schema", "name": "a", "schema": ANSWER_SCHEMA}})
    assert response.output[0].content[0].text == thought
    jsonschema.validate(json.loads(response.output_text), ANSWER_SCHEMA)
    answer = message(claude, stream, [user("Sure? [[think-json]]")], thinking=THINKING,
                     output_config={"format": {"type": "json_schema", "schema": ANSWER_SCHEMA}})
    assert [block.type for block in answer.content] == ["thinking", "text"]
    assert answer.content[0].thinking == thought
    jsonschema.validate(json.loads(answer.content[1].text), ANSWER_SCHEMA)


def test_a_matcher_failing_mid_stream_ends_that_stream_in_each_dialect(qwen_stack, oai):
    """The script writes what the JSON grammar refuses (a sampled token never can): the stream
    ends with an error in its dialect's shape after the text that was valid, and a stream running
    beside it finishes normally."""
    url = qwen_stack[0].url
    fmt = {"type": "json_object"}
    bodies = {
        "/v1/chat/completions": {"model": "q", "messages": [user("[[broken-json]]")], "max_tokens": 60,
                                 "response_format": fmt},
        "/v1/responses": {"model": "q", "input": "[[broken-json]]", "max_output_tokens": 60,
                          "text": {"format": fmt}},
        "/v1/messages": {"model": "q", "messages": [user("[[broken-json]]")], "max_tokens": 60,
                         "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}},
    }
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        for path, body in bodies.items():
            beside = pool.submit(oai.chat.completions.create, model="q", max_tokens=60,
                                 messages=[user("Report [[weather-result]]")])
            records = sse_data(url, path, body)
            assert beside.result().choices[0].message.content == ANSWER
            text, last = _streamed_text(path, records), records[-1]
            assert text == '{"answer": "yes",', (path, text)
            if path == "/v1/chat/completions":
                assert "grammar" in last["error"]["message"], last
            elif path == "/v1/responses":
                assert last["type"] == "response.failed" and "grammar" in last["response"]["error"]["message"]
            else:
                assert last["type"] == "error" and "grammar" in last["error"]["message"], last
    # not streamed: the error is the whole answer, in the dialect's envelope
    with pytest.raises(openai.InternalServerError) as failed:
        oai.chat.completions.create(**bodies["/v1/chat/completions"])
    assert "grammar" in failed.value.body["message"]


def _streamed_text(path: str, records: list[dict[str, Any]]) -> str:
    if path == "/v1/chat/completions":
        return "".join(r["choices"][0]["delta"].get("content") or "" for r in records if r.get("choices"))
    if path == "/v1/responses":
        return "".join(r["delta"] for r in records if r["type"] == "response.output_text.delta")
    return "".join(r["delta"]["text"] for r in records
                   if r["type"] == "content_block_delta" and r["delta"]["type"] == "text_delta")


def test_auto_holds_calls_only_where_a_tool_is_a_contract(view):
    def grammar_of(**body: Any) -> dict[str, str] | None:
        request = openai_responses.parse({"model": "m", "input": "Hi", **body}, view, {})
        return tool_calls.plan(view, request).grammar

    assert grammar_of(tools=RESPONSES_TOOLS) is None  # nothing to hold: the reply runs free
    held = grammar_of(tools=[*RESPONSES_TOOLS, PAINT_TOOL])
    assert held is not None and held["kind"] == "lark" and '"pattern": "^(?:' in held["source"]
    strict = grammar_of(tools=[{**RESPONSES_TOOLS[0], "strict": True}])
    assert strict is not None and '"enum"' not in strict["source"] and '"city"' in strict["source"]
    recursive = {**PAINT_TOOL, "format": {"type": "grammar", "syntax": "lark",
                                          "definition": 'start: "(" start ")" | "x"'}}
    assert grammar_of(tools=[recursive]) is None  # not regular: its input is left free under auto
    regex_tool = {**PAINT_TOOL, "format": {"type": "grammar", "syntax": "regex", "definition": "[0-9]+"}}
    assert '"pattern": "^(?:[0-9]+)$"' in grammar_of(tools=[regex_tool])["source"]
    # a requested reply format takes precedence: the plan adds no grammar of its own
    request = openai_responses.parse({"model": "m", "input": "Hi", "tools": [PAINT_TOOL],
                                      "text": {"format": {"type": "json_object"}}}, view, {})
    assert tool_calls.plan(view, request).grammar is None and request.grammar["kind"] == "json_object"
