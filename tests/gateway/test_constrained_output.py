"""Constrained output through the real stack, in all three dialects, with the official SDKs.

Two models: the default one (SmolLM2, no tool convention: forced calls use the generic JSON call
format) and the tiny random qwen3 (Hermes convention), whose worker runs free: only the grammar
makes its replies well formed. Schemas are bounded (maxLength, enum, maxItems) so that a random
model cannot wander inside a JSON string until max_tokens.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
from typing import Any

import anthropic
import httpx
import jsonschema
import llguidance as llg
import openai
import pytest
from tiny_models import write_tiny_gguf

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["C", "F"]}},
           "required": ["city", "unit"], "additionalProperties": False}
REPORT = {"type": "object", "properties": {"sunny": {"type": "boolean"},
                                           "tags": {"type": "array", "items": {"enum": ["warm", "cold"]},
                                                    "maxItems": 2}},
          "required": ["sunny", "tags"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
CHAT_TOOLS = [{"type": "function", "function": {"name": name, "description": f"{name} of a place", "parameters": schema,
                                                 "strict": True}} for name, schema in SCHEMAS.items()]
RESPONSES_TOOLS = [{"type": "function", "name": name, "description": f"{name} of a place", "parameters": schema,
                    "strict": True} for name, schema in SCHEMAS.items()]
ANTHROPIC_TOOLS = [{"name": name, "description": f"{name} of a place", "input_schema": schema}
                   for name, schema in SCHEMAS.items()]
REGEX = r"(yes|no), [a-z]{1,8}\."
LARK = 'start: "color: " COLOR "."\nCOLOR: "red" | "green" | "blue"\n'
BAD_SCHEMA = {"type": "object", "properties": {"when": {"type": "string", "format": "no-such-format"}}}
QUESTION = "What is the weather in Paris?"


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def in_lark(grammar: str, text: str) -> bool:
    """Whether text is a sentence of the Lark grammar (checked byte by byte with llguidance)."""
    matcher = llg.LLMatcher(llg.LLTokenizer("byte"), llg.LLMatcher.grammar_from_lark(grammar))
    return matcher.consume_tokens(list(text.encode())) and matcher.is_accepting()


def check_call(name: str, arguments: str | dict[str, Any]) -> None:
    value = json.loads(arguments) if isinstance(arguments, str) else arguments
    jsonschema.validate(value, SCHEMAS[name])


# --- the three dialects' calls, whole or streamed through the SDK helpers -------------------

def chat_reply(client: openai.OpenAI, stream: bool, **kwargs: Any) -> Any:
    kwargs = {"model": "m", "temperature": 0, **kwargs}
    if not stream:
        return client.chat.completions.create(**kwargs).choices[0]
    with client.chat.completions.stream(**kwargs) as events:
        for _ in events:
            pass
        return events.get_final_completion().choices[0]


def responses_reply(client: openai.OpenAI, stream: bool, **kwargs: Any) -> Any:
    kwargs = {"model": "m", "temperature": 0, **kwargs}
    if not stream:
        return client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as events:
        for _ in events:
            pass
        return events.get_final_response()


def messages_reply(client: anthropic.Anthropic, stream: bool, **kwargs: Any) -> Any:
    # anthropic >= 1.0 has no temperature parameter; the server still takes it
    kwargs = {"model": "m", **kwargs, "extra_body": {"temperature": 0, **kwargs.get("extra_body", {})}}
    if not stream:
        return client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as events:
        for _ in events:
            pass
        return events.get_final_message()


def text_of(message: Any) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def check_forced_calls(oai: openai.OpenAI, claude: anthropic.Anthropic, stream: bool, max_tokens: int) -> None:
    """Forced calls in every dialect come back as the dialect's own calls, valid for their tool."""
    named = {"type": "function", "function": {"name": "get_time"}}
    for choice, names in (("required", set(SCHEMAS)), (named, {"get_time"})):
        reply = chat_reply(oai, stream, messages=[user(QUESTION)], tools=CHAT_TOOLS, tool_choice=choice,
                           parallel_tool_calls=False, max_tokens=max_tokens)
        assert reply.finish_reason == "tool_calls", reply
        assert len(reply.message.tool_calls) == 1
        call = reply.message.tool_calls[0].function
        assert call.name in names
        check_call(call.name, call.arguments)
    for choice, names in (("required", set(SCHEMAS)), ({"type": "function", "name": "get_weather"}, {"get_weather"})):
        response = responses_reply(oai, stream, input=QUESTION, tools=RESPONSES_TOOLS, tool_choice=choice,
                                   parallel_tool_calls=False, max_output_tokens=max_tokens)
        calls = [item for item in response.output if item.type == "function_call"]
        assert response.status == "completed" and len(calls) == 1, response
        assert calls[0].name in names
        check_call(calls[0].name, calls[0].arguments)
    for choice, names in (({"type": "any", "disable_parallel_tool_use": True}, set(SCHEMAS)),
                          ({"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
                           {"get_weather"})):
        message = messages_reply(claude, stream, messages=[user(QUESTION)], tools=ANTHROPIC_TOOLS,
                                 tool_choice=choice, max_tokens=max_tokens)
        uses = [block for block in message.content if block.type == "tool_use"]
        assert message.stop_reason == "tool_use" and len(uses) == 1, message
        assert uses[0].name in names
        check_call(uses[0].name, uses[0].input)


# --- the default model ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def oai(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def claude(stack) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=stack.url, api_key="x", max_retries=0)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_json_schema_in_every_dialect(oai, claude, stream):
    ask = [user("Describe the weather in Paris as JSON.")]
    reply = chat_reply(oai, stream, messages=ask, max_tokens=40, response_format={
        "type": "json_schema", "json_schema": {"name": "report", "schema": REPORT, "strict": True}})
    jsonschema.validate(json.loads(reply.message.content), REPORT)
    assert reply.finish_reason == "stop"
    response = responses_reply(oai, stream, input=ask, max_output_tokens=40, text={
        "format": {"type": "json_schema", "name": "report", "schema": REPORT, "strict": False}})
    jsonschema.validate(json.loads(response.output_text), REPORT)
    assert response.text.format.type == "json_schema"
    message = messages_reply(claude, stream, messages=ask, max_tokens=40,
                             output_config={"format": {"type": "json_schema", "schema": REPORT}})
    jsonschema.validate(json.loads(text_of(message)), REPORT)
    assert message.stop_reason == "end_turn"
    older = messages_reply(claude, stream, messages=ask, max_tokens=40,
                           extra_body={"output_format": {"type": "json_schema", "schema": WEATHER}})
    jsonschema.validate(json.loads(text_of(older)), WEATHER)


def test_json_object(oai):
    reply = chat_reply(oai, False, messages=[user('Answer with the JSON {"ok": true}.')], max_tokens=40,
                       response_format={"type": "json_object"})
    assert isinstance(json.loads(reply.message.content), dict)
    response = responses_reply(oai, False, input='Answer with the JSON {"ok": true}.', max_output_tokens=40,
                               text={"format": {"type": "json_object"}})
    assert isinstance(json.loads(response.output_text), dict)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_regex_and_lark_extension_in_every_dialect(oai, claude, stream):
    for grammar, check in (({"type": "regex", "definition": REGEX}, lambda text: re.fullmatch(REGEX, text)),
                           ({"type": "lark", "definition": LARK}, lambda text: in_lark(LARK, text))):
        extension = {"grammar": grammar}
        chat = chat_reply(oai, stream, messages=[user("Is it sunny?")], max_tokens=20, extra_body=extension)
        assert check(chat.message.content), chat.message.content
        response = responses_reply(oai, stream, input="Is it sunny?", max_output_tokens=20, extra_body=extension)
        assert check(response.output_text), response.output_text
        message = messages_reply(claude, stream, messages=[user("Is it sunny?")], max_tokens=20,
                                 extra_body=extension)
        assert check(text_of(message)), message.content


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_forced_calls_use_the_generic_json_format(oai, claude, stream):
    check_forced_calls(oai, claude, stream, max_tokens=40)


def test_a_forced_custom_tool_returns_its_grammar_as_input(oai):
    tool = {"type": "custom", "name": "paint", "description": "Paints the wall",
            "format": {"type": "grammar", "syntax": "lark", "definition": LARK}}
    for stream in (False, True):
        response = responses_reply(oai, stream, input="Paint it.", tools=[tool],
                                   tool_choice={"type": "custom", "name": "paint"}, max_output_tokens=20)
        calls = [item for item in response.output if item.type == "custom_tool_call"]
        assert len(calls) == 1 and calls[0].name == "paint", response.output
        assert in_lark(LARK, calls[0].input), calls[0].input


def test_what_does_not_compile_is_a_400_in_each_envelope(stack, oai, claude):
    bad_formats = [
        lambda: oai.chat.completions.create(model="m", messages=[user("Hi")], max_tokens=5, response_format={
            "type": "json_schema", "json_schema": {"name": "bad", "schema": BAD_SCHEMA}}),
        lambda: oai.responses.create(model="m", input="Hi", max_output_tokens=5, text={
            "format": {"type": "json_schema", "name": "bad", "schema": BAD_SCHEMA}}),
        lambda: oai.chat.completions.create(model="m", messages=[user("Hi")], max_tokens=5,
                                            extra_body={"grammar": {"type": "lark", "definition": "start: ("}}),
        lambda: claude.messages.create(model="m", messages=[user("Hi")], max_tokens=5,
                                       output_config={"format": {"type": "json_schema", "schema": BAD_SCHEMA}}),
        lambda: claude.messages.create(model="m", messages=[user("Hi")], max_tokens=5,
                                       extra_body={"grammar": {"type": "regex", "definition": "(unclosed"}}),
    ]
    for attempt in bad_formats:
        with pytest.raises((openai.BadRequestError, anthropic.BadRequestError)) as error:
            attempt()
        assert error.value.status_code == 400
        body = error.value.body
        if isinstance(error.value, anthropic.BadRequestError):
            assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
        else:
            assert body["type"] == "invalid_request_error", body
    # a format and the grammar extension at once cannot both hold
    both = httpx.post(stack.url + "/v1/chat/completions", timeout=30, json={
        "model": "m", "messages": [user("Hi")], "max_tokens": 5, "response_format": {"type": "json_object"},
        "grammar": {"type": "regex", "definition": "a"}})
    assert both.status_code == 400 and both.json()["error"]["param"] == "grammar"
    unknown = httpx.post(stack.url + "/v1/messages", timeout=30, json={
        "model": "m", "messages": [user("Hi")], "max_tokens": 5, "tools": ANTHROPIC_TOOLS,
        "tool_choice": {"type": "tool", "name": "nope"}})
    assert unknown.status_code == 400 and unknown.json()["error"]["type"] == "invalid_request_error"


# --- the tiny random qwen3: Hermes calls, nothing scripted ----------------------------------

@pytest.fixture(scope="module")
def qwen(tmp_path_factory, start_worker, start_gateway) -> tuple[openai.OpenAI, anthropic.Anthropic]:
    model = tmp_path_factory.mktemp("free-qwen3") / "tiny-qwen3.gguf"
    write_tiny_gguf(model, "qwen3", context_length=4096)
    gateway = start_gateway(start_worker(model, "--batch", "4", "--ctx", "4096"))
    return (openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0),
            anthropic.Anthropic(base_url=gateway.url, api_key="x", max_retries=0))


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_forced_hermes_calls_on_qwen3(qwen, stream):
    check_forced_calls(*qwen, stream, max_tokens=60)


