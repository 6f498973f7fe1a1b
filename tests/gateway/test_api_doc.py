"""docs/API.md against the code: its field tables against the dialect modules' field sets, and
its field and error tables against the real stack (worker + gateway on loopback)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest
from conftest import wait_until

from gateway.dialects import anthropic_messages, openai_chat, openai_completions, openai_responses

DOC = Path(__file__).resolve().parents[2] / "docs" / "API.md"
STATUSES = {"honored", "ignored", "rejected"}

http = httpx.Client(timeout=60)


# --- reading the document -------------------------------------------------------------------

def table_after(heading: str) -> list[dict[str, str]]:
    """The first markdown table after a heading line, as one dict per row keyed by the header."""
    lines = DOC.read_text(encoding="utf-8").splitlines()
    assert heading in lines, f"docs/API.md has no heading {heading!r}"
    start = lines.index(heading) + 1
    while start < len(lines) and not lines[start].startswith("|"):
        assert not lines[start].startswith("#"), f"no table under {heading!r}"
        start += 1
    block = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        block.append(line)
    header, rows = _cells(block[0]), block[2:]
    table = []
    for row in rows:
        cells = _cells(row)
        # a stray "|" inside a cell would shift every column after it
        assert len(cells) == len(header), f"row under {heading!r} has {len(cells)} cells, not {len(header)}: {row}"
        table.append(dict(zip(header, cells)))
    return table


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def _name(cell: str) -> str:
    return cell.strip().strip("`")


# --- the three dialects ---------------------------------------------------------------------

HI = [{"role": "user", "content": "Hi"}]


@dataclass
class Dialect:
    name: str
    module: ModuleType
    heading: str
    path: str
    minimal: dict[str, Any]  # the smallest valid request, one generated token
    rejected_samples: dict[str, Any]  # a plausible value for each REJECTED field
    ignored_samples: dict[str, Any]  # a plausible value of the right type for each IGNORED field
    anthropic: bool = False

    def fields(self, kind: str) -> set[str]:
        return set(getattr(self.module, kind, set()))

    def error_of(self, response: httpx.Response) -> dict[str, Any]:
        """The error object of a response, checked to be in this dialect's envelope."""
        body = response.json()
        if self.anthropic:
            assert body["type"] == "error" and body["request_id"].startswith("req_"), body
            assert set(body["error"]) == {"type", "message"}, body
        else:
            assert set(body) == {"error"}, body
            assert set(body["error"]) == {"message", "type", "param", "code"}, body
        return body["error"]


CHAT = Dialect(
    "chat", openai_chat, "### Chat Completions request fields", "/v1/chat/completions",
    {"model": "m", "messages": HI, "max_tokens": 1},
    rejected_samples={
        "functions": [{"name": "get_weather", "parameters": {"type": "object", "properties": {}}}],
        "function_call": "auto",
    },
    ignored_samples={
        "user": "user-1", "safety_identifier": "sid-1", "metadata": {"purpose": "doc-test"}, "store": False,
        "service_tier": "auto", "prompt_cache_retention": "24h", "prompt_cache_options": {},
        "verbosity": "low", "modalities": ["text"], "audio": {"voice": "alloy", "format": "wav"},
        "prediction": {"type": "content", "content": "Hello"}, "web_search_options": {"search_context_size": "low"},
        "moderation": {},
    })

RESPONSES = Dialect(
    "responses", openai_responses, "### Responses request fields", "/v1/responses",
    {"model": "m", "input": "Hi", "max_output_tokens": 1},
    rejected_samples={
        "previous_response_id": "resp_0123456789abcdef", "conversation": "conv_0123456789abcdef",
        "prompt": {"id": "pmpt_0123456789abcdef", "version": "1"},
    },
    ignored_samples={
        "user": "user-1", "safety_identifier": "sid-1", "client_metadata": {"x-codex-turn": "1"},
        "service_tier": "auto", "stream_options": {"include_obfuscation": False},
        "prompt_cache_retention": "24h", "prompt_cache_options": {}, "max_tool_calls": 4,
        "context_management": [{"type": "compaction", "compact_threshold": 100000}],
    })

