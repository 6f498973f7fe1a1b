"""The access log: one line per HTTP request, written when the response has ended.

A streamed answer is logged when its stream ends (finished, cut by the client, or cut at
shutdown), so every line carries the whole story: dialect, path, status, prompt / cached /
completion tokens, time to the first generated token and total time. With ``--log-format json``
the same values are fields of one JSON object (see ``shared.log_format``).

Each response also names the gateway process that served it (``x-lmserve-gateway: host:pid``),
so behind a proxy a client can tell which gateway's log holds its line.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from gateway import metrics
from gateway.dialects import dialect_of_path
from gateway.flags import GATEWAY_HEADER
from gateway.neutral import (
    Event,
    Finish,
    LogprobsDelta,
    Placement,
    ReasoningDelta,
    Started,
    TextDelta,
)

SCOPE_KEY = "lmserve.access"
# the request state's name of the API key the caller held (gateway.edge sets it; "" for none)
KEY_NAME = "api_key_name"
# Probes arrive every few seconds from a proxy or orchestrator; logged only at debug level
# unless they fail, so they do not drown the requests.
PROBE_PATHS = {"/health", "/", "/api/hello"}
# The requests that generate, counted in the metrics (gateway/metrics.py)
GENERATING_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"})
# The status logged for a request whose client went away before its reply ended (nginx's
# "client closed request"); the client never saw a status, whatever the server had begun.
CLIENT_GONE = 499

log = logging.getLogger("lmserve.access")


def gateway_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


@dataclass
class AccessRecord:
    method: str
    path: str
    started: float  # time.perf_counter() when the request arrived
    status: int | None = None
    stream: bool | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    finish: str | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    placement: Placement | None = None  # the worker that took a model request, and why
    accepted: str | None = None  # speculative decoding: "stood/drafted" tokens of the reply
    key: str | None = None  # the API key's name (gateway.api_keys), never the key

    def fields(self, gateway: str, ended: float) -> dict[str, Any]:
        def ms(at: float | None) -> float | None:
            return None if at is None else round((at - self.started) * 1000, 1)

        return {"gateway": gateway, "dialect": dialect_of_path(self.path), "method": self.method,
                "path": self.path, "status": self.status, "stream": self.stream,
                "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                "completion_tokens": self.completion_tokens, "finish": self.finish,
                "ttft_ms": ms(self.first_token_at), "total_ms": ms(ended),
                "worker": self.placement.worker if self.placement else None,
                "route": self.placement.route if self.placement else None, "drafts_stood": self.accepted,
                "key": self.key}


def text_line(fields: dict[str, Any]) -> str:
    def show(value: Any) -> str:
        if value is None:
            return "-"
        if isinstance(value, bool):
            return "yes" if value else "no"
        return str(value)

    keys = ("dialect", "stream", "prompt_tokens", "cached_tokens", "completion_tokens", "finish",
            "ttft_ms", "total_ms", "worker", "route", "key")
    return f"{fields['method']} {fields['path']} {show(fields['status'])} " + " ".join(
        f"{key.removesuffix('_tokens')}={show(fields[key])}" for key in keys)


async def observe(scope: dict[str, Any], stream: bool, events: AsyncIterator[Event]) -> AsyncIterator[Event]:
    """Pass a request's events through unchanged, noting its tokens and first-token time."""
    record: AccessRecord | None = scope.get(SCOPE_KEY)
    if record is not None:
        record.stream = stream
    async with aclosing(events):
        async for event in events:
            if record is not None:
                if isinstance(event, (TextDelta, ReasoningDelta, LogprobsDelta)):
                    now = time.perf_counter()
                    if record.first_token_at is None:
                        record.first_token_at = now
                    elif record.method == "POST":
                        metrics.record_gap(dialect_of_path(record.path) or "-", now - record.last_token_at)
                    record.last_token_at = now
                elif isinstance(event, Started):
                    record.prompt_tokens = event.prompt_tokens
                    record.placement = event.placement
                elif isinstance(event, Finish):
                    record.prompt_tokens = event.usage.prompt_tokens
                    record.cached_tokens = event.usage.cached_tokens
                    record.completion_tokens = event.usage.completion_tokens
                    record.finish = event.reason
                    if event.usage.drafted_tokens:
                        record.accepted = f"{event.usage.accepted_tokens}/{event.usage.drafted_tokens}"
            yield event


class AccessLogMiddleware:
    """Outermost ASGI middleware: times each request, names the gateway, logs the line."""

    def __init__(self, app: Any):
        self.app = app
        self.gateway = gateway_id()
        self.header = (GATEWAY_HEADER.encode(), self.gateway.encode())

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        record = AccessRecord(scope.get("method", ""), scope.get("path", ""), time.perf_counter())
        scope[SCOPE_KEY] = record

        complete = False

        async def send_named(message: dict[str, Any]) -> None:
            nonlocal complete
            if message["type"] == "http.response.start":
                if record.status != CLIENT_GONE:
                    record.status = message["status"]
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                complete = True
            await send(message)

        async def receive_noted() -> dict[str, Any]:
            message = await receive()
            if message["type"] == "http.disconnect" and not complete:
                record.status = CLIENT_GONE  # whatever status was sent, the reply never arrived whole
            return message

        try:
            await self.app(scope, receive_noted, send_named)
        except Exception:
            if record.status is None:
                record.status = 500
            raise
        finally:
            record.key = scope.get("state", {}).get(KEY_NAME) or None
            self._write(record)

    def _write(self, record: AccessRecord) -> None:
        fields = record.fields(self.gateway, time.perf_counter())
        if record.method == "POST" and record.path in GENERATING_PATHS:
            metrics.record_request(fields)
        quiet = record.path in PROBE_PATHS and (record.status or 500) < 400
        log.log(logging.DEBUG if quiet else logging.INFO, text_line(fields), extra={"fields": fields})
