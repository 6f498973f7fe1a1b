"""Host names as the edge and the launcher judge them: loopback or not, a Host header's name.

Kept apart from the edge middleware so that the launcher reads them without loading the web
framework.
"""

from __future__ import annotations

import ipaddress
import re

LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1"}


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


# host [":" port], the host a name, an IPv4 address or a bracketed IPv6 address; nothing else
_HOST_HEADER = re.compile(r"(?:\[(?P<ipv6>[0-9a-f:.]+)\]|(?P<name>[a-z0-9._-]+))(?::[0-9]{1,5})?")


def host_of(header: str) -> str | None:
    """The host of a Host header, lower case, without port or IPv6 brackets (an IPv6 address
    in its short form); None when the header is not one host and an optional port
    (``127.0.0.1:80@evil.com``, ``[localhost]``, ``[::1]evil``)."""
    match = _HOST_HEADER.fullmatch(header.strip().lower())
    if match is None:
        return None
    if match["ipv6"] is None:
        return match["name"]
    try:
        return str(ipaddress.IPv6Address(match["ipv6"]))
    except ValueError:
        return None


def canonical_host(name: str) -> str:
    """An --allow-host value as ``host_of`` reports a Host header: lower case, an IPv6 address
    in its short form, brackets and port dropped."""
    parsed = host_of(name)
    if parsed is not None:
        return parsed
    try:
        return str(ipaddress.ip_address(name.strip().strip("[]")))
    except ValueError:
        return name.strip().lower()
