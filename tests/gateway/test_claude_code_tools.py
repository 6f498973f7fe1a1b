"""Claude Code's tool set (dozens of tools, nested schemas) compiles into a forced-call grammar
and the forced call comes back as a tool_use block whose input validates."""

from __future__ import annotations

import anthropic
import jsonschema
import pytest

STRING = {"type": "string"}
TOOLS = [
    {"name": "Bash", "input_schema": {"type": "object", "properties": {
        "command": STRING, "timeout": {"type": "number", "maximum": 600000}, "description": STRING,
        "run_in_background": {"type": "boolean"}}, "required": ["command"], "additionalProperties": False}},
    {"name": "Read", "input_schema": {"type": "object", "properties": {
        "file_path": STRING, "offset": {"type": "number"}, "limit": {"type": "number"}},
        "required": ["file_path"], "additionalProperties": False}},
    {"name": "Edit", "input_schema": {"type": "object", "properties": {
        "file_path": STRING, "old_string": STRING, "new_string": STRING, "replace_all": {"type": "boolean", "default": False}},
        "required": ["file_path", "old_string", "new_string"], "additionalProperties": False}},
    {"name": "MultiEdit", "input_schema": {"type": "object", "properties": {
        "file_path": STRING,
        "edits": {"type": "array", "minItems": 1, "items": {"type": "object", "properties": {
            "old_string": STRING, "new_string": STRING, "replace_all": {"type": "boolean"}},
            "required": ["old_string", "new_string"], "additionalProperties": False}}},
        "required": ["file_path", "edits"], "additionalProperties": False}},
    {"name": "Write", "input_schema": {"type": "object", "properties": {"file_path": STRING, "content": STRING},
                                       "required": ["file_path", "content"], "additionalProperties": False}},
    {"name": "Glob", "input_schema": {"type": "object", "properties": {"pattern": STRING, "path": STRING},
                                      "required": ["pattern"], "additionalProperties": False}},
    {"name": "Grep", "input_schema": {"type": "object", "properties": {
        "pattern": STRING, "path": STRING, "glob": STRING,
        "output_mode": {"type": "string", "enum": ["content", "files_with_matches", "count"]},
        "-B": {"type": "number"}, "-A": {"type": "number"}, "-C": {"type": "number"}, "-n": {"type": "boolean"},
        "-i": {"type": "boolean"}, "type": STRING, "head_limit": {"type": "number"}, "multiline": {"type": "boolean"}},
        "required": ["pattern"], "additionalProperties": False}},
    {"name": "Task", "input_schema": {"type": "object", "properties": {
        "description": STRING, "prompt": STRING, "subagent_type": STRING},
        "required": ["description", "prompt", "subagent_type"], "additionalProperties": False}},
    {"name": "TodoWrite", "input_schema": {"type": "object", "properties": {"todos": {"type": "array", "items": {
        "type": "object", "properties": {
            "content": {"type": "string", "minLength": 1},
            "status": {"type": "string", "enum": ["pending", "in_progress", "completed"]},
            "activeForm": {"type": "string", "minLength": 1}},
        "required": ["content", "status", "activeForm"], "additionalProperties": False}}},
        "required": ["todos"], "additionalProperties": False, "$schema": "http://json-schema.org/draft-07/schema#"}},
    {"name": "WebFetch", "input_schema": {"type": "object", "properties": {
        "url": {"type": "string", "format": "uri"}, "prompt": STRING}, "required": ["url", "prompt"],
        "additionalProperties": False}},
    {"name": "NotebookEdit", "input_schema": {"type": "object", "properties": {
        "notebook_path": STRING, "cell_id": STRING, "new_source": STRING,
        "cell_type": {"type": "string", "enum": ["code", "markdown"]},
        "edit_mode": {"type": "string", "enum": ["replace", "insert", "delete"]}},
        "required": ["notebook_path", "new_source"], "additionalProperties": False}},
    {"name": "ExitPlanMode", "input_schema": {"type": "object", "properties": {"plan": STRING},
                                              "required": ["plan"], "additionalProperties": False}},
] + [
    {"name": f"mcp__server{i}__tool{i}", "description": f"An MCP tool number {i}.", "input_schema": {
        "type": "object", "properties": {
            "query": STRING, "options": {"type": "object", "properties": {
                "depth": {"type": "integer", "minimum": 0, "maximum": 5},
                "filters": {"type": "array", "items": {"anyOf": [STRING, {"type": "object", "properties": {
                    "field": STRING, "value": STRING}, "required": ["field"]}]}}}}},
        "required": ["query"]}}
    for i in range(20)
]


def test_a_forced_call_among_claude_codes_tools_validates(stack):
    """The whole tool set is taken as Claude Code sends it, and a call forced to one of its tools
    comes back as a tool_use block whose input keeps to that tool's schema."""
    client = anthropic.Anthropic(base_url=stack.url, api_key="x", max_retries=0, timeout=300)
    reply = client.messages.create(
        model="claude-sonnet-4-6", max_tokens=160, tools=TOOLS, tool_choice={"type": "tool", "name": "Glob"},
        messages=[{"role": "user", "content": "Find every Python file in the project."}],
        extra_body={"temperature": 0})
    calls = [block for block in reply.content if block.type == "tool_use"]
    assert reply.stop_reason == "tool_use" and [call.name for call in calls] == ["Glob"]
    jsonschema.validate(calls[0].input, next(t["input_schema"] for t in TOOLS if t["name"] == "Glob"))


@pytest.mark.parametrize("vocabulary", ["smollm2", "qwen3"])
def test_forced_grammars_over_claude_codes_whole_tool_set_compile(vocabulary, tokenizers):
    """Both forms the gateway builds (the generic JSON call on SmolLM2, Hermes blocks on qwen3)
    compile in the worker's grammar engine for all 32 tools at once, and llguidance accepts a
    real call under them."""
    import json

    import llguidance as llg

    from gateway.dialects import ANTHROPIC
    from gateway.neutral import REQUIRED, NeutralRequest, ToolChoice
    from gateway.tool_calls import call_functions, call_schema
    from shared.conventions.hermes import HERMES
    from worker.grammar import GrammarEngine

    tokenizer = tokenizers[vocabulary]
    engine = GrammarEngine(tokenizer, tokenizer.vocab_size)
    request = NeutralRequest(dialect=ANTHROPIC, model="m", messages=[], tool_choice=ToolChoice(REQUIRED),
                             tools=[{"type": "function", "function": {"name": t["name"], "parameters": t["input_schema"]}}
                                    for t in TOOLS])
    if vocabulary == "smollm2":
        grammar = engine.compile("json_schema", json.dumps(
            {"anyOf": [call_schema(request, tool, whitespace=False) for tool in request.tools]}))
        call = '{"name":"Glob","arguments":{"pattern":"**/*.py"}}'
    else:
        grammar = engine.compile("lark", HERMES.calls_lark(tokenizer, call_functions(request, request.tools), parallel=True))
        call = '<tool_call>\n{"name": "Glob", "arguments": {"pattern": "**/*.py"}}\n</tool_call>'
    matcher = llg.LLMatcher(engine.ll_tokenizer(), grammar)
    assert not matcher.is_error()
    assert matcher.consume_tokens(tokenizer.encode(call, add_special=False)), matcher.get_error()
    assert matcher.is_accepting()
