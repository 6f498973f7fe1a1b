"""What more than one dialect needs when reading requests: reasoning knobs, stop lists,
sampling fields. (Wire shapes stay in each dialect's own module.)"""

from __future__ import annotations

import secrets
from typing import Any

from gateway.neutral import TokenLogprob
from gateway.prompting import ModelView
from gateway.request_fields import check_type, field
from shared.errors import InvalidRequestError

EFFORT_OFF = ("none", "minimal")
EFFORT_ON = ("low", "medium", "high", "xhigh", "max", "default")


def new_id(prefix: str, length: int = 24) -> str:
    return prefix + secrets.token_hex(length // 2)


def reasoning_from_effort(effort: str | None, view: ModelView, param: str, reject_unsupported: bool) -> bool:
    """An OpenAI-style effort value to reasoning on/off.

    Off values are always fine. On values enable the model's reasoning channel; on a model
    without one they are rejected (reject_unsupported) or quietly ignored.
    """
    if effort is None or effort in EFFORT_OFF:
        return False
    if effort not in EFFORT_ON:
        raise InvalidRequestError(
            f"'{param}' must be one of {', '.join(EFFORT_OFF + EFFORT_ON)}, got {effort!r}", param=param)
    if view.has_reasoning_channel:
        return True
    if reject_unsupported:
        raise InvalidRequestError(
            f"the model {view.model_id} has no reasoning channel, so '{param}' {effort!r} cannot be "
            f"honoured; send 'none' or leave it out", param=param)
    return False


def stop_list(value: Any, param: str, limit: int = 16) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    check_type(value, list, param)
    if len(value) > limit:
        raise InvalidRequestError(f"'{param}' takes at most {limit} sequences, got {len(value)}", param=param)
    for i, item in enumerate(value):
        check_type(item, str, f"{param}[{i}]")
    return [s for s in value if s]


def max_tokens_field(body: dict[str, Any], *keys: str) -> int | None:
    for key in keys:
        value = field(body, key, int)
        if value is not None:
            if value < 1:
                raise InvalidRequestError(f"'{key}' must be at least 1, got {value}", param=key)
            return value
    return None


def logprob_entries(items: list[TokenLogprob]) -> list[dict[str, Any]]:
    """OpenAI's logprobs entries (Chat and Responses share the shape)."""
    return [{"token": item.token, "logprob": item.logprob, "bytes": item.bytes,
             "top_logprobs": [{"token": t, "logprob": lp, "bytes": b} for t, lp, b in item.top]}
            for item in items]
