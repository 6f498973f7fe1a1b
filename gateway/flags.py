"""The gateway's command-line flags, apart from the server code: ``lmserve serve`` builds its
children's command lines from these parsers without importing the HTTP stack."""

from __future__ import annotations

from shared import settings as flags

DEFAULT_WORKER = "tcp://127.0.0.1:5557"


def add_gateway_flags(p) -> None:
    p.add_argument("--host", default="127.0.0.1", help="bind address")
    p.add_argument("--port", type=int, default=8080, help="port")
    p.add_argument("--api-key", default=None, help="require Authorization: Bearer K (or x-api-key: K)")
    p.add_argument("--allow-host", action=flags.CommaList, default=[],
                   help="extra Host header values to accept (comma-separated, repeatable); "
                        "arms the Host guard on non-loopback binds")
    p.add_argument("--conns", type=int, default=32, help="max concurrent connections")
    p.add_argument("--max-body", type=int, default=32 * 1024 * 1024, help="max request body in bytes")
    p.add_argument("--max-buffered", type=int, default=4096,
                   help="replies a request may hold unread before its slow reader is cut off")
    p.add_argument("--ping-interval", type=float, default=10.0,
                   help="seconds of silence before an SSE keep-alive while a prompt is read")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on shutdown, seconds in-flight requests get to finish; a reply still running is then "
                        "cut with an error in its dialect")
    flags.add_log_flags(p)


def build_parser():
    p = flags.new_parser("lmserve gateway", "Serve the HTTP APIs; forward requests to a worker.")
    flags.add_worker_endpoint_flag(p, DEFAULT_WORKER)
    add_gateway_flags(p)
    return p
