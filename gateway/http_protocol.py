"""uvicorn's HTTP/1.1 protocol (h11) with two rules of the edge it lacks.

- A request's headers must be complete within ``header_timeout`` seconds of the connection
  (or, on a kept-alive connection, of the request's first byte). uvicorn's keep-alive timer
  stops at the first byte, so a client trickling its headers a byte at a time (slowloris)
  would otherwise hold a connection for as long as it likes. Such a connection gets a 408 and
  is closed.
- A request that is not valid HTTP/1.1 (a missing or repeated Host header, a malformed
  request line) is answered in the JSON error envelope every other refusal uses, not in
  plain text. Its path is not known, so the envelope is the OpenAI one.
"""

from __future__ import annotations

import asyncio
import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from gateway.dialects import CHAT
from gateway.errors import error_body
from shared.errors import InvalidRequestError, LmserveError, RequestTimeoutError


def edge_protocol(header_timeout: float) -> type[H11Protocol]:
    """The protocol class for ``uvicorn.Config(http=...)``, with this header timeout."""

    class EdgeProtocol(H11Protocol):
        deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self.start_clock()  # a connection that never sends a byte is cut too

        def start_clock(self) -> None:
            if self.deadline is None:
                self.deadline = self.loop.call_later(header_timeout, self.headers_too_slow)

        def data_received(self, data: bytes) -> None:
            # between requests (not while a body arrives after an early answer): a new request
            # begins, and its clock starts
            if self.conn.their_state is h11.IDLE:
                self.start_clock()
            before = self.cycle
            super().data_received(data)
            if self.cycle is not before:  # a request's headers were read: the clock stops
                self.stop_clock()

        def connection_lost(self, exc: Exception | None) -> None:
            self.stop_clock()
            super().connection_lost(exc)

        def stop_clock(self) -> None:
            if self.deadline is not None:
                self.deadline.cancel()
                self.deadline = None

        def headers_too_slow(self) -> None:
            self.deadline = None
            if not self.transport.is_closing():
                # h11 cannot send a response to a request it has not read: written as bytes
                self.transport.write(_raw_response(408, "Request Timeout", RequestTimeoutError(
                    f"the request's headers did not arrive within {header_timeout:g} s; the connection is closed")))
                self.transport.close()

        def send_400_response(self, msg: str) -> None:
            self.stop_clock()
            if not self.transport.is_closing():
                self.transport.write(_raw_response(400, "Bad Request", InvalidRequestError(
                    "the request is not valid HTTP/1.1 (is its Host header missing or repeated, or its request "
                    "line malformed?)")))
                self.transport.close()

    return EdgeProtocol


def _raw_response(status: int, reason: str, error: LmserveError) -> bytes:
    body = json.dumps(error_body(CHAT, error)).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"connection: close\r\n\r\n")
    return head.encode("ascii") + body
