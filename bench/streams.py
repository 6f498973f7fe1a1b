"""Streaming requests to a server, timed chunk by chunk: Chat Completions (or text completions)
and Anthropic Messages, read as server-sent events."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class StreamResult:
    started: float  # perf_counter at request start
    chunk_times: list[float] = field(default_factory=list)  # perf_counter of each content chunk
    ended: float = 0.0
    tokens: int | None = None  # completion tokens as the server reported them
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    text: str = ""
    drafted: int | None = None  # speculative decoding: tokens drafted, and of them those that stood
    accepted: int | None = None

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.drafted if self.drafted and self.accepted is not None else None

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.started if self.chunk_times else None

    def output_tokens(self, max_tokens: int | None = None) -> int:
        """Reported usage; else max_tokens when the stream ended on length; else content chunks."""
        if self.tokens is not None:
            return self.tokens
        if max_tokens is not None and self.finish_reason in ("length", "max_tokens"):
            return max_tokens
        return len(self.chunk_times)

    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    def decode_rate(self, max_tokens: int | None = None) -> float | None:
        n = self.output_tokens(max_tokens)
        if len(self.chunk_times) < 2 or n < 2:
            return None
        span = self.chunk_times[-1] - self.chunk_times[0]
        return (n - 1) / span if span > 0 else None


class SseParser:
    """Server-sent events, one line at a time: ``feed`` returns (event name, data) when one ends."""

    def __init__(self) -> None:
        self.event: str | None = None
        self.data: list[str] = []

    def feed(self, line: str) -> tuple[str | None, str] | None:
        line = line.rstrip("\r")
        if line == "":
            if not self.data:
                self.event = None
                return None
            done = (self.event, "\n".join(self.data))
            self.event, self.data = None, []
            return done
        if line.startswith(":"):
            return None  # a comment: keep-alive pings
        if line.startswith("event:"):
            self.event = line[6:].strip()
        elif line.startswith("data:"):
            self.data.append(line[5:].lstrip(" "))
        return None

    def close(self) -> tuple[str | None, str] | None:
        return self.feed("")


def apply_chat_chunk(result: StreamResult, payload: dict[str, Any], now: float) -> None:
    """Fold one Chat Completions stream chunk into the result."""
    if payload.get("error"):
        raise RuntimeError(f"stream error: {payload['error']}")
    for choice in payload.get("choices") or []:
        delta = choice.get("delta") or {}
        # a chat chunk's delta, or a text completion's text
        text = delta.get("content") or delta.get("reasoning_content") or choice.get("text") or ""
        if text or delta.get("tool_calls"):
            result.chunk_times.append(now)
            result.text += text
        if choice.get("finish_reason"):
            result.finish_reason = choice["finish_reason"]
    usage = payload.get("usage")
    if usage:
        result.tokens = usage.get("completion_tokens")
        result.prompt_tokens = usage.get("prompt_tokens")
        result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    apply_speculation(result, payload)


def apply_speculation(result: StreamResult, payload: dict[str, Any]) -> None:
    """What speculative decoding drafted and what of it stood, as lmserve's usage extension
    (``speculation: {drafted_tokens, accepted_tokens}``) or llama-server's ``timings``
    (``draft_n``, ``draft_n_accepted``) report it; absent, the counts stay None."""
    spec = (payload.get("usage") or {}).get("speculation")
    if isinstance(spec, dict):
        result.drafted = spec.get("drafted_tokens", spec.get("drafted"))
        result.accepted = spec.get("accepted_tokens", spec.get("accepted"))
    timings = payload.get("timings")
    if isinstance(timings, dict) and "draft_n" in timings:
        result.drafted, result.accepted = timings["draft_n"], timings.get("draft_n_accepted")


def apply_messages_event(result: StreamResult, event: str | None, payload: dict[str, Any], now: float) -> None:
    """Fold one Anthropic Messages stream event into the result."""
    kind = payload.get("type", event)
    if kind == "error":
        raise RuntimeError(f"stream error: {payload.get('error')}")
    if kind == "message_start":
        usage = (payload.get("message") or {}).get("usage") or {}
        result.cached_tokens = usage.get("cache_read_input_tokens")
        if usage.get("input_tokens") is not None:
            result.prompt_tokens = usage["input_tokens"] + (result.cached_tokens or 0)
    elif kind == "content_block_delta":
        delta = payload.get("delta") or {}
        text = delta.get("text") or delta.get("partial_json") or delta.get("thinking") or ""
        if text:
            result.chunk_times.append(now)
            result.text += delta.get("text") or ""
    elif kind == "message_delta":
        result.finish_reason = (payload.get("delta") or {}).get("stop_reason")
        usage = payload.get("usage") or {}
        if usage.get("output_tokens") is not None:
            result.tokens = usage["output_tokens"]
        if usage.get("cache_read_input_tokens") is not None:
            result.cached_tokens = usage["cache_read_input_tokens"]


async def stream_request(client: Any, base_url: str, path: str, body: dict[str, Any]) -> StreamResult:
    """POST one streaming request and time its chunks (path /v1/chat/completions or /v1/messages)."""
    messages_api = path.endswith("/messages")
    headers = {"x-api-key": "bench", "anthropic-version": "2023-06-01"} if messages_api else {}
    result = StreamResult(started=time.perf_counter())
    parser = SseParser()

    def handle(event: tuple[str | None, str] | None, now: float) -> bool:
        if event is None:
            return False
        name, data = event
        if data.strip() == "[DONE]":
            return True
        payload = json.loads(data)
        if messages_api:
            apply_messages_event(result, name, payload, now)
        else:
            apply_chat_chunk(result, payload, now)
        return False

    async with client.stream("POST", base_url.rstrip("/") + path, json=body, headers=headers) as response:
        if response.status_code != 200:
            detail = (await response.aread()).decode("utf-8", "replace")[:500]
            raise RuntimeError(f"{path} answered {response.status_code}: {detail}")
        done = False
        async for line in response.aiter_lines():
            if handle(parser.feed(line), time.perf_counter()):
                done = True
                break
        if not done:
            handle(parser.close(), time.perf_counter())
    result.ended = time.perf_counter()
    return result


async def run_batch(client: Any, base_url: str, path: str,
                    bodies: Sequence[dict[str, Any]]) -> tuple[list[StreamResult], float]:
    """Start all requests at once; return their results and the batch's wall time."""
    started = time.perf_counter()
    results = await asyncio.gather(*(stream_request(client, base_url, path, b) for b in bodies))
    return list(results), time.perf_counter() - started


async def serves_messages(client: Any, base_url: str, model: str) -> bool:
    body = {"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    response = await client.post(base_url + "/v1/messages", json=body,
                                 headers={"x-api-key": "bench", "anthropic-version": "2023-06-01"})
    return response.status_code == 200


async def served_model(client: Any, base_url: str) -> str:
    response = await client.get(base_url + "/v1/models")
    response.raise_for_status()
    return response.json()["data"][0]["id"]