MESSAGES = Dialect(
    "messages", anthropic_messages, "### Messages request fields", "/v1/messages",
    {"model": "m", "messages": HI, "max_tokens": 1},
    rejected_samples={},
    ignored_samples={
        "metadata": {"user_id": "user-1"}, "service_tier": "standard_only", "cache_control": {"type": "ephemeral"},
        "container": "container_1", "diagnostics": {}, "inference_geo": "us", "speed": "standard",
        "user_profile_id": "profile-1", "workspace_id": "workspace-1", "context_management": {"edits": []},
        "mcp_servers": [], "compaction": {}, "betas": ["interleaved-thinking-2025-05-14"],
        "billing_policy": "standard", "fallback_credit_token": "token-1", "fallbacks": [], "thread": {},
    },
    anthropic=True)

COMPLETIONS = Dialect(
    "completions", openai_completions, "### Completions request fields", "/v1/completions",
    {"model": "m", "prompt": "Hi", "max_tokens": 1},
    rejected_samples={},
    ignored_samples={"user": "user-1", "metadata": {"purpose": "doc-test"}})

DIALECTS = [CHAT, RESPONSES, MESSAGES, COMPLETIONS]
by_name = pytest.mark.parametrize("dialect", DIALECTS, ids=[d.name for d in DIALECTS])


def with_text(dialect: Dialect, text: str) -> dict[str, Any]:
    """The minimal request with this user text instead of "Hi"."""
    if dialect is RESPONSES:
        return {**dialect.minimal, "input": text}
    if dialect is COMPLETIONS:
        return {**dialect.minimal, "prompt": text}
    return {**dialect.minimal, "messages": [{"role": "user", "content": text}]}


def post(stack, dialect: Dialect, body: Any = None, content: bytes | None = None, path: str | None = None,
         headers: dict[str, str] | None = None) -> httpx.Response:
    return http.post(stack.url + (path or dialect.path), json=body if content is None else None,
                     content=content, headers=headers)


# --- the field tables against the modules ---------------------------------------------------

@by_name
def test_field_table_matches_the_module(dialect):
    rows = table_after(dialect.heading)
    assert [*rows[0]] == ["field", "status", "notes"]
    statuses = {_name(row["field"]): row["status"] for row in rows}
    assert len(statuses) == len(rows), "a field is listed twice"
    assert set(statuses.values()) <= STATUSES, f"statuses other than {STATUSES}: {set(statuses.values()) - STATUSES}"
    for kind in ("HONORED", "IGNORED", "REJECTED"):
        documented = {field for field, status in statuses.items() if status == kind.lower()}
        assert documented == dialect.fields(kind), (
            f"{dialect.name} {kind}: only in the doc {sorted(documented - dialect.fields(kind))}, "
            f"only in the code {sorted(dialect.fields(kind) - documented)}")
    assert all(row["notes"] for row in rows), "every field needs a note"


@by_name
def test_samples_cover_the_module(dialect):
    # keeps the live tests below honest: a field added to a set needs a sample value here
    assert set(dialect.rejected_samples) == dialect.fields("REJECTED")
    assert set(dialect.ignored_samples) == dialect.fields("IGNORED")


# --- the field tables against the live stack ------------------------------------------------

@by_name
def test_rejected_fields_are_400_in_the_dialects_envelope(stack, dialect):
    for field, value in dialect.rejected_samples.items():
        response = post(stack, dialect, {**dialect.minimal, field: value})
        assert response.status_code == 400, (field, response.text)
        error = dialect.error_of(response)
        assert error["type"] == "invalid_request_error"
        assert f"'{field}'" in error["message"] and "unknown field" not in error["message"], error
        if not dialect.anthropic:
            assert error["param"] == field


@by_name
def test_ignored_fields_are_accepted(stack, dialect):
    response = post(stack, dialect, {**dialect.minimal, **dialect.ignored_samples})
    assert response.status_code == 200, response.text


