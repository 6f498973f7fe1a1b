"""The wire dialects the gateway speaks, one module each, and the names that tell them apart
(in the neutral request, the access log and the choice of error envelope)."""

CHAT = "chat"  # OpenAI Chat Completions: openai_chat.py
RESPONSES = "responses"  # OpenAI Responses: openai_responses.py
ANTHROPIC = "anthropic"  # Anthropic Messages: anthropic_messages.py
COMPLETIONS = "completions"  # OpenAI text completions (before chat): openai_completions.py

# Path prefixes of each dialect's endpoints (and of paths near them, so that a 404 there is
# still answered in the dialect its client reads).
PATH_PREFIXES = (("/v1/messages", ANTHROPIC), ("/v1/responses", RESPONSES), ("/v1/chat/", CHAT),
                 ("/v1/completions", COMPLETIONS))


def dialect_of_path(path: str) -> str | None:
    """The dialect whose endpoints a path belongs to, or None."""
    return next((name for prefix, name in PATH_PREFIXES if path.startswith(prefix)), None)
