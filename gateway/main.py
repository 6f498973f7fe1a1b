"""``lmserve gateway``: the HTTP edge alone, connected to a worker over ZeroMQ."""

from __future__ import annotations

import logging
import signal
import socket
import sys
from typing import Any

import uvicorn

from gateway.app import Gateway, GatewaySettings, create_app
from gateway.edge import EdgeSettings
from gateway.flags import build_parser
from gateway.generation import ReplyLimits
from gateway.http_protocol import edge_protocol
from shared import log_format
from shared.errors import LmserveError
from shared.keys import public_keys, secret_key
from shared.memory import fix_mmap_threshold
from shared.wire_security import ClientKeys, is_loopback_endpoint


def wire_keys(args) -> ClientKeys | None:
    """The CURVE keys --wire-key and --worker-key name (both or neither)."""
    if not args.wire_key and not args.worker_key:
        return None
    if not (args.wire_key and args.worker_key):
        raise LmserveError("--wire-key and --worker-key go together: the gateway's own secret key, and the "
                           "workers' public key")
    public, secret = secret_key(args.wire_key, "--wire-key")
    servers = public_keys([args.worker_key], "--worker-key")
    if len(servers) != 1:
        raise LmserveError(f"--worker-key {args.worker_key} holds {len(servers)} public keys; give the one key "
                           "all the workers share")
    return ClientKeys(public, secret, servers.pop())


def settings_from(args) -> GatewaySettings:
    allow = args.allow_host
    return GatewaySettings(
        worker=args.worker, route=args.route, route_queue_tokens=args.route_queue_tokens,
        ping_interval=args.ping_interval, max_buffered=args.max_buffered,
        limits=ReplyLimits(args.max_request_seconds, args.max_output_tokens),
        drain_timeout=args.drain_timeout, docs=not args.no_docs, wire=wire_keys(args),
        strict_fields=args.strict_fields,
        edge=EdgeSettings(bind_host=args.host, api_keys=list(args.api_key), share_cache=args.share_cache,
                          api_keys_file=args.api_keys_file, cors_origins=list(args.cors_origin),
                          allow_hosts=list(allow),
                          conns=args.conns, max_body=args.max_body))


class DrainingServer(uvicorn.Server):
    """uvicorn's server, telling the gateway when shutdown begins so that replies still running
    near the end of --drain-timeout are ended in their dialect instead of dropped."""

    def __init__(self, config: uvicorn.Config, gateway: Gateway):
        super().__init__(config)
        self.gateway = gateway

    def handle_exit(self, sig: int, frame: Any) -> None:
        if not self.should_exit:
            self.gateway.begin_drain()
        super().handle_exit(sig, frame)


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening socket several gateway processes can share (SO_REUSEPORT)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if hasattr(socket, "SO_REUSEPORT"):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.conns < 1 or args.max_body < 1 or args.header_timeout <= 0:
        parser.error("--conns, --max-body and --header-timeout must be positive")
    if args.max_request_seconds < 0 or args.max_output_tokens < 0:
        parser.error("--max-request-seconds and --max-output-tokens must be 0 (no limit) or more")
    log_format.configure(args.log_format)
    fix_mmap_threshold()
    try:
        settings = settings_from(args)
        app = create_app(settings)  # reads --api-keys-file: a bad line stops the start here
    except LmserveError as exc:
        print(f"lmserve gateway: {exc.message}", file=sys.stderr)
        return 2
    if settings.wire is None and not is_loopback_endpoint(args.worker):
        logging.getLogger("lmserve.gateway").warning(
            "the wire to %s is in the clear (no --wire-key/--worker-key): anyone on that network reads it",
            args.worker)
    # SIGHUP reads --api-keys-file again (uvicorn handles only SIGINT and SIGTERM)
    signal.signal(signal.SIGHUP, lambda signum, frame: app.state.api_keys.reload())
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as exc:
        print(f"lmserve gateway: cannot listen on {args.host}:{args.port}: {exc.strerror}", file=sys.stderr)
        return 2
    # log_config=None: uvicorn's own records go through our handler (and --log-format) too
    config = uvicorn.Config(app, log_level="warning", log_config=None, timeout_keep_alive=30, lifespan="on",
                            timeout_graceful_shutdown=args.drain_timeout, http=edge_protocol(args.header_timeout))
    server = DrainingServer(config, app.state.gateway)
    logging.getLogger("lmserve.gateway").info("gateway on http://%s:%d (worker %s)", args.host, args.port, args.worker)
    server.run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())