def test_parallel_forced_calls_on_qwen3_all_validate(qwen):
    oai, _ = qwen
    reply = chat_reply(oai, False, messages=[user(QUESTION)], tools=CHAT_TOOLS, tool_choice="required",
                       max_tokens=80)
    assert reply.message.tool_calls, reply
    for call in reply.message.tool_calls:
        check_call(call.function.name, call.function.arguments)


def test_json_schema_and_regex_on_qwen3(qwen):
    oai, claude = qwen
    reply = chat_reply(oai, True, messages=[user("Report.")], max_tokens=40, response_format={
        "type": "json_schema", "json_schema": {"name": "report", "schema": REPORT}})
    jsonschema.validate(json.loads(reply.message.content), REPORT)
    message = messages_reply(claude, False, messages=[user("Yes or no?")], max_tokens=20,
                             extra_body={"grammar": {"type": "regex", "definition": REGEX}})
    assert re.fullmatch(REGEX, text_of(message)), message.content


def test_four_grammars_and_a_free_stream_at_once_on_qwen3(qwen):
    """Four differently constrained requests and one free one, sent together to a worker that
    batches four: every constrained reply keeps to its own grammar and the free one finishes."""
    oai, claude = qwen
    jobs = {
        "schema": lambda: chat_reply(oai, True, messages=[user("Report.")], max_tokens=40, response_format={
            "type": "json_schema", "json_schema": {"name": "report", "schema": REPORT}}).message.content,
        "regex": lambda: text_of(messages_reply(claude, True, messages=[user("Yes or no?")], max_tokens=20,
                                                extra_body={"grammar": {"type": "regex", "definition": REGEX}})),
        "lark": lambda: responses_reply(oai, True, input="A colour?", max_output_tokens=20,
                                        extra_body={"grammar": {"type": "lark", "definition": LARK}}).output_text,
        "call": lambda: chat_reply(oai, False, messages=[user(QUESTION)], tools=CHAT_TOOLS,
                                   tool_choice={"type": "function", "function": {"name": "get_time"}},
                                   parallel_tool_calls=False, max_tokens=60).message.tool_calls,
        "free": lambda: chat_reply(oai, False, messages=[user("Say anything.")], max_tokens=12),
    }
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        futures = {name: pool.submit(job) for name, job in jobs.items()}
        results = {name: future.result(timeout=300) for name, future in futures.items()}
    jsonschema.validate(json.loads(results["schema"]), REPORT)
    assert re.fullmatch(REGEX, results["regex"]), results["regex"]
    assert in_lark(LARK, results["lark"]), results["lark"]
    (call,) = results["call"]
    assert call.function.name == "get_time"
    check_call("get_time", call.function.arguments)
    assert results["free"].finish_reason in ("stop", "length")