@by_name
def test_an_unknown_field_is_ignored_and_named(stack, dialect):
    response = post(stack, dialect, {**dialect.minimal, "surely_not_a_field": True})
    assert response.status_code == 200, response.text
    assert response.headers["x-lmserve-ignored-fields"] == "surely_not_a_field"


@by_name
def test_an_unknown_field_is_400_under_strict_fields(strict_stack, dialect):
    response = post(strict_stack, dialect, {**dialect.minimal, "surely_not_a_field": True})
    assert response.status_code == 400
    error = dialect.error_of(response)
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith("unknown field 'surely_not_a_field'")
    assert "docs/API.md" in error["message"]


def test_reasoning_knobs_on_a_model_without_a_reasoning_channel(stack):
    # the default model (SmolLM2) has no reasoning channel
    chat = post(stack, CHAT, {**CHAT.minimal, "reasoning_effort": "high"})
    assert chat.status_code == 400 and CHAT.error_of(chat)["param"] == "reasoning_effort"
    assert post(stack, CHAT, {**CHAT.minimal, "reasoning_effort": "none"}).status_code == 200
    codex_like = post(stack, RESPONSES, {**RESPONSES.minimal, "reasoning": {"effort": "medium", "summary": "auto"}})
    assert codex_like.status_code == 200, codex_like.text
    assert codex_like.json()["reasoning"] == {"effort": None, "summary": None}
    claude_like = post(stack, MESSAGES, {**MESSAGES.minimal, "thinking": {"type": "enabled", "budget_tokens": 1024}})
    assert claude_like.status_code == 200, claude_like.text
    assert [block["type"] for block in claude_like.json()["content"]] in ([], ["text"])


# --- the error table against the live stack -------------------------------------------------

@pytest.fixture(scope="module")
def error_rows() -> dict[str, dict[str, str]]:
    rows = table_after("### Error table")
    return {row["condition"]: row for row in rows}


def expected(rows: dict[str, dict[str, str]], condition: str, dialect: Dialect) -> tuple[int, str, str | None]:
    row = rows[condition]
    if dialect.anthropic:
        return int(row["Anthropic status"]), row["Anthropic error.type"], None
    code = row["OpenAI error.code"]
    return int(row["OpenAI status"]), row["OpenAI error.type"], None if code == "null" else code


def check_row(rows, condition: str, dialect: Dialect, response: httpx.Response) -> None:
    status, kind, code = expected(rows, condition, dialect)
    assert response.status_code == status, (condition, dialect.name, response.text)
    error = dialect.error_of(response)
    assert error["type"] == kind, (condition, dialect.name, error)
    if not dialect.anthropic:
        assert error["code"] == code, (condition, dialect.name, error)


def test_error_table_lists_every_condition(error_rows):
    assert {*error_rows} == {
        "malformed JSON", "wrong type", "unknown field (--strict-fields)", "rejected field", "prompt too long", "oversized body",
        "missing or invalid API key", "foreign Host header", "connection cap", "worker queue full",
        "worker down or loading", "unknown path", "wrong method", "internal error"}
    for row in error_rows.values():
        assert row["OpenAI status"].isdigit() and row["Anthropic status"].isdigit(), row


# a path that is not served, per dialect (the envelope follows the path)
UNKNOWN_PATHS = {"chat": "/v2/nothing", "responses": "/v1/responses/one/two", "messages": "/v1/messages/nothing",
                 "completions": "/v1/completions/nothing"}


@by_name
def test_cheap_error_rows_on_the_live_stack(stack, strict_stack, dialect, error_rows):
    check_row(error_rows, "malformed JSON", dialect, post(stack, dialect, content=b'{"model": '))
    check_row(error_rows, "wrong type", dialect, post(stack, dialect, {**dialect.minimal, "temperature": "hot"}))
    check_row(error_rows, "unknown field (--strict-fields)", dialect,
              post(strict_stack, dialect, {**dialect.minimal, "nope": 1}))
    refused = {"chat": {"n": 2}, "responses": {"background": True},
               "messages": {"output_format": {"type": "json_object"}}, "completions": {"n": 2}}[dialect.name]
    check_row(error_rows, "rejected field", dialect, post(stack, dialect, {**dialect.minimal, **refused}))
    check_row(error_rows, "unknown path", dialect, post(stack, dialect, {}, path=UNKNOWN_PATHS[dialect.name]))
    check_row(error_rows, "wrong method", dialect, http.get(stack.url + dialect.path))
    check_row(error_rows, "foreign Host header", dialect,
              post(stack, dialect, dialect.minimal, headers={"host": "rebind.example:8080"}))


