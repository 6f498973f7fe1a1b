"""The OpenAPI document (``/openapi.json``, rendered at ``/docs``): the endpoints as they are.

The request bodies are read as raw JSON by each dialect, so FastAPI has no models to describe
them; their schemas are built here from the dialects' own field lists instead: every field a
dialect honors, every field it accepts and ignores, with the fields it requires. Other fields
are ignored (``additionalProperties`` true, the rule in each schema's description), or a 400
on a gateway started with ``--strict-fields`` (``additionalProperties`` false). The replies are
described by their shape and their media types (JSON, or ``text/event-stream`` with
``stream: true``).
"""

from __future__ import annotations

from typing import Any

from gateway import embeddings, tokenizing
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
    "chat_template_kwargs": {"type": "object", "additionalProperties": True,
                             "description": "more variables for the model's chat template (vLLM's and "
                                            "llama-server's field), e.g. {enable_thinking: false}; a key the "
                                            "template never reads, or one the server sets itself (messages, "
                                            "tools, bos_token, add_generation_prompt, ...), is a 400"},
    "thinking": {"type": "object", "description": "{type: enabled, budget_tokens} opens the model's reasoning "
                 "and caps it: at budget_tokens reasoning tokens the block is closed as the template closes it "
                 "and the answer follows; {type: disabled} turns it off where the template can"},
    "reasoning_effort": {"type": "string",
                         "description": "a reasoning budget: low 1024, medium 4096, high 16384 tokens, or a quarter, "
                                        "half or three quarters of the reply's max tokens where that is less; none "
                                        "and minimal turn reasoning off; other words set no budget"},
    "reasoning": {"type": "object", "description": "{effort}: a reasoning budget, as reasoning_effort"},
    "min_p": {"type": "number"},
    "repetition_penalty": {"type": "number"},
    "encoding_format": {"enum": ["float", "base64"]},
    "dimensions": {"type": "integer", "description": "only the model's own width"},
    "content": {"type": "string"},
    "add_special": {"type": "boolean"},
    "parse_special": {"type": "boolean"},
    "with_pieces": {"type": "boolean"},
}
# the input of /v1/embeddings: a text, texts, token ids or arrays of token ids
EMBEDDING_INPUT = {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}},
                             {"type": "array", "items": {"type": "integer"}},
                             {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}}]}
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


# what a generation's reply may carry besides its body
REPLY_HEADERS = {
    "x-lmserve-ignored-fields": {"description": "the paths of the request's unknown fields, which were ignored",
                                 "schema": {"type": "string"}},
    "x-lmserve-truncated": {"description": "why a whole (not streamed) reply was cut by a server "
                                           "limit: deadline (--max-request-seconds) or max_output_tokens "
                                           "(--max-output-tokens); a stream says it in its usage, as truncated", "schema": {"type": "string"}},
    "x-lmserve-warning": {"description": "e.g. tools sent to a model without a tool-call convention",
                          "schema": {"type": "string"}},
}


TOLERANT = ("Unknown fields, at the top level and inside messages and content blocks, are ignored: "
            "each reply lists their paths in x-lmserve-ignored-fields.")
STRICT = "Unknown fields are a 400 (this gateway runs with --strict-fields)."


def unknown_fields_rule(schemas: dict[str, Any], strict: bool) -> None:
    """Each request schema opened (or closed, with --strict-fields) to fields it does not list."""
    for schema in schemas.values():
        for shape in schema.get("oneOf", [schema]):
            shape["additionalProperties"] = not strict
        rule = STRICT if strict else TOLERANT
        schema["description"] = f"{schema['description']}. {rule}" if schema.get("description") else rule


def request_schema(module: Any, required: list[str]) -> dict[str, Any]:
    return fields_schema(module.HONORED | module.IGNORED, required, ignored=module.IGNORED)


def fields_schema(names: set[str], required: list[str], ignored: set[str] = frozenset(),
                  types: dict[str, Any] | None = None) -> dict[str, Any]:
    """An object of exactly these fields (each typed from ``types`` or FIELD_TYPES where known)."""
    properties = {}
    for name in sorted(names):
        schema = dict((types or {}).get(name) or FIELD_TYPES.get(name, {}))
        if name in ignored:
            schema["description"] = "accepted and ignored"
        properties[name] = schema
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


