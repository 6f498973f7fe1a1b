"""/openapi.json describes the endpoints as the server takes them (its request schemas are the
dialects' own field lists), /docs renders it, and --no-docs turns both off. GET / is the
playground for a browser and the status for anything else."""

from __future__ import annotations

import httpx
import jsonschema
import pytest

from gateway.dialects import anthropic_messages, openai_chat, openai_completions, openai_responses

SCHEMAS = {"ChatCompletionRequest": (openai_chat, "/v1/chat/completions",
                                     {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}),
           "CompletionRequest": (openai_completions, "/v1/completions", {"model": "m", "prompt": "Hi", "max_tokens": 2}),
           "ResponseRequest": (openai_responses, "/v1/responses", {"model": "m", "input": "Hi", "max_output_tokens": 2}),
           "MessageRequest": (anthropic_messages, "/v1/messages",
                              {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})}


@pytest.fixture(scope="module")
def document(stack) -> dict:
    response = httpx.get(stack.url + "/openapi.json", timeout=10)
    assert response.status_code == 200
    return response.json()


def test_the_document_is_openapi_and_lists_every_endpoint(document):
    assert document["openapi"].startswith("3.1")
    assert {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens",
            "/v1/models", "/v1/models/{model_id}", "/health", "/metrics"} <= set(document["paths"])
    jsonschema.Draft202012Validator.check_schema(document["components"]["schemas"]["ChatCompletionRequest"])


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_request_schemas_are_what_the_server_takes(document, stack, strict_stack, name):
    module, path, body = SCHEMAS[name]
    schema = document["components"]["schemas"][name]
    assert set(schema["properties"]) == module.HONORED | module.IGNORED
    jsonschema.validate(body, schema)  # a request the server answers is valid
    assert httpx.post(stack.url + path, json=body, timeout=60).status_code == 200
    unknown = {**body, "no_such_field": 1}  # valid, and ignored, by default
    jsonschema.validate(unknown, schema)
    assert httpx.post(stack.url + path, json=unknown, timeout=60).status_code == 200
    # under --strict-fields the document and the server refuse it alike
    strict = httpx.get(strict_stack.url + "/openapi.json", timeout=10).json()["components"]["schemas"][name]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(unknown, strict)
    assert httpx.post(strict_stack.url + path, json=unknown, timeout=60).status_code == 400


def test_budgets_and_the_reply_headers_are_described(document):
    from gateway.app import IGNORED_FIELDS_HEADER, TRUNCATED_HEADER, WARNING_HEADER
    from gateway.generation import EFFORT_BUDGETS

    schemas = document["components"]["schemas"]
    effort = schemas["ChatCompletionRequest"]["properties"]["reasoning_effort"]["description"]
    assert all(f"{word} {tokens}" in effort for word, (tokens, _) in EFFORT_BUDGETS.items())
    assert "budget_tokens" in schemas["MessageRequest"]["properties"]["thinking"]["description"]
    for path in ("/v1/chat/completions", "/v1/responses", "/v1/messages"):
        headers = document["paths"][path]["post"]["responses"]["200"]["headers"]
        assert {IGNORED_FIELDS_HEADER, TRUNCATED_HEADER, WARNING_HEADER} <= set(headers)


def test_docs_render_the_document_and_can_be_switched_off(stack, stack_worker, start_gateway):
    page = httpx.get(stack.url + "/docs", timeout=10)
    assert page.status_code == 200 and "/openapi.json" in page.text and "swagger" in page.text.lower()
    quiet = start_gateway(stack_worker, "--no-docs")
    assert httpx.get(quiet.url + "/openapi.json", timeout=10).status_code == 404
    assert httpx.get(quiet.url + "/docs", timeout=10).status_code == 404


def test_the_root_is_the_playground_for_a_browser_and_the_status_otherwise(stack):
    page = httpx.get(stack.url + "/", headers={"accept": "text/html,application/xhtml+xml"}, timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "lmserve playground" in page.text
    assert httpx.get(stack.url + "/", timeout=10).json() == {"status": "ok"}
