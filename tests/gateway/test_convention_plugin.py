"""A convention declared here, in the test, and nowhere else: registered with one ``register()``
call, it is detected in the model's vocabulary and template and served in all three dialects,
through the official SDKs.

The convention, "angle", writes reasoning between ``<<think>>`` tags and each call as JSON
between ``<<call>>`` tags. The model is the tiny random qwen3 with the Qwen vocabulary whose
Hermes tokens are renamed to angle's (so no built-in convention claims it) and the Qwen3 test
template written with angle's tags; its replies are scripted.

The worker and the gateway run in this process, each in a thread (a real ZeroMQ wire on
loopback between them, real uvicorn in front of the gateway), so the convention registered here
is the one both of them know: nothing is passed to them that a child process would have to
import.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import llguidance as llg
import openai
import pytest
import tiny_models
import uvicorn
from conftest import REPO, free_port, write_script
from qwen_vocab import qwen_vocab_metadata
from weather_tools import THINKING, weather_tools

from gateway import tool_calls
from gateway.app import GatewaySettings, create_app
from gateway.dialects import openai_chat
from gateway.prompting import ModelView
from shared import conventions
from shared.chat_template import ChatTemplate
from shared.conventions.base import Convention
from shared.conventions.calls import CallSyntax, json_call_schema, parse_json_call
from shared.protocol import PROTOCOL_VERSION, Capabilities, ModelCard, Tags
from shared.tokenizer import Tokenizer
from worker.capabilities import convention, has_reasoning_switch, tool_call_tags
from worker.engine import Engine
from worker.grammar import GrammarEngine
from worker.scheduler import SchedulerSettings
from worker.scripted import ScriptedReplies
from worker.server import WorkerServer, WorkerSettings

THINK = Tags("<<think>>", "<</think>>")
CALLS = Tags("<<call>>", "<</call>>")
RESULTS = Tags("<<result>>", "<</result>>")


class Angle(Convention):
    name = "angle"
    reasoning = THINK
    calls = CALLS
    reasoning_tokens = (THINK.open, THINK.close)
    call_tokens = (CALLS.open, CALLS.close)
    declares_tools = ("tools", CALLS.open)

    def call_syntax(self, tools: list[dict[str, Any]], forced: list[dict[str, Any]] | None) -> CallSyntax:
        return CallSyntax('"', "\\", True, parse_json_call)

    def calls_lark(self, tokenizer: Tokenizer, functions: list[tuple[str, dict[str, Any]]], parallel: bool,
                   optional: bool = False, thinking: bool = False) -> str:
        alternatives = " | ".join(f"fn_{i}" for i in range(len(functions)))
        rules = "\n".join(f"fn_{i}: %json {json.dumps(json_call_schema(name, arguments))}"
                          for i, (name, arguments) in enumerate(functions))
        start = "start: TEXT tc?\nTEXT: /(.|\\n)*/" if optional else f"start: tc{'+' if parallel else ''}"
        open_id, close_id = (tokenizer.piece_to_id(tag) for tag in (CALLS.open, CALLS.close))
        return f"{start}\ntc: <[{open_id}]> ({alternatives}) <[{close_id}]>\n{rules}\n"


RENAMED = {"<think>": THINK.open, "</think>": THINK.close, "<tool_call>": CALLS.open,
           "</tool_call>": CALLS.close, "<tool_response>": RESULTS.open, "</tool_response>": RESULTS.close}
TEMPLATE = (REPO / "tests" / "templates" / "qwen3_hermes.jinja").read_text(encoding="utf-8")
for hermes_tag, angle_tag in RENAMED.items():
    TEMPLATE = TEMPLATE.replace(hermes_tag, angle_tag)

THOUGHT = "I should look it up."
CALL = CALLS.open + json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}}) + CALLS.close
ANSWER = "It is 22C and sunny in Paris."
SCRIPT = {"[[angle-call]]": f"{THINK.open}{THOUGHT}{THINK.close}\n\n{CALL}", "[[angle-result]]": ANSWER}
RESULT = "22C and sunny [[angle-result]]"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CHAT_TOOLS, RESPONSES_TOOLS, ANTHROPIC_TOOLS = weather_tools(WEATHER)


def angle_vocabulary() -> dict[str, Any]:
    """The Qwen vocabulary with its Hermes tokens renamed to angle's, and the template above."""
    metadata = dict(qwen_vocab_metadata())
    metadata["tokenizer.ggml.tokens"] = [RENAMED.get(token, token) for token in metadata["tokenizer.ggml.tokens"]]
    metadata["tokenizer.chat_template"] = TEMPLATE
    return metadata


