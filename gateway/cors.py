"""Cross-origin requests from browsers (``--cors-origin``): which origins may call the API, the
answer to their preflights, and the headers their responses carry.

Starlette's CORSMiddleware is not used: it answers a preflight 200 (not 204), answers one from
an origin it refuses with CORS headers and a 400 instead of passing it on, and adds its expose
header to responses for any origin. Here an origin not listed gets no CORS header at all, and
the edge (gateway/edge.py) answers preflights after its Host guard and before the API key: a
browser sends no key with a preflight.
"""

from __future__ import annotations

ALLOW_METHODS = "GET, POST, OPTIONS"
# what the SDKs send, for a preflight that does not list the headers it wants (one that does
# gets them echoed: the OpenAI and Anthropic SDKs add x-stainless-* headers of their own)
ALLOW_HEADERS = ("authorization, x-api-key, content-type, anthropic-version, anthropic-beta, "
                 "anthropic-dangerous-direct-browser-access, openai-organization, openai-project, openai-beta")
# the headers of ours a page's script may read (gateway.app and gateway.access_log name them)
EXPOSE_HEADERS = ("x-lmserve-gateway, x-lmserve-worker, x-lmserve-cartridges, x-lmserve-warning, "
                  "x-lmserve-ignored-fields, retry-after")
MAX_AGE = "600"  # seconds a browser may keep a preflight's answer


class CorsOrigins:
    def __init__(self, origins: list[str]):
        self.any = "*" in origins
        self.origins = {origin.rstrip("/") for origin in origins if origin != "*"}

    def __bool__(self) -> bool:
        return self.any or bool(self.origins)

    def allows(self, origin: str | None) -> bool:
        return bool(origin) and (self.any or origin in self.origins)

    @staticmethod
    def is_preflight(method: str, headers: dict[str, str]) -> bool:
        return method == "OPTIONS" and "origin" in headers and "access-control-request-method" in headers

    @staticmethod
    def preflight_headers(origin: str, headers: dict[str, str]) -> list[tuple[bytes, bytes]]:
        return _encoded({"access-control-allow-origin": origin, "vary": "Origin",
                         "access-control-allow-methods": ALLOW_METHODS,
                         "access-control-allow-headers": headers.get("access-control-request-headers") or ALLOW_HEADERS,
                         "access-control-max-age": MAX_AGE})

    @staticmethod
    def response_headers(origin: str) -> list[tuple[bytes, bytes]]:
        return _encoded({"access-control-allow-origin": origin, "vary": "Origin",
                         "access-control-expose-headers": EXPOSE_HEADERS})


def _encoded(headers: dict[str, str]) -> list[tuple[bytes, bytes]]:
    return [(name.encode("latin-1"), value.encode("latin-1")) for name, value in headers.items()]
