"""Qwen3.5's tool-call syntax (<function=…> and <parameter=…> blocks inside <tool_call>) through
the real stack, in all three dialects.

The model is the tiny random qwen35 (Qwen's vocabulary) served with ``templates/qwen35_xml.jinja``,
a template in that convention whose reply opens a think block. Replies keyed by a marker in the
prompt are scripted (every step still runs the engine); any other request is sampled by the
model itself, so a forced call is the grammar's work alone.
"""

from __future__ import annotations

import json
from pathlib import Path

import anthropic
import openai
import pytest
from test_constrained_output import check_forced_calls, in_lark, user
from conftest import write_script
from tiny_models import write_tiny_gguf

from gateway import tool_calls
from gateway.dialects import openai_chat
from gateway.prompting import ModelView
from shared.conventions import qwen_xml

TEMPLATE = Path(__file__).resolve().parents[1] / "templates" / "qwen35_xml.jinja"
THOUGHT = "I should call the tool."
ANSWER = "It is 22C and sunny in Paris."
WEATHER_CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nSão Paulo\n</parameter>\n"
                "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>")
SCRIPT = {
    "[[call-weather]]": f"{THOUGHT}\n</think>\n\n{WEATHER_CALL}",
    # the call opens while the think block is still open: the reasoning ends there
    "[[call-unclosed]]": f"{THOUGHT}\n{WEATHER_CALL}",
    "[[weather-result]]": f"The result is in.\n</think>\n\n{ANSWER}",
    "[[two-calls]]": "Two cities.\n</think>\n\nBoth.\n" + WEATHER_CALL + "\n" + WEATHER_CALL.replace(
        "São Paulo", "Tōkyō\nand around").replace("\n2\n", "\n5\n"),
}
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
           "required": ["city"]}
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                                 "parameters": WEATHER}}]
RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather for a city",
                    "parameters": WEATHER}]
ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "Weather for a city", "input_schema": WEATHER}]


@pytest.fixture(scope="module")
def qwen35_stack(tmp_path_factory, start_worker, start_gateway):
    folder = tmp_path_factory.mktemp("qwen35")
    model = folder / "tiny-qwen35.gguf"
    write_tiny_gguf(model, "qwen35", context_length=2048)
    script = write_script(folder, SCRIPT)
    worker = start_worker(model, "--scripted-replies", str(script), "--chat-template", str(TEMPLATE),
                          "--ctx", "2048")
    return start_gateway(worker), worker