@pytest.fixture(scope="module")
def angle() -> Iterator[Angle]:
    registered = conventions.register(Angle())
    yield registered
    conventions.unregister(registered.name)


def serve_in_thread(server: uvicorn.Server) -> threading.Thread:
    thread = threading.Thread(target=server.run, name="gateway", daemon=True)
    thread.start()
    return thread


@pytest.fixture(scope="module")
def angle_stack(angle, tmp_path_factory) -> Iterator[tuple[str, WorkerServer]]:
    """A gateway's URL and the worker it is in front of, serving the angle model, both in this
    process."""
    folder = tmp_path_factory.mktemp("angle")
    model = folder / "tiny-angle.gguf"
    vocabularies = tiny_models.vocab_metadata
    with pytest.MonkeyPatch.context() as patch:  # the file is written with angle's vocabulary
        patch.setattr(tiny_models, "vocab_metadata",
                      lambda name: angle_vocabulary() if name == "angle" else vocabularies(name))
        tiny_models.write_tiny_gguf(model, "qwen3", vocab="angle", context_length=2048)
    engine = Engine.load(model)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    worker = WorkerServer(engine, WorkerSettings(endpoint=endpoint, scheduler=SchedulerSettings(
        ctx=2048, scripted_replies=ScriptedReplies.load(write_script(folder, SCRIPT), engine.tokenizer))))
    worker_thread = threading.Thread(target=worker.serve_forever, name="worker", daemon=True)
    worker_thread.start()
    port = free_port()
    gateway = uvicorn.Server(uvicorn.Config(create_app(GatewaySettings(worker=endpoint, ping_interval=0.5)),
                                            host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    gateway_thread = serve_in_thread(gateway)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the in-process stack did not get ready"
        time.sleep(0.2)
    yield url, worker
    gateway.should_exit = True
    gateway_thread.join(30)
    worker.stop()
    worker_thread.join(30)


@pytest.fixture(scope="module")
def oai(angle_stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=angle_stack[0] + "/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def claude(angle_stack) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=angle_stack[0], api_key="x", max_retries=0)


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def test_the_registered_convention_is_detected_and_no_other_claims_the_model(angle):
    tokenizer = Tokenizer.from_gguf_metadata(angle_vocabulary())
    template = ChatTemplate(TEMPLATE)
    assert convention(tokenizer, template) is angle
    assert has_reasoning_switch(tokenizer, template) and tool_call_tags(tokenizer, template) == CALLS
    conventions.unregister(angle.name)
    try:  # without it the model would follow Hermes, whose markers it lacks: no calls at all
        assert convention(tokenizer, template).name == "hermes" and tool_call_tags(tokenizer, template) is None
    finally:
        conventions.register(angle)


def test_the_card_names_the_convention(angle_stack):
    capabilities = angle_stack[1].card.capabilities
    assert capabilities.convention == "angle" and capabilities.tool_call_tags == CALLS
    assert capabilities.reasoning and capabilities.reasoning_tags == THINK


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_reads_angle_reasoning_and_calls(oai, stream):
    kwargs = dict(model="m", messages=[user("Weather in Paris? [[angle-call]]")], tools=CHAT_TOOLS,
                  reasoning_effort="high", max_tokens=120)
    if stream:
        with oai.chat.completions.stream(**kwargs) as events:
            for _ in events:
                pass
            choice = events.get_final_completion().choices[0]
    else:
        choice = oai.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    assert getattr(choice.message, "reasoning_content", None) == THOUGHT
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    history = [user("Weather in Paris? [[angle-call]]"),
               {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": RESULT}]
    second = oai.chat.completions.create(model="m", messages=history, tools=CHAT_TOOLS, max_tokens=60)
    assert second.choices[0].message.content == ANSWER


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_responses_read_angle_reasoning_and_calls(oai, stream):
    kwargs = dict(model="m", input="Weather in Paris? [[angle-call]]", tools=RESPONSES_TOOLS,
                  reasoning={"effort": "high"}, max_output_tokens=120)
    if stream:
        with oai.responses.stream(**kwargs) as events:
            for _ in events:
                pass
            response = events.get_final_response()
    else:
        response = oai.responses.create(**kwargs)
    kinds = [item.type for item in response.output]
    assert kinds == ["reasoning", "function_call"], kinds
    assert response.output[0].content[0].text == THOUGHT
    call = response.output[1]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_messages_read_angle_reasoning_and_calls(claude, stream):
    kwargs = dict(model="m", max_tokens=1500, tools=ANTHROPIC_TOOLS, thinking=THINKING,
                  messages=[user("Weather in Paris? [[angle-call]]")])
    if stream:
        with claude.messages.stream(**kwargs) as events:
            for _ in events:
                pass
            message = events.get_final_message()
    else:
        message = claude.messages.create(**kwargs)
    assert message.stop_reason == "tool_use"
    assert [block.type for block in message.content] == ["thinking", "tool_use"]
    assert message.content[0].thinking == THOUGHT
    assert message.content[1].name == "get_weather" and message.content[1].input == {"city": "Paris"}


def test_tool_choice_none_leaves_the_call_as_text_in_every_dialect(oai, claude):
    """The same reply that is a call under auto (above) is no call when the client says none."""
    ask = "Weather in Paris? [[angle-call]]"
    chat = oai.chat.completions.create(model="m", messages=[user(ask)], tools=CHAT_TOOLS, tool_choice="none",
                                       max_tokens=120).choices[0]
    assert not chat.message.tool_calls and chat.finish_reason == "stop" and chat.message.content == CALL
    response = oai.responses.create(model="m", input=ask, tools=RESPONSES_TOOLS, tool_choice="none",
                                    max_output_tokens=120)
    assert "function_call" not in [item.type for item in response.output] and response.output_text == CALL
    message = claude.messages.create(model="m", max_tokens=120, tools=ANTHROPIC_TOOLS, tool_choice={"type": "none"},
                                     messages=[user(ask)])
    assert message.stop_reason == "end_turn" and "tool_use" not in [block.type for block in message.content]
    assert message.content[-1].text == CALL


def test_a_forced_call_is_held_to_the_conventions_grammar(angle):
    """tool_choice required asks the convention for its grammar, which names its own tokens."""
    tokenizer = Tokenizer.from_gguf_metadata(angle_vocabulary())
    card = ModelCard(PROTOCOL_VERSION, "m", "qwen3", 2048, tokenizer.vocab_size, tokenizer.to_spec(), TEMPLATE, "fp",
                     Capabilities(2048, THINK, True, CALLS, angle.name))
    view = ModelView.from_card(card)
    request = openai_chat.parse({"model": "m", "messages": [user("?")], "tools": CHAT_TOOLS,
                                 "tool_choice": "required"}, view, {})
    plan = tool_calls.plan(view, request)
    assert plan.call_format == "angle" and plan.grammar["kind"] == "lark"
    engine = GrammarEngine(tokenizer, tokenizer.vocab_size)
    matcher = llg.LLMatcher(engine.ll_tokenizer(), engine.compile("lark", plan.grammar["source"]))
    call = CALLS.open + json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}}) + CALLS.close
    assert matcher.consume_tokens(tokenizer.encode(call, add_special=False)) and matcher.is_accepting()
