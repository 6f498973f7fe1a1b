"""Errors to HTTP responses, per dialect: the one place where LmserveError meets the wire.

OpenAI dialects: ``{"error": {"message", "type", "param", "code"}}``.
Anthropic: ``{"type": "error", "error": {"type", "message"}, "request_id"}``.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from starlette.responses import JSONResponse

from gateway.dialects import ANTHROPIC, CHAT, COMPLETIONS, RESPONSES, dialect_of_path
from shared.errors import ContextOverflowError, LmserveError

# status -> (OpenAI type, OpenAI code)
_OPENAI_TYPES = {
    400: ("invalid_request_error", None),
    401: ("invalid_request_error", "invalid_api_key"),
    403: ("permission_error", "forbidden"),
    404: ("invalid_request_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    408: ("invalid_request_error", "request_timeout"),
    413: ("invalid_request_error", "request_too_large"),
    429: ("rate_limit_error", "rate_limit_exceeded"),
    500: ("server_error", "server_error"),
    501: ("invalid_request_error", "not_implemented"),
    503: ("server_error", "service_unavailable"),
}

# status -> Anthropic error.type
_ANTHROPIC_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 405: "invalid_request_error", 408: "invalid_request_error", 413: "request_too_large",
    429: "rate_limit_error", 500: "api_error", 501: "invalid_request_error",
    503: "overloaded_error", 504: "timeout_error", 529: "overloaded_error",
}


def request_id() -> str:
    return "req_" + secrets.token_hex(12)


# Endpoints beside the dialects that OpenAI-shaped clients call (embeddings, llama-server's
# tokenizer, LM Studio's model listing): their errors are in the OpenAI envelope, whatever the headers.
OPENAI_ENVELOPE_PATHS = ("/v1/embeddings", "/tokenize", "/detokenize", "/api/v0/", "/api/v1/")


def dialect_for_path(path: str, headers: Any = None) -> str:
    """Which envelope an error on this path should use (for 404s and edge errors too)."""
    dialect = dialect_of_path(path)
    if dialect is not None:
        return dialect
    if path.startswith(OPENAI_ENVELOPE_PATHS):
        return CHAT
    if headers is not None and ("anthropic-version" in headers or "x-api-key" in headers):
        return ANTHROPIC
    return CHAT


def status_for(dialect: str, error: LmserveError) -> int:
    # Anthropic clients expect 529 "overloaded" when the backend is down, not 503
    if dialect == ANTHROPIC and error.status == 503:
        return 529
    return error.status


def error_body(dialect: str, error: LmserveError, rid: str | None = None) -> dict[str, Any]:
    status = error.status
    message = error.message
    if dialect == ANTHROPIC:
        return {"type": "error",
                "error": {"type": _ANTHROPIC_TYPES.get(status, "api_error"), "message": message},
                "request_id": rid or request_id()}
    if isinstance(error, ContextOverflowError):
        what = "prompt" if dialect == COMPLETIONS else "messages"
        message = (f"This model's maximum context length is {error.budget} tokens. However, your {what} "
                   f"resulted in {'at least ' if error.at_least else ''}{error.prompt_tokens} tokens, which leaves "
                   f"no room for a completion. Please reduce the length of the {what}.")
    kind, code = _OPENAI_TYPES.get(status, ("server_error", "server_error"))
    param = error.param
    if isinstance(error, ContextOverflowError) and dialect in (RESPONSES, COMPLETIONS):
        # Responses carries the conversation in "input", text completions in "prompt"
        param = "input" if dialect == RESPONSES else "prompt"
    return {"error": {"message": message, "type": kind, "param": param, "code": error.code or code}}


def error_response(dialect: str, error: LmserveError, headers: dict[str, str] | None = None) -> JSONResponse:
    rid = request_id()
    out_headers = {"request-id": rid, **(headers or {})}
    retry_after = getattr(error, "retry_after", None)
    if error.status == 429 and retry_after is not None:
        out_headers["retry-after"] = str(max(1, round(retry_after)))
    return JSONResponse(error_body(dialect, error, rid), status_code=status_for(dialect, error),
                        headers=out_headers)


def sse_error_payload(dialect: str, error: LmserveError) -> str:
    """The body of an in-stream error event (after the 200 headers went out)."""
    return json.dumps(error_body(dialect, error))