def json_operation(operation: str, summary: str, schema: str, reply: str, reply_schema: dict[str, Any],
                   error: dict[str, Any]) -> dict[str, Any]:
    """A POST of a JSON body answered with JSON."""
    return {"post": {
        "operationId": operation, "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{schema}"}}}},
        "responses": {"200": {"description": reply, "content": {"application/json": {"schema": reply_schema}}},
                      "400": error, "401": error, "503": error}}}


def document(version: str, strict_fields: bool = False) -> dict[str, Any]:
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
                        "headers": REPLY_HEADERS,
                        "content": {"application/json": {"schema": {"type": "object"}},
                                    "text/event-stream": {"schema": {"type": "string"}}}},
                "400": error, "401": error, "413": error, "429": error, "503": error}}}
    schemas["CountTokensRequest"] = {**request_schema(anthropic_messages, REQUIRED["count_tokens"]),
                                     "description": "a Messages request; max_tokens and stream are not needed"}
    count = {"type": "object", "properties": {"input_tokens": {"type": "integer"}}}
    paths["/v1/messages/count_tokens"] = json_operation(
        "count_tokens", "Anthropic token counting: the prompt a Messages request would run", "CountTokensRequest",
        "{input_tokens}", count, error)
    schemas["InputTokensRequest"] = {
        **fields_schema(openai_responses.HONORED | openai_responses.IGNORED | openai_responses.INPUT_TOKENS_IGNORED,
                        [], ignored=openai_responses.IGNORED | openai_responses.INPUT_TOKENS_IGNORED),
        "description": "a Responses request; what it would generate is not read"}
    paths["/v1/responses/input_tokens"] = json_operation(
        "input_tokens", "OpenAI Responses token counting: the prompt a Responses request would run",
        "InputTokensRequest", "{object: response.input_tokens, input_tokens}",
        {**count, "properties": {**count["properties"], "object": {"const": "response.input_tokens"}}}, error)
    schemas["EmbeddingRequest"] = fields_schema(embeddings.FIELDS, ["input"], ignored={"user"},
                                                types={"input": EMBEDDING_INPUT})
    paths["/v1/embeddings"] = json_operation(
        "embeddings", "OpenAI embeddings: the mean of the final hidden states, unit length", "EmbeddingRequest",
        "{object: list, data: [{object: embedding, index, embedding}], model, usage}", {"type": "object"}, error)
    schemas["TokenizeRequest"] = {
        "oneOf": [fields_schema(tokenizing.TOKENIZE_FIELDS, ["content"], ignored={"model"}),
                  fields_schema(openai_chat.HONORED | openai_chat.IGNORED | tokenizing.OWN_FIELDS, ["messages"],
                                ignored=openai_chat.IGNORED)],
        "description": "llama-server's {content, add_special, parse_special, with_pieces}, or a Chat Completions "
                       "request (with with_pieces) whose prompt is tokenized as a generation would run it"}
    paths["/tokenize"] = json_operation(
        "tokenize", "llama-server's tokenizer: ids, or {id, piece} with with_pieces", "TokenizeRequest",
        "{tokens}", {"type": "object", "properties": {"tokens": {"type": "array"}}}, error)
    schemas["DetokenizeRequest"] = fields_schema(tokenizing.DETOKENIZE_FIELDS, ["tokens"], ignored={"model"},
                                                 types={"tokens": {"type": "array", "items": {"type": "integer"}}})
    paths["/detokenize"] = json_operation(
        "detokenize", "llama-server's detokenizer: the text of token ids", "DetokenizeRequest", "{content}",
        {"type": "object", "properties": {"content": {"type": "string"}}}, error)
    for path, summary, body in (
            ("/v1/models", "The served model, in a body both SDKs accept", "a list of one model"),
            ("/v1/models/{model_id}", "The served model under the id asked for", "one model"),
            ("/api/v0/models", "LM Studio's listing: the model loaded, its contexts, quantization, capabilities",
             "{object: list, data: [model]}"),
            ("/api/v0/models/{model_id}", "LM Studio's listing of one model, under the id asked for", "one model"),
            ("/api/v1/models", "LM Studio's newer listing, with the loaded instance", "{models: [model]}"),
            ("/health", "Ready (200) or loading (503); no API key", "status, model, worker load"),
            ("/metrics", "Prometheus metrics of the gateway (text format)", "the metrics page")):
        operation: dict[str, Any] = {"summary": summary, "responses": {"200": {"description": body}}}
        if "{model_id}" in path:
            operation["parameters"] = [{"name": "model_id", "in": "path", "required": True,
                                        "schema": {"type": "string"}}]
        paths[path] = {"get": operation}
    unknown_fields_rule(schemas, strict_fields)
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
