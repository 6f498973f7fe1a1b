"""The HTTP edge as one ASGI middleware: Host guard, API key, connection cap, body cap.

Each refusal is answered in the envelope of the dialect the path belongs to.
"""

from __future__ import annotations

import hashlib
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
# the request state's flag telling an open path whether its caller holds the API key (or none is set)
KEY_HELD = "api_key_held"
# the request state's name for the caller's tenant: whose cached prefixes its request may reuse
TENANT = "tenant"
SINGLE_HEADERS = {"host", "authorization", "x-api-key"}  # a guard reads them; twice is refused
def tenant_of(key: bytes) -> str:
    """A key's tenant name: a digest, so the key itself travels nowhere."""
    return hashlib.blake2b(key, digest_size=8, person=b"lmserve tenant").hexdigest()


@dataclass
class EdgeSettings:
    bind_host: str = "127.0.0.1"
    api_keys: list[str] = field(default_factory=list)  # none: open to all
    share_cache: bool = False  # every key's requests reuse each other's cached prefixes
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
        self.keys = [key.encode() for key in settings.api_keys]
        # With several keys, each is a tenant: its requests reuse only its own cached prefixes (a
        # namespace the worker keeps apart), so no tenant reads, or times, another's prompts.
        separate = len(self.keys) > 1 and not settings.share_cache
        self.tenants = [tenant_of(key) if separate else "" for key in self.keys]
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
            held = self._held_key(headers)
            if path not in OPEN_PATHS:
                self._check_key(headers, held)
            state = scope.setdefault("state", {})
            state[KEY_HELD] = not self.keys or held is not None  # what an open path tells depends on it
            state[TENANT] = self.tenants[held] if held is not None else ""
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

    @staticmethod
    def _offered(headers: dict[str, str]) -> list[str]:
        offered = [headers.get("x-api-key", "")]
        authorization = headers.get("authorization", "")
        if authorization.lower().startswith("bearer "):
            offered.append(authorization[7:].strip())
        return [key for key in offered if key]

    def _held_key(self, headers: dict[str, str]) -> int | None:
        """Which of the keys the request offers, if any."""
        # either header may carry it (SDKs send one, some clients both, one of them a placeholder)
        offered = [key.encode() for key in self._offered(headers)]
        # every comparison is made, each in constant time: which key matched is not timed either
        hits = [sum(hmac.compare_digest(candidate, key) for candidate in offered) for key in self.keys]
        return next((index for index, hit in enumerate(hits) if hit), None)

    def _check_key(self, headers: dict[str, str], held: int | None) -> None:
        if not self.keys:
            return
        if not self._offered(headers):
            raise AuthenticationError("an API key is required: send 'Authorization: Bearer KEY' or 'x-api-key: KEY'")
        if held is None:
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
