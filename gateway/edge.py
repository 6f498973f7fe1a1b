"""The HTTP edge as one ASGI middleware: Host guard, API key, connection cap, body cap.

Each refusal is answered in the envelope of the dialect the path belongs to.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass, field

from gateway.errors import dialect_for_path, error_response
from gateway.hosts import LOOPBACK_NAMES, canonical_host, host_of, is_loopback
from shared.errors import (
    AuthenticationError,
    BusyError,
    InvalidRequestError,
    LmserveError,
    PayloadTooLargeError,
    PermissionDeniedError,
)

# probes, the playground page and the API's description: no key needed (the page asks for one)
OPEN_PATHS = {"/health", "/", "/api/hello", "/openapi.json", "/docs"}
SINGLE_HEADERS = {"host", "authorization", "x-api-key"}  # a guard reads them; twice is refused
@dataclass
class EdgeSettings:
    bind_host: str = "127.0.0.1"
    api_key: str | None = None
    allow_hosts: list[str] = field(default_factory=list)
    conns: int = 32
    max_body: int = 32 * 1024 * 1024

    def allowed_hosts(self) -> set[str] | None:
        """Host names accepted in the Host header, or None when the guard is off."""
        extra = {canonical_host(h) for h in self.allow_hosts}
        if is_loopback(self.bind_host):
            return LOOPBACK_NAMES | extra
        return extra or None


class EdgeMiddleware:
    def __init__(self, app, settings: EdgeSettings):
        self.app = app
        self.settings = settings
        self.allowed = settings.allowed_hosts()
        self.key = settings.api_key.encode() if settings.api_key else None
        self.active = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers: dict[str, str] = {}
        repeated = set()
        for key, value in scope.get("headers", []):
            name = key.decode("latin-1").lower()
            if name in headers and name in SINGLE_HEADERS:
                repeated.add(name)
            headers[name] = value.decode("latin-1")
        path = scope.get("path", "")
        dialect = dialect_for_path(path, headers)
        try:
            if repeated:  # which one would count? Neither: a guard must not read only the last
                raise InvalidRequestError(f"the request repeats the {', '.join(sorted(repeated))} header; send it once")
            self._check_host(headers)
            if path not in OPEN_PATHS:
                self._check_key(headers)
            length = headers.get("content-length")
            if length and length.isdigit() and int(length) > self.settings.max_body:
                raise PayloadTooLargeError(self._too_large(int(length)))
            if self.active >= self.settings.conns:
                raise BusyError(f"the server is at its connection limit ({self.settings.conns}, --conns); retry shortly")
        except LmserveError as error:
            await error_response(dialect, error)(scope, receive, send)
            return
        self.active += 1
        try:
            await self.app(scope, self._capped(receive), send)
        finally:
            self.active -= 1

    def _too_large(self, size: int) -> str:
        return f"the request body is {size} bytes, over this server's limit of {self.settings.max_body} bytes"

    def _check_host(self, headers: dict[str, str]) -> None:
        if self.allowed is None:
            return
        host = host_of(headers.get("host", ""))
        if host is None or host not in self.allowed:
            raise PermissionDeniedError(
                f"Host header {headers.get('host', '')!r} is not allowed here (DNS-rebinding guard); "
                f"use one of {', '.join(sorted(self.allowed))} or start the server with --allow-host")

    def _check_key(self, headers: dict[str, str]) -> None:
        if self.key is None:
            return
        offered = [headers.get("x-api-key", "")]
        authorization = headers.get("authorization", "")
        if authorization.lower().startswith("bearer "):
            offered.append(authorization[7:].strip())
        offered = [key for key in offered if key]
        if not offered:
            raise AuthenticationError("an API key is required: send 'Authorization: Bearer KEY' or 'x-api-key: KEY'")
        # either header may carry it (SDKs send one, some clients both, one of them a placeholder)
        if not any(hmac.compare_digest(key.encode(), self.key) for key in offered):
            raise AuthenticationError("the API key is not valid")

    def _capped(self, receive):
        received = 0
        limit = self.settings.max_body

        async def wrapped():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise PayloadTooLargeError(
                        f"the request body is over this server's limit of {limit} bytes")
            return message

        return wrapped
