"""ZeroMQ CURVE on the wire between gateways and workers: encrypted, and answered only for the
gateways a worker allows.

A worker's ROUTER is a CURVE server holding the worker's secret key; every connection is checked
by a ZAP handler (pyzmq's authenticator, one thread per process) against the worker's allowed
gateway public keys, and a peer that is not allowed never completes its handshake: it gets no
card and no tokens. A gateway's DEALER is a CURVE client that knows the worker's public key, so
it talks to no impostor either.
"""

from __future__ import annotations

import ipaddress
import itertools
import logging
import threading
from dataclasses import dataclass

import zmq

log = logging.getLogger("lmserve.wire")


@dataclass(frozen=True)
class ServerKeys:
    """A worker's key pair and the gateways it answers."""

    public: bytes
    secret: bytes
    allowed: frozenset[bytes]


@dataclass(frozen=True)
class ClientKeys:
    """A gateway's key pair and the workers' public key."""

    public: bytes
    secret: bytes
    server: bytes


class _Allowed:
    """The credentials provider of one worker socket's ZAP domain."""

    def __init__(self, keys: frozenset[bytes]):
        self.keys = keys
        self.refused = 0

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.keys:
            return True
        self.refused += 1
        if self.refused == 1 or self.refused % 1000 == 0:
            log.warning("refused a wire peer whose key %s is not allowed (%d refused so far)",
                        key.decode(errors="replace"), self.refused)
        return False


_authenticators: dict[int, object] = {}
_domains = itertools.count()
_lock = threading.Lock()


def _authenticator(context: zmq.Context):
    """This context's ZAP handler, started on first use and shared by its sockets."""
    from zmq.auth.thread import ThreadAuthenticator

    with _lock:
        auth = _authenticators.get(id(context))
        if auth is None:
            auth = ThreadAuthenticator(context, log=logging.getLogger("lmserve.wire.zap"))
            auth.start()
            _authenticators[id(context)] = auth
        return auth


def secure_server(socket: zmq.Socket, keys: ServerKeys) -> _Allowed:
    """Make ``socket`` (before it binds) a CURVE server answering only ``keys.allowed``."""
    domain = f"lmserve-worker-{next(_domains)}"
    allowed = _Allowed(keys.allowed)
    _authenticator(socket.context).configure_curve_callback(domain=domain, credentials_provider=allowed)
    socket.zap_domain = domain.encode()
    socket.curve_secretkey = keys.secret
    socket.curve_publickey = keys.public
    socket.curve_server = True
    return allowed


def secure_client(socket: zmq.Socket, keys: ClientKeys) -> None:
    """Make ``socket`` (before it connects) a CURVE client of the workers' key."""
    socket.curve_secretkey = keys.secret
    socket.curve_publickey = keys.public
    socket.curve_serverkey = keys.server


def is_loopback_endpoint(endpoints: str) -> bool:
    """Whether every endpoint of a comma-separated list stays on this machine (ipc, inproc, or
    tcp on a loopback address)."""
    for endpoint in endpoints.split(","):
        endpoint = endpoint.strip()
        if endpoint.startswith(("ipc://", "inproc://")):
            continue
        if not endpoint.startswith("tcp://"):
            return False
        host = endpoint.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
        try:
            if not (host == "localhost" or ipaddress.ip_address(host).is_loopback):
                return False
        except ValueError:  # a name (other than localhost) or a wildcard: reachable for all we know
            return False
    return True


def ephemeral_pair() -> tuple[bytes, bytes]:
    """(public, secret): a key pair that lives as long as the processes given it."""
    return zmq.curve_keypair()
