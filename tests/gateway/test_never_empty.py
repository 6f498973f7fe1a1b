"""Never an empty success: a reply the model wrote tokens in carries text, reasoning or a call.

Each convention's tiny model is scripted to write malformed calls (cut off, not well formed, an
empty call block) and bare markers. In every dialect, streamed (through the SDKs' stream
helpers) and not, the reply is not a call and carries the model's text as text.
"""

from __future__ import annotations

from typing import Any

import anthropic
import openai
import pytest
from test_streamed_tool_arguments import CONVENTIONS, SCHEMA, start_stack, tools

# convention -> {marker: (scripted reply, a piece of it the reply's text must show)}
MALFORMED: dict[str, dict[str, tuple[str, str]]] = {
    "hermes": {"[[cut]]": ('<tool_call>\n{"name": "write_file", "arguments": {"path": "a.t', '"a.t'),
               "[[bad]]": ('<tool_call>\n{"name": "write_file", "arguments": {"path": }}\n</tool_call>', '"path": }'),
               "[[empty]]": ("<think>\n\n</think>", "think")},
    "qwen_xml": {"[[cut]]": ("<tool_call>\n<function=write_file>\n<parameter=path>\na.t", "a.t"),
                 "[[bad]]": ("<tool_call>\n<function=write_file>\nstray words\n</function>\n</tool_call>", "stray words"),
                 "[[empty]]": ("<tool_call>\n</tool_call>", "tool_call")},
    "gemma4": {"[[cut]]": ('<|tool_call>call:write_file{path:<|"|>a.t', "a.t"),
               "[[bad]]": ("<|tool_call>call:write_file{path:}<tool_call|>", "path:}"),
               "[[empty]]": ("<|tool_call><tool_call|>", "tool_call")},
    "inkling": {"[[cut]]": ('write_file<|content_invoke_tool_json|>{"name":"write_file","args":{"path":"a.t', '"a.t'),
                "[[bad]]": ('write_file<|content_invoke_tool_json|>{"name":"write_file","args":{"path":}}'
                            '<|end_message|>', '"path":}'),
                "[[empty]]": ("write_file<|content_invoke_tool_json|><|end_message|>", "content_invoke_tool_json")},
    "nanochat": {"[[cut]]": ("<|python_start|>2+", "2+"),
                 "[[empty]]": ("<|python_start|><|python_end|>", "python_")},
}
CASES = [(convention, marker) for convention in CONVENTIONS for marker in MALFORMED[convention]]


@pytest.fixture(scope="module", params=CONVENTIONS)
def stack(request, tmp_path_factory, start_worker, start_gateway):
    convention = request.param
    script = {marker: reply for marker, (reply, _) in MALFORMED[convention].items()}
    gateway, _ = start_stack(convention, tmp_path_factory.mktemp(convention), start_worker, start_gateway, script)
    return convention, gateway


def chat(url: str, stream: bool, ask: list[dict[str, Any]], max_tokens: int) -> tuple[str, list, int]:
    oai = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    kwargs = dict(model="m", messages=ask, tools=tools("write_file", SCHEMA)[0], max_tokens=max_tokens)
    if stream:
        with oai.chat.completions.stream(**kwargs, stream_options={"include_usage": True}) as events:
            reply = events.get_final_completion()
    else:
        reply = oai.chat.completions.create(**kwargs)
    choice = reply.choices[0]
    calls = choice.message.tool_calls or [] if choice.finish_reason == "tool_calls" else []
    return choice.message.content or "", calls, reply.usage.completion_tokens


def responses(url: str, stream: bool, ask: list[dict[str, Any]], max_tokens: int) -> tuple[str, list, int]:
    oai = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    kwargs = dict(model="m", input=ask, tools=tools("write_file", SCHEMA)[1], max_output_tokens=max_tokens)
    if stream:
        with oai.responses.stream(**kwargs) as events:
            reply = events.get_final_response()
    else:
        reply = oai.responses.create(**kwargs)
    calls = [item for item in reply.output if item.type == "function_call"]
    return reply.output_text, calls, reply.usage.output_tokens


def messages(url: str, stream: bool, ask: list[dict[str, Any]], max_tokens: int) -> tuple[str, list, int]:
    claude = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
    kwargs = dict(model="m", messages=ask, tools=tools("write_file", SCHEMA)[2], max_tokens=max_tokens)
    if stream:
        with claude.messages.stream(**kwargs) as events:
            reply = events.get_final_message()
    else:
        reply = claude.messages.create(**kwargs)
    assert reply.content, "a Messages reply with output tokens and content: []"
    text = "".join(block.text for block in reply.content if block.type == "text")
    calls = [block for block in reply.content if block.type == "tool_use"] if reply.stop_reason == "tool_use" else []
    return text, calls, reply.usage.output_tokens


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("ask", [chat, responses, messages], ids=["chat", "responses", "messages"])
@pytest.mark.parametrize("marker", ["[[cut]]", "[[bad]]", "[[empty]]"])
def test_a_malformed_call_comes_back_as_the_text_the_model_wrote(stack, marker, ask, stream):
    convention, gateway = stack
    if marker not in MALFORMED[convention]:
        pytest.skip(f"{convention} has no {marker} case")
    _, shown = MALFORMED[convention][marker]
    text, calls, output_tokens = ask(gateway.url, stream, [{"role": "user", "content": f"Go {marker}"}], 200)
    assert output_tokens > 0
    assert not calls
    assert shown in text, text
