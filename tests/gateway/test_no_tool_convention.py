"""Tools sent to a model without a tool-call convention (SmolLM2, the shared stack's model): the
reply says so in an ``x-lmserve-warning`` header, in every dialect, whole or streamed, and the
gateway logs it once for the model. A request without tools gets no such header."""

from __future__ import annotations

import anthropic
import openai
import pytest
from weather_tools import weather_tools

from gateway.app import NO_TOOL_CONVENTION, WARNING_HEADER

CHAT_TOOLS, RESPONSES_TOOLS, ANTHROPIC_TOOLS = weather_tools()
ASK = "What is the weather in Paris?"
LOGGED = "has no tool-call convention"


@pytest.fixture(scope="module")
def clients(stack) -> tuple[openai.OpenAI, anthropic.Anthropic]:
    return (openai.OpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0),
            anthropic.Anthropic(base_url=stack.url, api_key="x", max_retries=0))


def test_the_stack_model_has_no_tool_convention(stack_worker):
    # the premise: otherwise this file tests nothing
    assert stack_worker.card().capabilities.tool_call_tags is None


def test_every_dialect_flags_tools_the_model_cannot_call(stack, clients):
    oai, claude = clients
    chat = oai.chat.completions.with_raw_response.create(
        model="m", messages=[{"role": "user", "content": ASK}], tools=CHAT_TOOLS, max_tokens=4)
    responses = oai.responses.with_raw_response.create(model="m", input=ASK, tools=RESPONSES_TOOLS,
                                                       max_output_tokens=16)
    messages = claude.messages.with_raw_response.create(
        model="m", messages=[{"role": "user", "content": ASK}], tools=ANTHROPIC_TOOLS, max_tokens=4)
    with claude.messages.with_streaming_response.create(
            model="m", messages=[{"role": "user", "content": ASK}], tools=ANTHROPIC_TOOLS, max_tokens=4,
            stream=True) as streamed:
        streamed_header = streamed.headers.get(WARNING_HEADER)
        streamed.read()
    with oai.chat.completions.with_streaming_response.create(
            model="m", messages=[{"role": "user", "content": ASK}], tools=CHAT_TOOLS, max_tokens=4,
            stream=True) as chat_streamed:
        chat_streamed_header = chat_streamed.headers.get(WARNING_HEADER)
        chat_streamed.read()
    for raw in (chat, responses, messages):
        assert raw.headers.get(WARNING_HEADER) == NO_TOOL_CONVENTION
    assert streamed_header == chat_streamed_header == NO_TOOL_CONVENTION
    # the replies themselves are plain chat, as before
    assert chat.parse().choices[0].message.tool_calls is None
    assert responses.parse().status in ("completed", "incomplete")
    assert all(block.type == "text" for block in messages.parse().content)
    # a forced call is still made (the generic JSON call), and still flagged
    forced = oai.chat.completions.with_raw_response.create(
        model="m", messages=[{"role": "user", "content": ASK}], tools=CHAT_TOOLS, tool_choice="required",
        temperature=0, max_tokens=100)
    assert forced.headers.get(WARNING_HEADER) == NO_TOOL_CONVENTION
    assert forced.parse().choices[0].message.tool_calls[0].function.name == "get_weather"
    # one line in the gateway's log for the model, however many such requests came
    assert stack.log_path.read_text(encoding="utf-8", errors="replace").count(LOGGED) == 1


def test_a_request_without_tools_is_not_flagged(clients):
    oai, claude = clients
    chat = oai.chat.completions.with_raw_response.create(
        model="m", messages=[{"role": "user", "content": ASK}], max_tokens=4)
    messages = claude.messages.with_raw_response.create(
        model="m", messages=[{"role": "user", "content": ASK}], max_tokens=4)
    assert WARNING_HEADER not in chat.headers and WARNING_HEADER not in messages.headers
