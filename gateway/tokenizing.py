"""llama-server's tokenizer endpoints: ``POST /tokenize`` and ``POST /detokenize``, in its shapes.

``/tokenize`` takes ``{"content", "add_special"?, "parse_special"?, "with_pieces"?}`` and answers
``{"tokens": [ids]}``, or with pieces ``{"tokens": [{"id", "piece"}]}``, a piece being the
token's text, or its bytes as a list of integers where they are not UTF-8 on their own. Given a
Chat Completions body instead (``messages``, and any other field of that dialect), it tokenizes
the prompt a generation of that body would run, template and tools included (as llama-server
does), so a router counts a chat prompt exactly: its length is the reply's ``usage.prompt_tokens``.
``/detokenize`` takes ``{"tokens"}`` and answers ``{"content"}``, control tokens written out.
"""

from __future__ import annotations

from typing import Any

from gateway.dialects import openai_chat
from gateway.generation import prepare
from gateway.prompting import ModelView
from gateway.request_fields import field, unknown_fields, token_ids
from shared.tokenizer import Tokenizer

TOKENIZE_FIELDS = {"content", "add_special", "parse_special", "with_pieces", "model"}
DETOKENIZE_FIELDS = {"tokens", "model"}
OWN_FIELDS = {"with_pieces"}  # what /tokenize reads beside a Chat Completions body


def tokenize(body: dict[str, Any], view: ModelView, headers: Any) -> dict[str, Any]:
    with_pieces = field(body, "with_pieces", bool, default=False)
    if "messages" in body:
        chat = {key: value for key, value in body.items() if key not in OWN_FIELDS}
        ids = prepare(view, openai_chat.parse(chat, view, headers))[1]
    else:
        unknown_fields(body, TOKENIZE_FIELDS)
        content = field(body, "content", str, required=True)
        add_special = field(body, "add_special", bool, default=False)
        parse_special = field(body, "parse_special", bool, default=True)
        ids = view.tokenizer.encode(content, add_special=add_special, parse_special=parse_special)
    return {"tokens": pieces(view.tokenizer, ids) if with_pieces else ids}


def pieces(tokenizer: Tokenizer, ids: list[int]) -> list[dict[str, Any]]:
    """Each token with its text; a token whose bytes are not UTF-8 by themselves (part of a
    character) carries the bytes, as llama-server gives them."""
    out = []
    for token_id in ids:
        raw = tokenizer.token_bytes(token_id)
        try:
            piece: str | list[int] = raw.decode("utf-8")
        except UnicodeDecodeError:
            piece = list(raw)
        out.append({"id": token_id, "piece": piece})
    return out


def detokenize(body: dict[str, Any], view: ModelView) -> dict[str, Any]:
    unknown_fields(body, DETOKENIZE_FIELDS)
    ids = token_ids(field(body, "tokens", list, required=True), "tokens", view.tokenizer.vocab_size)
    return {"content": view.tokenizer.decode(ids)}
