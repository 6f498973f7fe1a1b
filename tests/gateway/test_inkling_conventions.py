"""Inkling's blocks (thinking, text, tool calls) through the real stack, in all three dialects.

The model is the tiny random inkling with its Inkling style vocabulary (``inkling_vocab.py``,
Qwen's BPE with Inkling's block tokens as control tokens) and its template
(``templates/inkling.jinja``). Replies keyed by a marker in the prompt are scripted (every step
still runs the engine); any other request is sampled by the model itself, so a forced call is
the grammar's work alone.
"""

from __future__ import annotations

import json
from typing import Any

import anthropic
import llguidance as llg
import openai
import pytest
from inkling_vocab import SPECIAL_IDS, inkling_vocab_metadata
from test_constrained_output import check_forced_calls, chat_reply, messages_reply, responses_reply, user
from test_gemma4_conventions import ANTHROPIC_TOOLS, CHAT_TOOLS, RESPONSES_TOOLS, THINKING, WEATHER
from conftest import write_script
from tiny_models import write_tiny_gguf

from gateway import tool_calls
from gateway.dialects import anthropic_messages, openai_chat, openai_responses
from gateway.generation import ReplyText
from gateway.neutral import ReasoningDelta, TextDelta, ToolCallEnd
from gateway.prompting import ModelView
from gateway.stop_strings import StopStringMatcher
from shared.tokenizer import Tokenizer
from shared.conventions import inkling
from shared.conventions.inkling import INKLING, InklingBlocks
from worker.grammar import GrammarEngine

THOUGHT = "I should check the weather."
LOOK = "Let me look."
ANSWER = "It is 22C and sunny in Paris."
CALL_JSON = '{"name":"get_weather","args":{"city":"São Paulo","days":2}}'
CALL_BLOCK = f"<|message_model|>get_weather<|content_invoke_tool_json|>{CALL_JSON}<|end_message|>"
FIRST = (f"<|content_thinking|>{THOUGHT}<|end_message|><|message_model|><|content_text|>{LOOK}<|end_message|>"
         + CALL_BLOCK)
SCRIPT = {
    "[[call-weather]]": FIRST,
    "[[weather-result]]": f"<|content_text|>{ANSWER}<|end_message|>",
    "[[two-calls]]": "<|content_text|>Both.<|end_message|>" + CALL_BLOCK + CALL_BLOCK.replace(
        "São Paulo", "Tōkyō").replace('"days":2', '"days":5'),
    "[[bad-call]]": '<|content_text|>Trying.<|end_message|><|message_model|>get_weather'
                    '<|content_invoke_tool_json|>{"name":"get_weather","args":{"city":}<|end_message|>',
    # a call block on a request without tools, and a reply cut off mid-block
    "[[cut-off]]": "<|content_thinking|>Long thought<|end_message|><|message_model|><|content_text|>"
                   + "word " * 40 + "<|end_message|>",
}
RESULT = "22C and sunny [[weather-result]]"
ARGUMENTS = {"city": "São Paulo", "days": 2}


@pytest.fixture(scope="module")
def inkling_stack(tmp_path_factory, start_worker, start_gateway):
    folder = tmp_path_factory.mktemp("inkling")
    model = folder / "tiny-inkling.gguf"
    write_tiny_gguf(model, "inkling", context_length=2048)
    script = write_script(folder, SCRIPT)
    worker = start_worker(model, "--scripted-replies", str(script), "--ctx", "2048")
    return start_gateway(worker), worker


