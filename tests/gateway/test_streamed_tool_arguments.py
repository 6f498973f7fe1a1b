"""Tool calls stream as they are written, in every call convention and every dialect.

Each convention's tiny model is served with a scripted reply that calls ``write_file`` with a long
string argument (every step still runs the engine). Streamed through real HTTP:

- the arguments arrive in many deltas that join into exactly the arguments of the non-streamed
  reply;
- they arrive before the call's last token is generated, measured by tokens, not time: the same
  request cut by ``max_tokens`` at half the call's tokens already streams the call's start and
  argument deltas (a call announced only once closed would show none);
- each SDK's stream helper assembles the same call as the non-streamed reply.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from conftest import write_script
from tiny_models import write_tiny_gguf
from tiny_nanochat import write_tiny_nanochat

from gateway.prompting import ModelView

QWEN35_TEMPLATE = Path(__file__).resolve().parents[1] / "templates" / "qwen35_xml.jinja"
WORDS = 'line "one" of the file\twith words, naïve 🌍 and a back\\slash\n'
LONG = (WORDS * 40)[:2000]  # ~2,000 characters that need escaping in JSON
SHORT = "2+3*4-5/6+" * 6  # nanochat's context is 256 tokens: its code argument is shorter
SCHEMA = {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
          "required": ["path", "content"]}
CODE_SCHEMA = {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}


def _gemma_string(text: str) -> str:
    return '<|"|>' + text + '<|"|>'


# convention -> (the scripted call's text, the tool's name and schema, the arguments it carries)
CALLS: dict[str, tuple[str, str, dict[str, Any], dict[str, Any]]] = {
    "hermes": ('<tool_call>\n' + json.dumps({"name": "write_file", "arguments": {"path": "a.txt", "content": LONG}})
               + '\n</tool_call>', "write_file", SCHEMA, {"path": "a.txt", "content": LONG}),
    "qwen_xml": ("<tool_call>\n<function=write_file>\n<parameter=path>\na.txt\n</parameter>\n<parameter=content>\n"
                 + LONG + "\n</parameter>\n</function>\n</tool_call>", "write_file", SCHEMA,
                 {"path": "a.txt", "content": LONG}),
    "gemma4": ("<|tool_call>call:write_file{content:" + _gemma_string(LONG) + ",path:" + _gemma_string("a.txt")
               + "}<tool_call|>", "write_file", SCHEMA, {"content": LONG, "path": "a.txt"}),
    "inkling": ("write_file<|content_invoke_tool_json|>"
                + json.dumps({"name": "write_file", "args": {"path": "a.txt", "content": LONG}})
                + "<|end_message|>", "write_file", SCHEMA, {"path": "a.txt", "content": LONG}),
    "nanochat": ("<|python_start|>" + SHORT + "<|python_end|>", "calculator", CODE_SCHEMA, {"code": SHORT}),
}
CONVENTIONS = list(CALLS)
MARKER = "[[write]]"


def start_stack(convention: str, folder: Path, start_worker, start_gateway, script: dict[str, str]):
    """A worker serving the convention's tiny model with this script, and a gateway before it."""
    path = write_script(folder, script)
    flags = ["--scripted-replies", str(path)]
    if convention == "nanochat":
        model = folder / "checkpoint"
        write_tiny_nanochat(model, "native")
        worker = start_worker(model, "--nanochat", str(model), *flags, "--ctx", "256")
    else:
        arch = {"hermes": "qwen3", "qwen_xml": "qwen35", "gemma4": "gemma4", "inkling": "inkling"}[convention]
        model = folder / f"tiny-{arch}.gguf"
        write_tiny_gguf(model, arch, context_length=4096)
        if convention == "qwen_xml":
            flags += ["--chat-template", str(QWEN35_TEMPLATE)]
        worker = start_worker(model, *flags, "--ctx", "4096")
    gateway = start_gateway(worker)
    assert ModelView.from_card(worker.card()).card.capabilities.convention == convention
    return gateway, worker