@pytest.fixture(scope="module")
def oai(qwen35_stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=qwen35_stack[0].url + "/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def claude(qwen35_stack) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=qwen35_stack[0].url, api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def view(qwen35_stack) -> ModelView:
    return ModelView.from_card(qwen35_stack[1].card())


def test_the_template_makes_the_convention(view):
    capabilities = view.card.capabilities
    assert capabilities.convention == "qwen_xml" and capabilities.reasoning
    assert view.render([user("Hi")], reasoning=True).endswith("<|im_start|>assistant\n<think>\n")


def test_a_body_is_read_by_its_tools_schemas():
    schemas = {"get_weather": WEATHER, "plan": {"properties": {"steps": {"type": "array"}, "note": {}}}}
    body = WEATHER_CALL.removeprefix("<tool_call>").removesuffix("</tool_call>")
    assert qwen_xml.parse_call(body, schemas) == ("get_weather", {"city": "São Paulo", "days": 2})
    # a string stays text even when it reads as JSON; other values are JSON where they read so
    typed = "<function=get_weather>\n<parameter=city>\n42\n</parameter>\n</function>"
    assert qwen_xml.parse_call(typed, schemas) == ("get_weather", {"city": "42"})
    listed = ("<function=plan>\n<parameter=steps>\n[1, \"two\"]\n</parameter>\n<parameter=note>\n"
              "line one\nline two\n</parameter>\n</function>")
    assert qwen_xml.parse_call(listed, schemas) == ("plan", {"steps": [1, "two"], "note": "line one\nline two"})
    assert qwen_xml.parse_call("<function=plan>\n</function>", schemas) == ("plan", {})
    for broken in ("get_weather(city=1)", "<function=>\n</function>",
                   "<function=plan>\nstray<parameter=note>\nx\n</parameter>\n</function>",
                   "<function=plan>\n<parameter=note>\nx\n</function>"):
        assert qwen_xml.parse_call(broken, schemas) is None, broken


def test_the_forced_grammar_holds_a_call_to_its_schema():
    grammar = qwen_xml.lark([("get_weather", {**WEATHER, "properties": {
        "city": {"type": "string", "maxLength": 8}, "days": {"type": "integer"}, "unit": {"enum": ["C", "F"]}}})],
        "<tc>", "</tc>", parallel=False).replace("<tc>", '"<tc>"').replace("</tc>", '"</tc>"')
    call = "<tc>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n{}</function>\n</tc>"
    assert in_lark(grammar, call.format(""))
    assert in_lark(grammar, call.format("<parameter=days>\n3\n</parameter>\n<parameter=unit>\nF\n</parameter>\n"))
    assert not in_lark(grammar, call.format("<parameter=days>\nthree\n</parameter>\n"))  # not an integer
    assert not in_lark(grammar, call.format("<parameter=unit>\nK\n</parameter>\n"))  # not in the enum
    assert not in_lark(grammar, call.replace("Paris", "Llanfairpwll"))  # past maxLength
    assert not in_lark(grammar, call.format("").replace("<parameter=city>\nParis\n</parameter>\n", ""))  # required


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_round_trip(oai, view, stream):
    def chat(messages, **extra):
        kwargs = dict(model="qwen", messages=messages, tools=CHAT_TOOLS, max_tokens=120, **extra)
        if not stream:
            return oai.chat.completions.create(**kwargs).choices[0]
        with oai.chat.completions.stream(**kwargs) as events:
            for _ in events:
                pass
            return events.get_final_completion().choices[0]

    for marker in ("[[call-weather]]", "[[call-unclosed]]"):
        question = [user(f"Weather in São Paulo? {marker}")]
        first = chat(question, reasoning_effort="medium")
        assert first.finish_reason == "tool_calls" and first.message.reasoning_content == THOUGHT
        assert not first.message.content
        [call] = first.message.tool_calls
        assert call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == {"city": "São Paulo", "days": 2}
    history = question + [
        {"role": "assistant", "content": None, "reasoning_content": THOUGHT,
         "tool_calls": [{"id": call.id, "type": "function",
                         "function": {"name": "get_weather", "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "22C and sunny [[weather-result]]"}]
    # the call goes back into the prompt in the model's own syntax
    assert WEATHER_CALL in view.render(openai_chat.parse({"model": "m", "messages": history}, view, {}).messages)
    second = chat(history, reasoning_effort="medium")
    assert second.message.content == ANSWER and second.finish_reason == "stop"
    both = chat([user("[[two-calls]]")], reasoning_effort="medium")
    assert both.message.content == "Both."
    assert [json.loads(c.function.arguments) for c in both.message.tool_calls] == [
        {"city": "São Paulo", "days": 2}, {"city": "Tōkyō\nand around", "days": 5}]


def test_responses_and_messages_read_the_calls(oai, claude):
    response = oai.responses.create(model="qwen", input=[user("Weather? [[call-weather]]")], tools=RESPONSES_TOOLS,
                                    reasoning={"effort": "medium"}, max_output_tokens=120)
    assert [item.type for item in response.output] == ["reasoning", "function_call"]
    assert json.loads(response.output[1].arguments) == {"city": "São Paulo", "days": 2}
    with claude.messages.stream(model="claude-sonnet-4-6", max_tokens=2000, tools=ANTHROPIC_TOOLS,
                                messages=[user("Weather? [[call-unclosed]]")],
                                thinking={"type": "enabled", "budget_tokens": 1024}) as events:
        message = events.get_final_message()
    thinking, use = message.content
    assert message.stop_reason == "tool_use" and thinking.thinking == THOUGHT
    assert use.type == "tool_use" and use.input == {"city": "São Paulo", "days": 2}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_forced_calls_are_tag_calls_that_keep_to_their_schemas(view, oai, claude, stream):
    """Nothing scripted: the random model writes whatever the grammar of its own call syntax
    lets it, and every dialect gets a call valid for its tool."""
    forced = openai_chat.parse({"model": "m", "messages": [user("?")], "tools": CHAT_TOOLS,
                                "tool_choice": "required"}, view, {})
    plan = tool_calls.plan(view, forced)
    assert plan.call_format == "qwen_xml" and '"<function=get_weather>\\n"' in plan.grammar["source"]
    check_forced_calls(oai, claude, stream, max_tokens=80)
