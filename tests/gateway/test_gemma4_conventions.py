"""Gemma 4's thought channel and tool calls through the real stack, in all three dialects.

The model is the tiny random gemma4 (its vocabulary ``gemma4_vocab.py``, its template
``templates/gemma4.jinja``). Replies keyed by a marker in the prompt are scripted (every step
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
from conftest import write_script
from gemma4_vocab import gemma4_vocab_metadata
from test_constrained_output import check_forced_calls
from tiny_models import write_tiny_gguf
from weather_tools import THINKING, weather_tools

from gateway import tool_calls
from gateway.dialects import anthropic_messages, openai_chat, openai_responses
from gateway.neutral import TextDelta, ToolCallEnd
from gateway.prompting import ModelView
from shared.conventions import gemma4
from shared.conventions.gemma4 import CALLS as GEMMA4_CALL_TAGS
from shared.conventions.gemma4 import GEMMA4
from shared.conventions.gemma4 import THOUGHT as GEMMA4_THOUGHT_TAGS
from shared.tokenizer import Tokenizer
from worker.grammar import GrammarEngine

THOUGHT = "I should call the tool."
ANSWER = "It is 22C and sunny in Paris."
WEATHER_CALL = '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>'
SCRIPT = {
    "[[call-weather]]": f"<|channel>thought\n{THOUGHT}<channel|>{WEATHER_CALL}",
    "[[weather-result]]": ANSWER,
    "[[two-calls]]": 'Both.<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>'
                     '<|tool_call>call:get_weather{city:<|"|>Tōkyō<|"|>,days:2}<tool_call|>',
    "[[think-answer]]": "<|channel>thought\nThe user greets me.<channel|>Hello there.",
}
RESULT = "22C and sunny [[weather-result]]"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
           "required": ["city"]}
CHAT_TOOLS, RESPONSES_TOOLS, ANTHROPIC_TOOLS = weather_tools(WEATHER)


@pytest.fixture(scope="module")
def gemma4_stack(tmp_path_factory, start_worker, start_gateway):
    folder = tmp_path_factory.mktemp("gemma4")
    model = folder / "tiny-gemma4.gguf"
    write_tiny_gguf(model, "gemma4", context_length=4096)
    script = write_script(folder, SCRIPT)
    worker = start_worker(model, "--scripted-replies", str(script), "--batch", "2", "--ctx", "4096")
    return start_gateway(worker), worker


@pytest.fixture(scope="module")
def oai(gemma4_stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=gemma4_stack[0].url + "/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def claude(gemma4_stack) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gemma4_stack[0].url, api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def view(gemma4_stack) -> ModelView:
    return ModelView.from_card(gemma4_stack[1].card())


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def test_the_card_names_gemma4s_conventions(view):
    capabilities = view.card.capabilities
    assert capabilities.reasoning and capabilities.reasoning_tags == GEMMA4_THOUGHT_TAGS
    assert capabilities.tool_call_tags == GEMMA4_CALL_TAGS and capabilities.convention == "gemma4"


def test_thinking_on_and_off_in_the_prompt(view):
    ask = [user("Hi")]
    assert view.render(ask, reasoning=True) == "<bos><|turn>system\n<|think|>\n<turn|>\n<|turn>user\nHi<turn|>\n<|turn>model\n"
    assert view.render(ask, reasoning=False).endswith("<|turn>model\n<|channel>thought\n<channel|>")


def final(stream: bool, create: Any, stream_with: Any, last: str, **kwargs: Any) -> Any:
    if not stream:
        return create(**kwargs)
    with stream_with(**kwargs) as events:
        for _ in events:
            pass
        return getattr(events, last)()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_round_trip_with_thinking(oai, stream):
    def chat(messages, **extra):
        return final(stream, oai.chat.completions.create, oai.chat.completions.stream, "get_final_completion",
                     model="gemma", messages=messages, tools=CHAT_TOOLS, max_tokens=120, **extra)

    question = [user("Weather in Paris? [[call-weather]]")]
    first = chat(question, reasoning_effort="medium").choices[0]
    assert first.finish_reason == "tool_calls" and first.message.reasoning_content == THOUGHT
    assert not first.message.content
    [call] = first.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    history = question + [
        {"role": "assistant", "content": None, "reasoning_content": THOUGHT,
         "tool_calls": [{"id": call.id, "type": "function",
                         "function": {"name": "get_weather", "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": RESULT}]
    second = chat(history, reasoning_effort="none").choices[0]
    assert second.message.content == ANSWER and second.finish_reason == "stop"

    both = chat([user("[[two-calls]]")]).choices[0]
    assert both.message.content == "Both."
    assert [json.loads(c.function.arguments) for c in both.message.tool_calls] == [
        {"city": "Paris"}, {"city": "Tōkyō", "days": 2}]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_responses_round_trip_with_thinking(oai, stream):
    def respond(items, **extra):
        return final(stream, oai.responses.create, oai.responses.stream, "get_final_response",
                     model="gemma", input=items, tools=RESPONSES_TOOLS, max_output_tokens=120, **extra)

    first = respond([user("Weather in Paris? [[call-weather]]")], reasoning={"effort": "medium"})
    kinds = [item.type for item in first.output]
    assert kinds == ["reasoning", "function_call"], kinds
    assert first.output[0].content[0].text == THOUGHT
    call = first.output[1]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    second = respond([user("Weather in Paris?"), {"type": "function_call", "call_id": call.call_id,
                                                  "name": call.name, "arguments": call.arguments},
                      {"type": "function_call_output", "call_id": call.call_id, "output": RESULT}])
    assert second.output_text == ANSWER


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_anthropic_round_trip_with_thinking(claude, stream):
    def message(messages, **extra):
        return final(stream, claude.messages.create, claude.messages.stream, "get_final_message",
                     model="claude-sonnet-4-6", messages=messages, tools=ANTHROPIC_TOOLS, max_tokens=2000, **extra)

    question = [user("Weather in Paris? [[call-weather]]")]
    first = message(question, thinking=THINKING)
    assert first.stop_reason == "tool_use"
    thinking, call = first.content
    assert thinking.type == "thinking" and thinking.thinking == THOUGHT
    assert call.type == "tool_use" and call.input == {"city": "Paris"}
    history = question + [
        {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": RESULT}]}]
    second = message(history)
    assert [block.type for block in second.content] == ["text"] and second.content[0].text == ANSWER
    greeting = message([user("Hi [[think-answer]]")], thinking=THINKING)
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in greeting.content] == [
        ("thinking", "The user greets me."), ("text", "Hello there.")]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_forced_calls_are_gemma4_calls_that_keep_to_their_schemas(view, oai, claude, stream):
    """Nothing scripted: the random model writes whatever the grammar of its own call syntax
    lets it, and every dialect gets a call valid for its tool."""
    forced = openai_chat.parse({"model": "m", "messages": [user("?")], "tools": CHAT_TOOLS,
                                "tool_choice": "required"}, view, {})
    plan = tool_calls.plan(view, forced)
    assert plan.call_format == "gemma4" and '"call:get_weather"' in plan.grammar["source"]
    check_forced_calls(oai, claude, stream, max_tokens=60)


EXPECTED_TURN = (f"<|turn>model\n<|channel>thought\n{THOUGHT}\n<channel|>{WEATHER_CALL}"
                 '<|tool_response>response:get_weather{value:<|"|>22C and sunny<|"|>}<tool_response|>')
HISTORIES = {
    openai_chat: {"messages": [
        user("Weather?"),
        {"role": "assistant", "content": None, "reasoning_content": THOUGHT, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22C and sunny"}], "tools": CHAT_TOOLS},
    openai_responses: {"input": [
        user("Weather?"),
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": THOUGHT}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "22C and sunny"}], "tools": RESPONSES_TOOLS},
    anthropic_messages: {"messages": [
        user("Weather?"),
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": THOUGHT, "signature": "c2ln"},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "22C and sunny"}]}],
        "tools": ANTHROPIC_TOOLS, "max_tokens": 50},
}


@pytest.mark.parametrize("dialect", list(HISTORIES), ids=lambda d: d.__name__.rsplit(".", 1)[-1])
def test_history_renders_the_gemma4_way(view, dialect):
    """A call and its result, from each dialect's history, as Gemma 4 writes them: the call in
    the model's turn, the result after it, and the model going on with the same turn."""
    request = dialect.parse({"model": "m", **HISTORIES[dialect]}, view, {})
    plan = tool_calls.plan(view, request)
    prompt = view.render(request.messages, plan.declared, request.reasoning, request.prefill)
    assert prompt.endswith(EXPECTED_TURN), prompt
    assert "<|tool>declaration:get_weather{description:<|\"|>Weather for a city<|\"|>,parameters:{" in prompt


