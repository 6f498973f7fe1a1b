"""The OpenAPI document (``/openapi.json``, rendered at ``/docs``): the endpoints as they are.

The request bodies are read as raw JSON by each dialect, so FastAPI has no models to describe
them; their schemas are built here from the dialects' own field lists instead: every field a
dialect honors, every field it accepts and ignores, and nothing else (an unknown field is a
400, so ``additionalProperties`` is false), with the fields it requires. The replies are
described by their shape and their media types (JSON, or ``text/event-stream`` with
``stream: true``).
"""

from __future__ import annotations

from typing import Any

from gateway.dialects import anthropic_messages, openai_chat, openai_completions, openai_responses

# Types of the fields common enough to state; a field not listed takes any JSON value.
FIELD_TYPES: dict[str, dict[str, Any]] = {
    "model": {"type": "string"},
    "messages": {"type": "array", "items": {"type": "object"}},
    "input": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]},
    "prompt": {"oneOf": [{"type": "string"}, {"type": "array"}]},
    "system": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]},
    "instructions": {"type": "string"},
    "stream": {"type": "boolean"},
    "max_tokens": {"type": "integer", "minimum": 0},
    "max_completion_tokens": {"type": "integer", "minimum": 1},
    "max_output_tokens": {"type": "integer", "minimum": 1},
    "temperature": {"type": "number", "minimum": 0},
    "top_p": {"type": "number"},
    "top_k": {"type": "integer"},
    "seed": {"type": "integer"},
    "tools": {"type": "array", "items": {"type": "object"}},
    "stop": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
    "stop_sequences": {"type": "array", "items": {"type": "string"}},
    "cartridges": {"type": "array", "items": {"type": "string"},
                   "description": "this server's extension: the KV prefixes (cartridges, by name) to serve the "
                                  "request behind instead of the default one; several compose in "
                                  "the order given"},
    "speculation": {"type": "boolean", "description": "this server's extension: false turns speculative decoding "
                    "off for the request (it never changes a token)"},
    "grammar": {"type": "object", "description": "this server's extension: {type: json_schema | regex | lark "
                "| llguidance, definition}, the reply held to it"},
}
REQUIRED = {"chat": ["messages"], "completions": ["prompt"], "responses": ["input"],
            "messages": ["messages", "max_tokens"], "count_tokens": ["messages"]}
ENDPOINTS = [  # path, operation id, summary, dialect module, schema name
    ("/v1/chat/completions", "chat", "OpenAI Chat Completions", openai_chat, "ChatCompletionRequest"),
    ("/v1/completions", "completions", "OpenAI text completions (base models, infill)", openai_completions,
     "CompletionRequest"),
    ("/v1/responses", "responses", "OpenAI Responses (stateless: store is never kept)", openai_responses,
     "ResponseRequest"),
    ("/v1/messages", "messages", "Anthropic Messages", anthropic_messages, "MessageRequest"),
]


def request_schema(module: Any, required: list[str]) -> dict[str, Any]:
    properties = {}
    for name in sorted(module.HONORED | module.IGNORED):
        schema = dict(FIELD_TYPES.get(name, {}))
        if name in module.IGNORED:
            schema["description"] = "accepted and ignored"
        properties[name] = schema
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


def document(version: str) -> dict[str, Any]:
    error = {"description": "an error in the dialect's own envelope",
             "content": {"application/json": {"schema": {"type": "object"}}}}
    schemas: dict[str, Any] = {}
    paths: dict[str, Any] = {}
    for path, operation, summary, module, name in ENDPOINTS:
        schemas[name] = request_schema(module, REQUIRED[operation])
        paths[path] = {"post": {
            "operationId": operation, "summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{name}"}}}},
            "responses": {
                "200": {"description": "the reply; with stream: true, server-sent events of the dialect",
                        "content": {"application/json": {"schema": {"type": "object"}},
                                    "text/event-stream": {"schema": {"type": "string"}}}},
                "400": error, "401": error, "413": error, "429": error, "503": error}}}
    schemas["CountTokensRequest"] = {**request_schema(anthropic_messages, REQUIRED["count_tokens"]),
                                     "description": "a Messages request; max_tokens and stream are not needed"}
    paths["/v1/messages/count_tokens"] = {"post": {
        "operationId": "count_tokens", "summary": "Anthropic token counting: the prompt a Messages request would run",
        "requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": "#/components/schemas/CountTokensRequest"}}}},
        "responses": {"200": {"description": "{input_tokens}", "content": {"application/json": {"schema": {
            "type": "object", "properties": {"input_tokens": {"type": "integer"}}}}}}, "400": error}}}
    for path, summary, body in (
            ("/v1/models", "The served model, in a body both SDKs accept", "a list of one model"),
            ("/v1/models/{model_id}", "The served model under the id asked for", "one model"),
            ("/health", "Ready (200) or loading (503); no API key", "status, model, worker load"),
            ("/metrics", "Prometheus metrics of the gateway (text format)", "the metrics page")):
        operation: dict[str, Any] = {"summary": summary, "responses": {"200": {"description": body}}}
        if "{model_id}" in path:
            operation["parameters"] = [{"name": "model_id", "in": "path", "required": True,
                                        "schema": {"type": "string"}}]
        paths[path] = {"get": operation}
    return {
        "openapi": "3.1.0",
        "info": {"title": "lmserve", "version": version,
                 "description": "One model behind OpenAI Chat Completions, OpenAI Responses and Anthropic "
                                "Messages (docs/API.md has what each field does here)."},
        "paths": paths,
        "components": {"schemas": schemas, "securitySchemes": {
            "bearer": {"type": "http", "scheme": "bearer"},
            "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"}}},
        "security": [{"bearer": []}, {"apiKey": []}, {}],
    }