@pytest.fixture(scope="module", params=CONVENTIONS)
def stack(request, tmp_path_factory, start_worker, start_gateway):
    convention = request.param
    gateway, worker = start_stack(convention, tmp_path_factory.mktemp(convention), start_worker, start_gateway,
                                  {MARKER: CALLS[convention][0]})
    return convention, gateway, ModelView.from_card(worker.card())


def tools(name: str, schema: dict[str, Any]) -> tuple[list, list, list]:
    return ([{"type": "function", "function": {"name": name, "description": "A tool", "parameters": schema}}],
            [{"type": "function", "name": name, "description": "A tool", "parameters": schema}],
            [{"name": name, "description": "A tool", "input_schema": schema}])


def bodies(convention: str, max_tokens: int) -> dict[str, tuple[str, dict[str, Any]]]:
    """Each dialect's path and request body asking for the scripted call."""
    _, name, schema, _ = CALLS[convention]
    chat_tools, responses_tools, anthropic_tools = tools(name, schema)
    ask = [{"role": "user", "content": f"Write it {MARKER}"}]
    return {"chat": ("/v1/chat/completions", {"model": "m", "messages": ask, "tools": chat_tools,
                                              "max_tokens": max_tokens}),
            "responses": ("/v1/responses", {"model": "m", "input": ask, "tools": responses_tools,
                                            "max_output_tokens": max_tokens}),
            "messages": ("/v1/messages", {"model": "m", "messages": ask, "tools": anthropic_tools,
                                          "max_tokens": max_tokens})}


def sse(url: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=120) as response:
        assert response.status_code == 200, response.read()
        return [json.loads(line[6:]) for line in response.iter_lines()
                if line.startswith("data: ") and line != "data: [DONE]"]


def argument_deltas(dialect: str, events: list[dict[str, Any]]) -> tuple[str | None, list[str]]:
    """The streamed call's name and its argument deltas, in the dialect's own events."""
    name, deltas = None, []
    for event in events:
        if dialect == "chat":
            for call in (event.get("choices") or [{}])[0].get("delta", {}).get("tool_calls") or []:
                name = name or call.get("function", {}).get("name")
                if call.get("function", {}).get("arguments"):
                    deltas.append(call["function"]["arguments"])
        elif dialect == "responses":
            if event["type"] == "response.output_item.added" and event["item"]["type"] == "function_call":
                name = event["item"]["name"]
            elif event["type"] == "response.function_call_arguments.delta":
                deltas.append(event["delta"])
        else:
            if event["type"] == "content_block_start" and event["content_block"]["type"] == "tool_use":
                name = event["content_block"]["name"]
                assert event["content_block"]["input"] == {}
            elif event["type"] == "content_block_delta" and event["delta"]["type"] == "input_json_delta":
                deltas.append(event["delta"]["partial_json"])
    return name, deltas


def whole_call(dialect: str, url: str, convention: str) -> tuple[str, str]:
    """The non-streamed reply's call: its name and arguments JSON text."""
    path, body = bodies(convention, 3000 if convention != "nanochat" else 120)[dialect]
    reply = httpx.post(url + path, json=body, timeout=120).json()
    if dialect == "chat":
        (call,) = reply["choices"][0]["message"]["tool_calls"]
        return call["function"]["name"], call["function"]["arguments"]
    if dialect == "responses":
        (call,) = [item for item in reply["output"] if item["type"] == "function_call"]
        return call["name"], call["arguments"]
    (call,) = [block for block in reply["content"] if block["type"] == "tool_use"]
    return call["name"], json.dumps(call["input"], ensure_ascii=False)