@by_name
def test_prompt_too_long_row(stack, dialect, error_rows):
    budget = http.get(stack.url + "/v1/models").json()["data"][0]["context_length"]
    response = post(stack, dialect, with_text(dialect, "word " * (budget + 50)))
    check_row(error_rows, "prompt too long", dialect, response)
    message = dialect.error_of(response)["message"]
    if dialect.anthropic:
        assert re.fullmatch(r"prompt is too long: \d+ tokens > \d+ maximum", message), message
    else:
        param = "input" if dialect is RESPONSES else "prompt" if dialect is COMPLETIONS else "messages"
        assert dialect.error_of(response)["param"] == param


@pytest.fixture(scope="module")
def guarded(start_gateway, stack_worker):
    """A gateway with an API key and a small body cap."""
    return start_gateway(stack_worker, "--api-key", "doc-key", "--max-body", "4096")


@by_name
def test_key_and_body_cap_rows(guarded, dialect, error_rows):
    check_row(error_rows, "missing or invalid API key", dialect, post(guarded, dialect, dialect.minimal))
    wrong_key = post(guarded, dialect, dialect.minimal, headers={"authorization": "Bearer wrong"})
    check_row(error_rows, "missing or invalid API key", dialect, wrong_key)
    check_row(error_rows, "oversized body", dialect,
              post(guarded, dialect, with_text(dialect, "x" * 5000), headers={"authorization": "Bearer doc-key"}))


@pytest.fixture(scope="module")
def workerless(start_gateway):
    """A gateway whose worker never answers."""
    class Nowhere:
        endpoint = "tcp://127.0.0.1:9"

    gateway = start_gateway(Nowhere, wait=False)

    def loading() -> bool:
        try:
            return http.get(gateway.url + "/health", timeout=2).status_code == 503
        except httpx.HTTPError:
            return False

    assert wait_until(loading, 30)
    return gateway


@by_name
def test_worker_down_row(workerless, dialect, error_rows):
    check_row(error_rows, "worker down or loading", dialect, post(workerless, dialect, dialect.minimal))


def test_count_tokens_takes_the_messages_body(stack):
    body = {**MESSAGES.minimal, **MESSAGES.ignored_samples}
    del body["max_tokens"]
    response = http.post(stack.url + "/v1/messages/count_tokens", json=body)
    assert response.status_code == 200 and response.json()["input_tokens"] > 0


def test_streams_end_as_documented(stack):
    """The last event of each dialect's stream, as the streaming sections promise."""
    def events(dialect: Dialect) -> list[str]:
        with http.stream("POST", stack.url + dialect.path, json={**dialect.minimal, "stream": True}) as response:
            assert response.status_code == 200
            return [line for line in response.iter_lines() if line and not line.startswith(":")]

    chat = events(CHAT)
    assert chat[-1] == "data: [DONE]"
    assert json.loads(chat[0][6:])["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    responses = [json.loads(line[6:]) for line in events(RESPONSES) if line.startswith("data: ")]
    assert [e["type"] for e in responses[:2]] == ["response.created", "response.in_progress"]
    assert responses[-1]["type"] in ("response.completed", "response.incomplete", "response.failed")
    assert [e["sequence_number"] for e in responses] == list(range(len(responses)))
    completions = events(COMPLETIONS)
    assert completions[-1] == "data: [DONE]"
    assert json.loads(completions[-2][6:])["choices"][0]["finish_reason"] == "length"
    messages = [line for line in events(MESSAGES) if line.startswith("event: ")]
    assert messages[:2] == ["event: message_start", "event: ping"]
    assert messages[-2:] == ["event: message_delta", "event: message_stop"]