# --- the call syntax on its own -------------------------------------------------------------------

def test_call_bodies_parse_to_json_values():
    body = 'call:f{a:<|"|>x, y: {z}<|"|>,b:-1.5e3,c:[1,true,null,{d:<|"|><|"|>}],<|"|>e f<|"|>:false}'
    assert gemma4.parse_call(body) == (
        "f", {"a": "x, y: {z}", "b": -1500.0, "c": [1, True, None, {"d": ""}], "e f": False})
    for broken in ("f{a:1}", "call:{a:1}", "call:f{a:1", 'call:f{a:<|"|>x}', "call:f{a 1}", "call:f{a:1}x",
                   "call:f[1]", "call:f{a:tru}"):
        assert gemma4.parse_call(broken) is None, broken


def test_the_stream_parser_reads_gemma4_blocks_in_pieces():
    parser = GEMMA4.call_parser(None)
    text = ('Sure.<|tool_call>call:write{path:<|"|>a.txt<|"|>,text:<|"|>line <tool_call|>\nnext<|"|>}'
            '<tool_call|><|tool_call>call:broken{<tool_call|>')
    events = [event for i in range(0, len(text), 3) for event in parser.push(text[i:i + 3])] + parser.flush()
    calls = [event for event in events if isinstance(event, ToolCallEnd)]
    assert [(c.name, json.loads(c.arguments_json)) for c in calls] == [
        ("write", {"path": "a.txt", "text": "line <tool_call|>\nnext"})]
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "Sure.<|tool_call>call:broken{<tool_call|>"


