"""A nanochat checkpoint directory served with ``--nanochat DIR``, in all three dialects.

The tiny native checkpoint (``tiny_nanochat.py``) with scripted replies keyed by a marker in
the prompt; anything else the model samples itself. Its calculator convention,
``<|python_start|>code<|python_end|>``, comes back as a call of the request's calculator tool.
"""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import openai
import pytest
from conftest import write_script
from tiny_nanochat import write_tiny_nanochat

from gateway import tool_calls
from gateway.dialects import openai_chat
from gateway.prompting import ModelView

ANSWER = "Two and two make four."
SCRIPT = {"[[calc]]": "Let me work it out.<|python_start|>2+2<|python_end|>", "[[calc-result]]": ANSWER}
CALCULATOR = {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}
CHAT_TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic",
                                                 "parameters": CALCULATOR}}]
RESPONSES_TOOLS = [{"type": "function", "name": "calculator", "description": "Evaluate arithmetic",
                    "parameters": CALCULATOR}]
ANTHROPIC_TOOLS = [{"name": "calculator", "description": "Evaluate arithmetic", "input_schema": CALCULATOR}]


@pytest.fixture(scope="module")
def nanochat_stack(tmp_path_factory, start_worker, start_gateway):
    folder = tmp_path_factory.mktemp("nanochat")
    checkpoint = folder / "checkpoint"
    write_tiny_nanochat(checkpoint, "native")
    script = write_script(folder, SCRIPT)
    # the directory as the model and through --nanochat, which may name it again
    worker = start_worker(checkpoint, "--nanochat", str(checkpoint), "--scripted-replies", str(script),
                          "--ctx", "256")
    return start_gateway(worker), worker


@pytest.fixture(scope="module")
def oai(nanochat_stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=nanochat_stack[0].url + "/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def view(nanochat_stack) -> ModelView:
    return ModelView.from_card(nanochat_stack[1].card())


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def test_the_card_and_the_turns(view):
    capabilities = view.card.capabilities
    assert view.card.architecture == "nanochat" and capabilities.convention == "nanochat"
    assert not capabilities.reasoning
    assert view.render([{"role": "system", "content": "Be brief."}, user("Hi")]) == (
        "<|bos|><|user_start|>Be brief.\n\nHi<|user_end|><|assistant_start|>")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_calculator_round_trip(oai, view, stream):
    def chat(messages):
        kwargs = {"model": "nanochat", "messages": messages, "tools": CHAT_TOOLS, "max_tokens": 60}
        if not stream:
            return oai.chat.completions.create(**kwargs).choices[0]
        with oai.chat.completions.stream(**kwargs) as events:
            for _ in events:
                pass
            return events.get_final_completion().choices[0]

    question = [user("What is 2+2? [[calc]]")]
    first = chat(question)
    assert first.finish_reason == "tool_calls" and first.message.content == "Let me work it out."
    [call] = first.message.tool_calls
    assert call.function.name == "calculator" and json.loads(call.function.arguments) == {"expression": "2+2"}
    history = question + [
        {"role": "assistant", "content": first.message.content, "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": "calculator",
                                                              "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "4 [[calc-result]]"}]
    request = openai_chat.parse({"model": "m", "messages": history, "tools": CHAT_TOOLS}, view, {})
    prompt = view.render(request.messages, tool_calls.plan(view, request).declared)
    assert prompt.endswith("<|assistant_start|>Let me work it out.<|python_start|>2+2<|python_end|>"
                           "<|output_start|>4 [[calc-result]]<|output_end|>"), prompt
    second = chat(history)
    assert second.message.content == ANSWER and second.finish_reason == "stop"


def test_responses_and_anthropic_get_the_call_in_their_shapes(nanochat_stack, oai):
    response = oai.responses.create(model="nanochat", input="What is 2+2? [[calc]]", tools=RESPONSES_TOOLS,
                                    max_output_tokens=60)
    calls = [item for item in response.output if item.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("calculator", {"expression": "2+2"})]
    claude = anthropic.Anthropic(base_url=nanochat_stack[0].url, api_key="x", max_retries=0)
    message = claude.messages.create(model="nanochat", max_tokens=60, tools=ANTHROPIC_TOOLS,
                                     messages=[user("What is 2+2? [[calc]]")])
    assert message.stop_reason == "tool_use"
    assert [(b.type, getattr(b, "input", None)) for b in message.content] == [
        ("text", None), ("tool_use", {"expression": "2+2"})]


def test_a_forced_call_is_a_calculator_call(oai):
    """Nothing scripted: under tool_choice required the model can only write a calculator call."""
    reply = oai.chat.completions.create(model="nanochat", messages=[user("Compute something.")], tools=CHAT_TOOLS,
                                        tool_choice="required", parallel_tool_calls=False, max_tokens=256,
                                        temperature=0).choices[0]
    assert reply.finish_reason == "tool_calls", reply
    [call] = reply.message.tool_calls
    expression = json.loads(call.function.arguments)["expression"]
    assert call.function.name == "calculator" and expression.strip() and "\n" not in expression


def test_without_tools_the_markers_stay_text_and_the_reply_stops_at_the_output(nanochat_stack):
    reply = httpx.post(nanochat_stack[0].url + "/v1/chat/completions", timeout=60, json={
        "model": "m", "messages": [user("What is 2+2? [[calc]]")], "max_tokens": 60}).json()
    choice = reply["choices"][0]
    assert choice["message"]["content"] == "Let me work it out.<|python_start|>2+2<|python_end|>"
    assert choice["finish_reason"] == "stop"