@pytest.mark.parametrize("dialect", ["chat", "responses", "messages"])
def test_arguments_stream_in_many_deltas_that_join_into_the_whole_replys(stack, dialect):
    convention, gateway, _ = stack
    _, name, _, arguments = CALLS[convention]
    whole_name, whole_arguments = whole_call(dialect, gateway.url, convention)
    assert (whole_name, json.loads(whole_arguments)) == (name, arguments)
    path, body = bodies(convention, 3000 if convention != "nanochat" else 120)[dialect]
    streamed_name, deltas = argument_deltas(dialect, sse(gateway.url, path, body))
    assert streamed_name == name
    assert len(deltas) >= 20, deltas
    if dialect == "messages":
        assert json.loads("".join(deltas)) == arguments
    else:
        assert "".join(deltas) == whole_arguments


@pytest.mark.parametrize("dialect", ["chat", "responses", "messages"])
def test_arguments_arrive_before_the_calls_last_token(stack, dialect):
    """Cut at half the call's tokens, the reply has already streamed the call's start and part
    of its arguments (it ends as text then: a call cut off is not a call)."""
    convention, gateway, view = stack
    call_tokens = len(view.tokenizer.encode(CALLS[convention][0], add_special=False))
    assert call_tokens >= 40
    path, body = bodies(convention, call_tokens // 2)[dialect]
    events = sse(gateway.url, path, body)
    name, deltas = argument_deltas(dialect, events)
    assert name == CALLS[convention][1]
    assert len(deltas) >= 10, deltas
    _, whole_arguments = whole_call(dialect, gateway.url, convention)
    if dialect != "messages":  # Messages' whole input is re-serialized by this test
        # (the cut may fall inside a character, which the reply's end then writes as U+FFFD)
        assert whole_arguments.startswith("".join(deltas).rstrip("\ufffd"))


@pytest.mark.parametrize("dialect", ["chat", "responses", "messages"])
def test_the_sdk_stream_helpers_assemble_the_whole_replys_call(stack, dialect):
    convention, gateway, _ = stack
    _, name, schema, arguments = CALLS[convention]
    chat_tools, responses_tools, anthropic_tools = tools(name, schema)
    ask = [{"role": "user", "content": f"Write it {MARKER}"}]
    max_tokens = 3000 if convention != "nanochat" else 120
    if dialect == "messages":
        claude = anthropic.Anthropic(base_url=gateway.url, api_key="x", max_retries=0)
        kwargs = dict(model="m", messages=ask, tools=anthropic_tools, max_tokens=max_tokens)
        whole = claude.messages.create(**kwargs)
        with claude.messages.stream(**kwargs) as events:
            final = events.get_final_message()
        calls = [[(b.name, b.input) for b in reply.content if b.type == "tool_use"] for reply in (whole, final)]
        assert calls[0] == calls[1] == [(name, arguments)]
        assert final.stop_reason == whole.stop_reason == "tool_use"
        return
    oai = openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
    if dialect == "chat":
        kwargs = dict(model="m", messages=ask, tools=chat_tools, max_tokens=max_tokens)
        whole = oai.chat.completions.create(**kwargs).choices[0].message.tool_calls
        with oai.chat.completions.stream(**kwargs) as events:
            final = events.get_final_completion().choices[0].message.tool_calls
        pairs = [[(c.function.name, c.function.arguments) for c in calls] for calls in (whole, final)]
    else:
        kwargs = dict(model="m", input=ask, tools=responses_tools, max_output_tokens=max_tokens)
        whole = oai.responses.create(**kwargs).output
        with oai.responses.stream(**kwargs) as events:
            final = events.get_final_response().output
        pairs = [[(i.name, i.arguments) for i in output if i.type == "function_call"] for output in (whole, final)]
    assert pairs[0] == pairs[1] and len(pairs[0]) == 1
    assert pairs[0][0][0] == name and json.loads(pairs[0][0][1]) == arguments


# --- a model without a convention: the generic JSON call and a freeform tool's input ----------

GENERIC_CALL = json.dumps({"name": "write_file", "arguments": {"path": "a.txt", "content": LONG}}, ensure_ascii=False)
PATCH = ("*** Begin Patch\n*** Add File: a.txt\n" + "".join("+" + line + "\n" for line in LONG.splitlines())
         + "*** End Patch")
PATCH_MARKER = "[[patch]]"
FORCED = {"chat": "required", "responses": "required", "messages": {"type": "any"}}


@pytest.fixture(scope="module")
def generic(tmp_path_factory, start_worker, start_gateway):
    """The tiny Llama model, which has no call convention, scripted to write the generic JSON call
    (a forced call holds it to that format's grammar, which the script keeps) and a patch."""
    folder = tmp_path_factory.mktemp("generic")
    model = folder / "tiny-llama.gguf"
    write_tiny_gguf(model, "llama", context_length=4096)
    worker = start_worker(model, "--scripted-replies", str(write_script(folder, {MARKER: GENERIC_CALL,
                                                                                   PATCH_MARKER: PATCH})),
                          "--ctx", "4096")
    assert worker.card().capabilities.tool_call_tags is None  # the premise
    return start_gateway(worker), ModelView.from_card(worker.card())


def forced_body(dialect: str, max_tokens: int) -> tuple[str, dict[str, Any]]:
    path, body = bodies("hermes", max_tokens)[dialect]
    return path, {**body, "tool_choice": FORCED[dialect]}


@pytest.mark.parametrize("dialect", ["chat", "responses", "messages"])
def test_a_forced_generic_call_streams_as_it_is_written(generic, dialect):
    gateway, view = generic
    path, body = forced_body(dialect, 3000)
    whole = httpx.post(gateway.url + path, json=body, timeout=120).json()
    name, deltas = argument_deltas(dialect, sse(gateway.url, path, body))
    assert name == "write_file" and len(deltas) >= 20, deltas
    arguments = json.loads("".join(deltas))
    assert arguments == {"path": "a.txt", "content": LONG}
    if dialect == "chat":
        assert whole["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] == "".join(deltas)
    elif dialect == "responses":
        assert [i["arguments"] for i in whole["output"] if i["type"] == "function_call"] == ["".join(deltas)]
    else:
        assert [b["input"] for b in whole["content"] if b["type"] == "tool_use"] == [arguments]
    # cut at half the call's tokens, the call has begun streaming already
    cut = len(view.tokenizer.encode(GENERIC_CALL, add_special=False)) // 2
    name, deltas = argument_deltas(dialect, sse(gateway.url, *forced_body(dialect, cut)))
    assert name == "write_file" and len(deltas) >= 10
    assert json.dumps({"path": "a.txt", "content": LONG}, ensure_ascii=False).startswith(
        "".join(deltas).rstrip("\ufffd"))


def test_a_forced_freeform_tools_input_streams_and_the_sdk_assembles_it(generic):
    gateway, view = generic
    oai = openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
    kwargs = dict(model="m", input=[{"role": "user", "content": f"Patch it {PATCH_MARKER}"}],
                  tools=[{"type": "custom", "name": "apply_patch", "description": "Applies a patch"}],
                  tool_choice={"type": "custom", "name": "apply_patch"}, max_output_tokens=3000)
    whole = [i for i in oai.responses.create(**kwargs).output if i.type == "custom_tool_call"]
    assert [(i.name, i.input) for i in whole] == [("apply_patch", PATCH)]
    deltas = []
    with oai.responses.stream(**kwargs) as events:
        for event in events:
            if event.type == "response.custom_tool_call_input.delta":
                deltas.append(event.delta)
        final = [i for i in events.get_final_response().output if i.type == "custom_tool_call"]
    assert [(i.name, i.input) for i in final] == [("apply_patch", PATCH)]
    assert "".join(deltas) == PATCH and len(deltas) >= 20
    # cut at half its tokens, the input has begun streaming: as the patch's first half
    cut = len(view.tokenizer.encode(PATCH, add_special=False)) // 2
    events = sse(gateway.url, "/v1/responses", {**kwargs, "max_output_tokens": cut})
    partial = "".join(e["delta"] for e in events if e["type"] == "response.custom_tool_call_input.delta")
    assert len(partial) > 100 and PATCH.startswith(partial.rstrip("\ufffd"))
