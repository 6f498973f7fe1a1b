"""The HTTP edge as one ASGI middleware: Host guard, CORS preflights, API key, connection cap,
body cap.

Each refusal is answered in the envelope of the dialect the path belongs to.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from gateway.access_log import KEY_NAME
from gateway.api_keys import ApiKey, KeyRing
from gateway.cors import CorsOrigins
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
# and what the /docs page loads: Swagger UI's scripts and styles (gateway.app.DOCS_ASSETS)
OPEN_PREFIXES = ("/docs/assets/",)
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
    api_keys: list[str] = field(default_factory=list)  # none (and no keys file): open to all
    api_keys_file: str | None = None  # more keys, named, reread on SIGHUP (gateway.api_keys)
    cors_origins: list[str] = field(default_factory=list)  # origins browsers may call from ("*": any)
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
    def __init__(self, app, settings: EdgeSettings, keys: KeyRing | None = None):
        self.app = app
        self.settings = settings
        self.allowed = settings.allowed_hosts()
        self.keys = keys if keys is not None else KeyRing(settings.api_keys, settings.api_keys_file)
        self.cors = CorsOrigins(settings.cors_origins)
        self.active = 0

    def _tenant(self, key: ApiKey | None) -> str:
        # With several keys, each is a tenant: its requests reuse only its own cached prefixes (a
        # namespace the worker keeps apart), so no tenant reads, or times, another's prompts.
        if key is None or len(self.keys) < 2 or self.settings.share_cache:
            return ""
        return tenant_of(key.digest)

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
        origin = headers.get("origin")
        if self.cors.allows(origin):
            send = self._with_cors(send, origin)
        try:
            if repeated:  # which one would count? Neither: a guard must not read only the last
                raise InvalidRequestError(f"the request repeats the {', '.join(sorted(repeated))} header; send it once")
            self._check_host(headers)
            if self.cors.allows(origin) and self.cors.is_preflight(scope.get("method", ""), headers):
                # a browser asking whether it may: answered before the key, which it never sends here
                await send({"type": "http.response.start", "status": 204,
                            "headers": self.cors.preflight_headers(origin, headers)})
                await send({"type": "http.response.body", "body": b""})
                return
            held = self._held_key(headers)
            if path not in OPEN_PATHS and not path.startswith(OPEN_PREFIXES):
                self._check_key(headers, held)
            state = scope.setdefault("state", {})
            state[KEY_HELD] = not self.keys or held is not None  # what an open path tells depends on it
            state[TENANT] = self._tenant(held)
            state[KEY_NAME] = held.name if held is not None else ""
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

    def _held_key(self, headers: dict[str, str]) -> ApiKey | None:
        """Which of the keys the request offers, if any."""
        # either header may carry it (SDKs send one, some clients both, one of them a placeholder)
        return self.keys.match([key.encode() for key in self._offered(headers)])

    def _with_cors(self, send, origin: str):
        """``send`` adding the CORS headers for an allowed origin to the response."""
        extra = self.cors.response_headers(origin)

        async def wrapped(message):
            if message["type"] == "http.response.start":
                names = {name.lower() for name, _ in message.get("headers", [])}
                if b"access-control-allow-origin" not in names:  # a preflight's answer has its own
                    message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        return wrapped

    def _check_key(self, headers: dict[str, str], held: ApiKey | None) -> None:
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