@pytest.fixture(scope="module")
def oai(inkling_stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=inkling_stack[0].url + "/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def claude(inkling_stack) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=inkling_stack[0].url, api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def view(inkling_stack) -> ModelView:
    return ModelView.from_card(inkling_stack[1].card())


# --- the reader, on its own --------------------------------------------------------------------

def read(pieces: list[str], limit: int | None = None, calls: bool = True) -> list[tuple]:
    """The events of a reply fed in these pieces, texts joined, call ids left out."""
    reply = ReplyText(InklingBlocks(calls), StopStringMatcher([]),
                      INKLING.call_parser(limit)
                      if calls else None)
    events = [event for piece in pieces for event in reply.push(piece)] + reply.finish()
    merged: list[tuple] = []
    for event in events:
        if isinstance(event, (TextDelta, ReasoningDelta)):
            kind = type(event).__name__
            if merged and merged[-1][0] == kind:
                merged[-1] = (kind, merged[-1][1] + event.text)
            else:
                merged.append((kind, event.text))
        elif isinstance(event, ToolCallEnd):
            merged.append(("call", event.name, json.loads(event.arguments_json)))
    return merged


READ_FIRST = [("ReasoningDelta", THOUGHT), ("TextDelta", LOOK), ("call", "get_weather", ARGUMENTS)]


def test_a_reply_reads_into_reasoning_text_and_calls():
    assert read([FIRST]) == READ_FIRST
    assert read([FIRST + CALL_BLOCK]) == READ_FIRST + [READ_FIRST[-1]]
    assert read([FIRST + CALL_BLOCK], limit=1) == READ_FIRST
    # two blocks of a kind in a row are one text, a blank line between them
    assert read(["<|content_text|>One.<|end_message|><|message_model|><|content_text|>Two.<|end_message|>"]) == [
        ("TextDelta", "One.\n\nTwo.")]
    # no markers at all: text; an author name and a stray kind token are never shown
    assert read(["Just words, no blocks."]) == [("TextDelta", "Just words, no blocks.")]
    assert read(["bob<|content_text|>Hi<|content_thinking|>hmm"]) == [("TextDelta", "Hi"), ("ReasoningDelta", "hmm")]


def test_every_cut_of_a_reply_reads_the_same():
    reply = FIRST + SCRIPT["[[bad-call]]"] + "<|message_model|><|content_text|>naïve 🌍 end<|end_message|>"
    whole = read([reply])
    assert whole == READ_FIRST + [("TextDelta", 'Trying.\n\n{"name":"get_weather","args":{"city":}\n\nnaïve 🌍 end')]
    for cut in range(len(reply) + 1):
        assert read([reply[:cut], reply[cut:]]) == whole, cut


def test_text_streams_and_holds_back_only_a_marker_start():
    blocks = InklingBlocks(calls=True)
    assert blocks.push("<|content_text|>Hello wor") == [TextDelta("Hello wor")]
    assert blocks.push("ld<|end_mes") == [TextDelta("ld")]
    assert blocks.push("sage|><|message_model|>get_") == []  # an author name, or the start of text
    assert blocks.push("weather<|content_thinking|>a") == [ReasoningDelta("a")]
    assert blocks.inside


def test_cut_off_blocks_still_give_what_they_held():
    assert read(["<|content_thinking|>Half a thou"]) == [("ReasoningDelta", "Half a thou")]
    assert read(['<|message_model|>get_weather<|content_invoke_tool_json|>{"name":"get_wea']) == [
        ("TextDelta", '{"name":"get_wea')]
    # on a request without tools a call block is its text
    assert read([FIRST], calls=False) == [("ReasoningDelta", THOUGHT), ("TextDelta", f"{LOOK}\n\n{CALL_JSON}")]


def test_a_call_is_json_with_name_and_args():
    parse = inkling.SYNTAX.parse
    assert parse(CALL_JSON) == ("get_weather", ARGUMENTS)
    assert parse('{"name":"ping"}') == ("ping", {})
    for broken in ('{"name":"x","args":[1]}', '{"args":{}}', '{"name":"","args":{}}', "[1]", '{"name":"x",'):
        assert parse(broken) is None, broken


# --- the grammar of a forced call --------------------------------------------------------------

@pytest.fixture(scope="module")
def grammars() -> tuple[Tokenizer, GrammarEngine]:
    tokenizer = Tokenizer.from_gguf_metadata(inkling_vocab_metadata())
    return tokenizer, GrammarEngine(tokenizer, tokenizer.vocab_size)


def accepts(grammars: tuple[Tokenizer, GrammarEngine], source: str, text: str) -> bool:
    tokenizer, engine = grammars
    matcher = llg.LLMatcher(engine.ll_tokenizer(), engine.compile("lark", source))
    return matcher.consume_tokens(tokenizer.encode(text, add_special=False)) and matcher.is_accepting()


def test_the_forced_grammar_is_call_blocks_of_the_schema(grammars):
    tokenizer, _ = grammars
    functions = [("get_weather", {**WEATHER, "additionalProperties": False}), ("ping", {"type": "object"})]
    call = CALL_BLOCK.removeprefix("<|message_model|>")
    one = inkling.lark(tokenizer, functions, parallel=False)
    assert accepts(grammars, one, call)
    assert accepts(grammars, one, 'ping<|content_invoke_tool_json|>{"name":"ping","args":{}}<|end_message|>')
    assert not accepts(grammars, one, call + CALL_BLOCK)  # one call only
    assert not accepts(grammars, one, call.replace('"days":2', '"days":"two"'))  # not an integer
    assert not accepts(grammars, one, call.replace('"city":"São Paulo",', ""))  # city is required
    assert not accepts(grammars, one, call.replace('"name":"get_weather"', '"name":"ping"'))  # its own name
    assert not accepts(grammars, one, call.replace(",", ", "))  # compact, as the model writes it
    assert not accepts(grammars, one, "<|content_text|>No.<|end_message|>")
    several = inkling.lark(tokenizer, functions, parallel=True)
    assert accepts(grammars, several, call + CALL_BLOCK)
    # with reasoning on: a thinking block may come first, and the call must follow; a call first
    # is held to its schema all the same
    thinking = inkling.lark(tokenizer, functions, parallel=False, thinking=True)
    assert accepts(grammars, thinking, "<|content_thinking|>Hm.<|end_message|>" + CALL_BLOCK)
    assert accepts(grammars, thinking, call)
    assert not accepts(grammars, thinking, call.replace('"days":2', '"days":"two"'))
    assert not accepts(grammars, thinking, "<|content_thinking|>Hm.<|end_message|>")
    assert not accepts(grammars, thinking, "<|content_text|>Hm.<|end_message|>" + CALL_BLOCK)
    optional = inkling.lark(tokenizer, functions, parallel=False, optional=True)
    assert accepts(grammars, optional, "<|content_text|>Just text.<|end_message|>")
    assert accepts(grammars, optional, "<|content_thinking|>Hm.<|end_message|><|message_model|>" + call)
    assert not accepts(grammars, optional, "<|content_text|>x<|end_message|>" + CALL_BLOCK.replace(":2", ':"2"'))
    assert not accepts(grammars, optional, call + CALL_BLOCK)  # one call, and the reply ends with it
    optional_many = inkling.lark(tokenizer, functions, parallel=True, optional=True)
    assert accepts(grammars, optional_many, call + "<|message_model|><|content_text|>And.<|end_message|>" + CALL_BLOCK)


# --- the real stack ----------------------------------------------------------------------------

def test_the_vocabulary_and_template_make_the_convention(view):
    capabilities = view.card.capabilities
    assert capabilities.convention == "inkling" and capabilities.reasoning
    assert capabilities.tool_call_tags == INKLING.calls
    tokenizer = view.tokenizer
    assert tokenizer.pre == "inkling" and not tokenizer.add_bos
    assert tokenizer.eos_id == SPECIAL_IDS["<|content_model_end_sampling|>"]
    assert tokenizer.piece_to_id("<|end_message|>") not in tokenizer.stop_ids
    # the markers' ids as the test vocabulary places them: the real ids, shifted
    assert SPECIAL_IDS["<|content_invoke_tool_json|>"] - SPECIAL_IDS["<|endoftext|>"] == 200_049 - 199_999


def efforts(view: ModelView) -> dict[str, str]:
    """The effort level each dialect's request renders into the prompt."""
    def level(request) -> str:
        text = view.render(request.messages, reasoning=request.reasoning, effort=request.reasoning_effort)
        return text.split("Thinking effort level: ")[1].split("<|end_message|>")[0]

    body = {"model": "m", "messages": [user("Hi")]}
    return {
        "chat off": level(openai_chat.parse(body, view, {})),
        "chat low": level(openai_chat.parse({**body, "reasoning_effort": "low"}, view, {})),
        "chat default": level(openai_chat.parse({**body, "reasoning_effort": "default"}, view, {})),
        "responses high": level(openai_responses.parse({"model": "m", "input": "Hi", "reasoning": {"effort": "high"}},
                                                       view, {})),
        "anthropic off": level(anthropic_messages.parse({**body, "max_tokens": 9}, view, {})),
        "anthropic 1024": level(anthropic_messages.parse({**body, "max_tokens": 9, "thinking": THINKING}, view, {})),
        "anthropic 10000": level(anthropic_messages.parse(
            {**body, "max_tokens": 9, "thinking": {"type": "enabled", "budget_tokens": 10_000}}, view, {})),
        "anthropic xhigh": level(anthropic_messages.parse(
            {**body, "max_tokens": 9, "thinking": THINKING, "output_config": {"effort": "xhigh"}}, view, {})),
    }


def test_reasoning_renders_as_the_effort_level(view):
    assert efforts(view) == {"chat off": "0", "chat low": "0.2", "chat default": "0.9", "responses high": "0.9",
                             "anthropic off": "0", "anthropic 1024": "0.2", "anthropic 10000": "0.9",
                             "anthropic xhigh": "0.99"}


def chat(oai: openai.OpenAI, stream: bool, messages: list[dict[str, Any]], **extra: Any) -> Any:
    return chat_reply(oai, stream, messages=messages, tools=CHAT_TOOLS, max_tokens=200, **extra)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_round_trip(oai, view, stream):
    question = [user("Weather in São Paulo? [[call-weather]]")]
    first = chat(oai, stream, question, reasoning_effort="medium")
    assert first.finish_reason == "tool_calls"
    assert first.message.reasoning_content == THOUGHT and first.message.content == LOOK
    [call] = first.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == ARGUMENTS
    history = question + [
        {"role": "assistant", "content": LOOK, "reasoning_content": THOUGHT,
         "tool_calls": [{"id": call.id, "type": "function",
                         "function": {"name": "get_weather", "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": RESULT}]
    # the turn and its result go back into the prompt as the model's own blocks
    rendered = view.render(openai_chat.parse({"model": "m", "messages": history}, view, {}).messages)
    assert rendered.endswith(
        "<|message_user|><|content_text|>Weather in São Paulo? [[call-weather]]<|end_message|><|message_model|>"
        + FIRST + "<|content_model_end_sampling|>"
        + f"<|message_tool|>get_weather<|content_text|>{RESULT}<|end_message|><|message_model|>")
    second = chat(oai, stream, history, reasoning_effort="medium")
    assert second.message.content == ANSWER and second.finish_reason == "stop"
    assert not second.message.tool_calls


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_responses_and_messages_read_the_blocks(oai, claude, stream):
    response = responses_reply(oai, stream, input=[user("Weather? [[call-weather]]")], tools=RESPONSES_TOOLS,
                               reasoning={"effort": "medium"}, max_output_tokens=200)
    assert [item.type for item in response.output] == ["reasoning", "message", "function_call"]
    assert response.output[1].content[0].text == LOOK
    assert json.loads(response.output[2].arguments) == ARGUMENTS
    message = messages_reply(claude, stream, max_tokens=2000, tools=ANTHROPIC_TOOLS, thinking=THINKING,
                             messages=[user("Weather? [[call-weather]]")])
    thinking, text, use = message.content
    assert message.stop_reason == "tool_use" and thinking.thinking == THOUGHT and text.text == LOOK
    assert use.type == "tool_use" and use.name == "get_weather" and use.input == ARGUMENTS


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_parallel_calls_off_ends_after_the_first(oai, claude, stream):
    both = chat(oai, stream, [user("[[two-calls]]")])
    assert both.message.content == "Both."
    assert [json.loads(c.function.arguments) for c in both.message.tool_calls] == [
        ARGUMENTS, {"city": "Tōkyō", "days": 5}]
    one = chat(oai, stream, [user("[[two-calls]]")], parallel_tool_calls=False)
    assert one.finish_reason == "tool_calls" and len(one.message.tool_calls) == 1
    message = messages_reply(claude, stream, max_tokens=200, tools=ANTHROPIC_TOOLS, messages=[user("[[two-calls]]")],
                             tool_choice={"type": "auto", "disable_parallel_tool_use": True})
    assert [block.type for block in message.content] == ["text", "tool_use"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_malformed_call_comes_back_as_text(oai, claude, stream):
    reply = chat(oai, stream, [user("[[bad-call]]")])
    assert reply.finish_reason == "stop" and not reply.message.tool_calls
    assert reply.message.content == 'Trying.\n\n{"name":"get_weather","args":{"city":}'
    message = messages_reply(claude, stream, max_tokens=200, tools=ANTHROPIC_TOOLS, messages=[user("[[bad-call]]")])
    assert message.stop_reason == "end_turn" and [block.type for block in message.content] == ["text"]
    assert "<|" not in message.content[0].text and message.content[0].text.startswith("Trying.")


def test_a_reply_cut_off_keeps_what_it_said(oai):
    kwargs = dict(model="m", messages=[user("[[cut-off]]")], reasoning_effort="low", max_tokens=12)
    whole = oai.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "length" and whole.message.reasoning_content == "Long thought"
    assert whole.message.content.startswith("word word") and "<|" not in whole.message.content
    # the SDK's stream helper refuses a cut reply, so the chunks are read as they come
    chunks = [chunk.choices[0] for chunk in oai.chat.completions.create(**kwargs, stream=True) if chunk.choices]
    assert "".join(c.delta.content or "" for c in chunks) == whole.message.content
    assert "".join(getattr(c.delta, "reasoning_content", None) or "" for c in chunks) == "Long thought"
    assert chunks[-1].finish_reason == "length"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_forced_calls_are_call_blocks_that_keep_to_their_schemas(view, oai, claude, stream):
    """Nothing scripted: the random model writes whatever the grammar of its blocks lets it,
    and every dialect gets a call valid for its tool."""
    forced = openai_chat.parse({"model": "m", "messages": [user("?")], "tools": CHAT_TOOLS,
                                "tool_choice": "required"}, view, {})
    plan = tool_calls.plan(view, forced)
    assert plan.call_format == "inkling" and '"get_weather" <[' in plan.grammar["source"]
    check_forced_calls(oai, claude, stream, max_tokens=80)
