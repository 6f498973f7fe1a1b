"""The wire dialects the gateway speaks, one module each, and the names that tell them apart
(in the neutral request, the access log and the choice of error envelope)."""

CHAT = "chat"  # OpenAI Chat Completions: openai_chat.py
RESPONSES = "responses"  # OpenAI Responses: openai_responses.py
ANTHROPIC = "anthropic"  # Anthropic Messages: anthropic_messages.py