@pytest.fixture(scope="module")
def grammars() -> tuple[Tokenizer, GrammarEngine]:
    tokenizer = Tokenizer.from_gguf_metadata(gemma4_vocab_metadata())
    return tokenizer, GrammarEngine(tokenizer, tokenizer.vocab_size)


def accepts(grammars: tuple[Tokenizer, GrammarEngine], source: str, text: str) -> bool:
    tokenizer, engine = grammars
    matcher = llg.LLMatcher(engine.ll_tokenizer(), engine.compile("lark", source))
    return matcher.consume_tokens(tokenizer.encode(text, add_special=False)) and matcher.is_accepting()


def test_the_forced_grammar_holds_a_call_to_its_schema(grammars):
    tokenizer, _ = grammars
    ids = [tokenizer.piece_to_id(t) for t in (GEMMA4_CALL_TAGS.open, GEMMA4_CALL_TAGS.close, gemma4.QUOTE)]
    schema = {"type": "object", "additionalProperties": False, "required": ["city"],
              "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"type": "integer"},
                             "unit": {"enum": ["C", "F"]}}}
    source = gemma4.lark([("get_weather", schema)], *ids, parallel=True)
    good = ['<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>',
            '<|tool_call>call:get_weather{city:<|"|>Rome<|"|>,days:3,unit:<|"|>C<|"|>}<tool_call|>'
            '<|tool_call>call:get_weather{city:<|"|><|"|>,unit:<|"|>F<|"|>}<tool_call|>']
    bad = ['<|tool_call>call:get_weather{days:3}<tool_call|>',  # the required city missing
           '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:<|"|>3<|"|>}<tool_call|>',  # days not a number
           '<|tool_call>call:get_weather{city:<|"|>Valparaíso, Chile<|"|>}<tool_call|>',  # too long
           '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,wind:1}<tool_call|>',  # not declared
           '<|tool_call>call:get_weather{unit:<|"|>C<|"|>,city:<|"|>Paris<|"|>}<tool_call|>',  # out of order
           '<|tool_call>call:get_time{}<tool_call|>',  # another tool
           'call:get_weather{city:<|"|>Paris<|"|>}']  # not in the call tokens
    assert all(accepts(grammars, source, text) for text in good)
    assert not any(accepts(grammars, source, text) for text in bad)


def test_patterns_and_property_names_the_syntax_must_take_care_of(grammars):
    """Escaped slashes and dollars in a schema's pattern, an alternation at its top level (left
    free rather than misplaced), and property names that are not bare words (quoted in the call,
    and read back): each grammar compiles and holds what it can."""
    tokenizer, _ = grammars
    ids = [tokenizer.piece_to_id(t) for t in (GEMMA4_CALL_TAGS.open, GEMMA4_CALL_TAGS.close, gemma4.QUOTE)]
    schema = {"type": "object", "additionalProperties": False, "required": ["url", "a:b"],
              "properties": {"url": {"type": "string", "pattern": "^https:\\/\\/[a-z.]+\\/$"},
                             "price": {"type": "string", "pattern": "^\\$[0-9]+$"},
                             "either": {"type": "string", "pattern": "^a|b$"},
                             "a:b": {"type": "integer"}}}
    source = gemma4.lark([("fetch", schema)], *ids, parallel=False)
    call = ('<|tool_call>call:fetch{<|"|>a:b<|"|>:3,either:<|"|>xbx<|"|>,price:<|"|>$12<|"|>,'
            'url:<|"|>https://example.org/<|"|>}<tool_call|>')
    assert accepts(grammars, source, call)
    assert not accepts(grammars, source, call.replace("https://example.org/", "http://example.org/"))
    assert not accepts(grammars, source, call.replace("$12", "12"))
    body = call.removeprefix("<|tool_call>").removesuffix("<tool_call|>")
    assert gemma4.parse_call(body) == ("fetch", {"a:b": 3, "either": "xbx", "price": "$12",
                                                       "url": "https://example.org/"})
    assert gemma4.parse_call("call:f{a:" + "[" * 5000) is None  # nested past any real arguments
