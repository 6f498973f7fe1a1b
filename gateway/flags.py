"""The gateway's command-line flags, apart from the server code: ``lmserve serve`` builds its
children's command lines from these parsers without importing the HTTP stack."""

from __future__ import annotations

import argparse

from shared import log_format
from shared.command_line import CommaList, EnvParser, new_parser
from shared.protocol import DEFAULT_ENDPOINT

# gateway.worker_pool's names, the defaults of gateway.app.GatewaySettings and the worker
# clients, and the names lmserve serve shares with its gateways, kept here so that building a
# command line (and supervising the processes) imports no HTTP stack
ROUTE_POLICIES = ("prefix", "round-robin")
DEFAULT_QUEUE_TOKENS = 1024
MAX_BUFFERED = 4096  # replies a request may hold unread before its slow reader is cut off
PING_INTERVAL = 10.0  # seconds of silence before an SSE keep-alive while a prompt is read
GATEWAY_HEADER = "x-lmserve-gateway"  # on every reply: the gateway (host:pid) that answered
MULTIPROCESS_ENV = "PROMETHEUS_MULTIPROC_DIR"  # where gateways sharing a port pool their metrics


def add_gateway_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="bind address")
    p.add_argument("--port", type=int, default=8080, help="port")
    p.add_argument("--api-key", action=CommaList, default=[], metavar="KEY,…",
                   help="require Authorization: Bearer KEY (or x-api-key: KEY), one of these keys (comma-separated, "
                        "repeatable); with several, each key is a tenant whose cached prompts no other key reuses")
    p.add_argument("--api-keys-file", default=None, metavar="FILE",
                   help="more API keys, one a line: NAME:KEY, or NAME:sha256:HEX (the key's SHA-256, so the file "
                        "holds no secret); blank lines and # comments skipped; read again on SIGHUP. The name "
                        "goes to the access log and the metrics (--api-key's keys are key1, key2, ...)")
    p.add_argument("--cors-origin", action=CommaList, default=[], metavar="ORIGIN,…",
                   help="let browser pages from these origins call the API (comma-separated, repeatable; * for "
                        "any): preflights are answered, and responses carry CORS headers for them only")
    p.add_argument("--strict-fields", action="store_true",
                   help="refuse (400) a request with a field this server does not know, instead of ignoring it "
                        "and naming it in the x-lmserve-ignored-fields header")
    p.add_argument("--share-cache", action="store_true",
                   help="with several --api-key keys: let every key reuse every other's cached prompts (faster "
                        "when the tenants trust each other: a cache hit can tell one what another sent)")
    p.add_argument("--allow-host", action=CommaList, default=[],
                   help="extra Host header values to accept (comma-separated, repeatable); "
                        "arms the Host guard on non-loopback binds")
    p.add_argument("--conns", type=int, default=32, help="max concurrent connections")
    p.add_argument("--max-body", type=int, default=32 * 1024 * 1024, help="max request body in bytes")
    p.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a request's headers may take to arrive once it starts; then 408 and close")
    p.add_argument("--max-buffered", type=int, default=MAX_BUFFERED,
                   help="replies a request may hold unread before its slow reader is cut off")
    p.add_argument("--ping-interval", type=float, default=PING_INTERVAL,
                   help="seconds of silence before an SSE keep-alive while a prompt is read")
    p.add_argument("--no-docs", action="store_true",
                   help="serve neither the OpenAPI document (/openapi.json) nor its page (/docs)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on shutdown, seconds in-flight requests get to finish; a reply still running is then "
                        "cut with an error in its dialect")
    p.add_argument("--max-request-seconds", type=float, default=0.0, metavar="S",
                   help="a reply still running S seconds after its worker accepted it ends as if it had reached "
                        "its max tokens (finish_reason length; x-lmserve-truncated: deadline) (default 0: no limit)")
    p.add_argument("--max-output-tokens", type=int, default=0, metavar="N",
                   help="the most tokens a reply may have: a request's max tokens above N is capped to N, and one "
                        "that names none gets N rather than the rest of the context (default 0: no limit)")
    p.add_argument("--route", choices=ROUTE_POLICIES, default="prefix",
                   help="how a request picks among several workers: prefix (the worker holding the conversation's "
                        "own prefix, unless waiting there costs more than recomputing; new conversations by load) "
                        "or round-robin")
    p.add_argument("--route-queue-tokens", type=int, default=0,
                   help="what waiting for a busy worker's batch place costs, in prompt tokens computed meanwhile: "
                        "a cached prefix must save more to win over a free worker (default 0: measured by the "
                        f"gateway, {DEFAULT_QUEUE_TOKENS} until it has measured)")
    log_format.add_log_format_flag(p)


def build_parser() -> EnvParser:
    p = new_parser("lmserve gateway", "Serve the HTTP APIs; forward requests to a worker.")
    p.add_argument("--worker", default=DEFAULT_ENDPOINT,
                   help="ZeroMQ endpoint(s) of the worker(s), comma-separated (tcp://host:port or ipc://path); "
                        "dns+tcp://NAME:PORT stands for every address NAME resolves to, looked up again every "
                        "few seconds (a Kubernetes headless Service, a scaled compose service)")
    p.add_argument("--wire-key", default=None, metavar="FILE",
                   help="this gateway's CURVE secret key (a .key_secret file from lmserve keys, or the key's Z85 "
                        "text), for workers started with --wire-key; needs --worker-key")
    p.add_argument("--worker-key", default=None, metavar="FILE",
                   help="the workers' CURVE public key (their .key file, or its Z85 text): the wire is encrypted "
                        "and talks only to a worker holding the matching secret key")
    add_gateway_flags(p)
    return p
