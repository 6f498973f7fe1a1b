"""One error hierarchy for lmserve.

Errors are raised deep (loader, tokenizer, template, engine, worker) and mapped to a
dialect's HTTP envelope in exactly one place at the gateway edge. Each class carries the
HTTP status it maps to and a short machine-readable ``kind``.
"""

from __future__ import annotations


class LmserveError(Exception):
    """Base class: a message meant for the person who has to fix the problem."""

    status: int = 500
    kind: str = "internal_error"

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param  # the request field at fault, where one is
        self.code = code  # a finer machine-readable code (OpenAI's "code")


class ModelLoadError(LmserveError):
    """The model file cannot be served: missing, truncated, corrupt or unsupported."""

    kind = "model_load_error"


class TokenizerError(LmserveError):
    """The GGUF's tokenizer metadata is missing or of a kind we do not build."""

    kind = "tokenizer_error"


class InvalidRequestError(LmserveError):
    """The caller sent something we cannot honour; the message says what to change."""

    status = 400
    kind = "invalid_request_error"


class TemplateError(InvalidRequestError):
    """The chat template failed to render these messages (or raised on purpose)."""

    kind = "template_error"


class ContextOverflowError(InvalidRequestError):
    """The prompt leaves no room for a completion in the per-request context budget."""

    kind = "context_overflow"

    def __init__(self, prompt_tokens: int, budget: int, at_least: bool = False):
        # Anthropic's wording, which Claude Code's recovery matches on; dialects may reword.
        super().__init__(f"prompt is too long: {prompt_tokens} tokens > {budget - 1} maximum",
                         param="messages", code="context_length_exceeded")
        self.prompt_tokens = prompt_tokens
        self.budget = budget
        self.at_least = at_least  # prompt_tokens is a lower bound: the prompt was not tokenized


class RequestTimeoutError(LmserveError):
    """The client took too long to send its request's headers."""

    status = 408
    kind = "invalid_request_error"


class AuthenticationError(LmserveError):
    status = 401
    kind = "authentication_error"


class PermissionDeniedError(LmserveError):
    status = 403
    kind = "permission_error"


class NotFoundError(LmserveError):
    status = 404
    kind = "not_found_error"


class PayloadTooLargeError(LmserveError):
    status = 413
    kind = "request_too_large"


class BusyError(LmserveError):
    """The worker's admission queue (or the gateway's connection cap) is full; retry shortly."""

    status = 429
    kind = "rate_limit_error"
    retry_after: float = 1.0


class WorkerUnavailableError(LmserveError):
    """The worker is not connected, not ready, or went silent."""

    status = 503
    kind = "worker_unavailable"


class ShuttingDownError(LmserveError):
    """The gateway is shutting down and its drain timeout has passed: the reply is cut."""

    status = 503
    kind = "shutting_down"
