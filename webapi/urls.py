"""SSRF guard for callback and input URLs.

``check_url`` accepts only http(s) URLs without credentials whose host resolves
(``socket.getaddrinfo``, no connection is made) exclusively to public addresses: no
loopback, private, link-local, CGNAT (100.64/10), multicast, reserved, unspecified or
cloud-metadata address, IPv4 or IPv6, including IPv4 embedded in IPv6 (mapped, 6to4,
Teredo, NAT64). It returns the resolved addresses; ``pinned`` turns them into a request
that connects to exactly the checked address (no second DNS lookup, so no DNS
rebinding between the check and the connection) while HTTP ``Host`` and TLS (SNI and
certificate verification) still use the original host name. Callers check and pin again
on every redirect. ``allow_private=True``
(``FACEFLOW_ALLOW_PRIVATE_URLS``) lifts the address check for development and tests,
except for the metadata endpoints, which stay blocked.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import SplitResult, urlsplit

import httpx

from webapi.errors import BlockedUrl

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolver = Callable[..., Sequence[tuple[Any, ...]]]

MAX_URL_LENGTH = 2000
METADATA_ADDRESSES: frozenset[IPAddress] = frozenset(
    {ipaddress.ip_address("169.254.169.254"), ipaddress.ip_address("fd00:ec2::254")}
)
BLOCKED_NETWORKS: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = tuple(
    ipaddress.ip_network(net)
    for net in (
        "0.0.0.0/8",
        "100.64.0.0/10",
        "169.254.0.0/16",
        "224.0.0.0/4",
        "240.0.0.0/4",
        "64:ff9b:1::/48",
        "ff00::/8",
        "fe80::/10",
        "fc00::/7",
    )
)
NAT64 = ipaddress.ip_network("64:ff9b::/96")


def check_url(
    url: str,
    *,
    allow_private: bool = False,
    schemes: Sequence[str] = ("http", "https"),
    resolver: Resolver | None = None,
) -> list[str]:
    """Validate ``url`` and return the addresses its host resolves to (all public unless
    ``allow_private``). Raises ``BlockedUrl`` with the reason otherwise."""
    parts = _split(url, schemes)
    host = parts.hostname or ""
    port = _port(parts)
    literal = _literal(host)
    if literal is not None:
        addresses = [literal]
    else:
        addresses = _resolve(host, port, resolver or socket.getaddrinfo)
    for address in addresses:
        if address in METADATA_ADDRESSES or (not allow_private and not is_public(address)):
            raise BlockedUrl(f"The URL's host resolves to a non-public address ({address}).")
    return list(dict.fromkeys(str(address) for address in addresses))


@dataclass(frozen=True)
class Pinned:
    """An httpx request target pinned to a checked address: send to ``url`` (its host is
    the IP literal) with ``headers`` (``Host``) and ``extensions`` (``sni_hostname``)."""

    url: str
    headers: Mapping[str, str] = field(default_factory=dict)
    extensions: Mapping[str, Any] = field(default_factory=dict)


def pinned(url: str, addresses: Sequence[str]) -> Pinned:
    """``url`` rewritten to connect to ``addresses[0]`` (the first address ``check_url``
    returned; the others are not tried), keeping the original host for HTTP and TLS:
    an explicit ``Host`` header (host[:port], the default port left out, IDNA-encoded)
    and, for https, ``sni_hostname`` so httpcore uses the original name for SNI and for
    certificate hostname verification. For https the request also asks the server to
    close the connection afterwards: httpx pools connections by scheme, IP and port, so
    a kept-alive TLS connection verified for one name could otherwise carry a request
    for another name that resolved to the same IP."""
    if not addresses:
        raise BlockedUrl("The URL's host cannot be resolved.")
    try:
        original = httpx.URL(url)
        target = original.copy_with(host=addresses[0])
    except (httpx.InvalidURL, TypeError, ValueError) as exc:
        raise BlockedUrl("The URL cannot be parsed.") from exc
    headers = {"host": original.netloc.decode("ascii")}
    extensions: dict[str, Any] = {}
    if original.scheme == "https":
        headers["connection"] = "close"
        if _literal(original.host) is None:  # an IP literal is verified as such anyway
            extensions["sni_hostname"] = original.raw_host.decode("ascii")
    return Pinned(url=str(target), headers=headers, extensions=extensions)


def check_and_pin(
    url: str, *, allow_private: bool = False, schemes: Sequence[str] = ("http", "https")
) -> Pinned:
    """``check_url``, then ``pinned`` to what it checked: the target of a request that may
    reach only the addresses the guard allowed. Raises ``BlockedUrl``."""
    return pinned(url, check_url(url, allow_private=allow_private, schemes=schemes))


def is_public(address: IPAddress) -> bool:
    """Whether ``address`` (and any IPv4 address embedded in it) is publicly routable."""
    if address in METADATA_ADDRESSES or not address.is_global or address.is_multicast:
        return False
    if any(
        address in network for network in BLOCKED_NETWORKS if network.version == address.version
    ):
        return False
    embedded = _embedded_ipv4(address)
    return embedded is None or is_public(embedded)


def _embedded_ipv4(address: IPAddress) -> ipaddress.IPv4Address | None:
    if not isinstance(address, ipaddress.IPv6Address):
        return None
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if address.teredo is not None:
        return address.teredo[1]
    if address in NAT64:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


def _split(url: str, schemes: Sequence[str]) -> SplitResult:
    if len(url) > MAX_URL_LENGTH or any(c.isspace() or ord(c) < 32 for c in url):
        raise BlockedUrl("The URL is too long or contains whitespace or control characters.")
    try:
        parts = urlsplit(url)
    except ValueError as exc:
        raise BlockedUrl("The URL cannot be parsed.") from exc
    if parts.scheme.lower() not in schemes:
        raise BlockedUrl(f"The URL scheme must be one of: {', '.join(schemes)}.")
    if parts.username is not None or parts.password is not None or "@" in parts.netloc:
        raise BlockedUrl("The URL must not contain credentials.")
    if not parts.hostname:
        raise BlockedUrl("The URL has no host.")
    return parts


def _port(parts: SplitResult) -> int:
    try:
        port = parts.port
    except ValueError as exc:
        raise BlockedUrl("The URL's port is invalid.") from exc
    if port is None:
        return 443 if parts.scheme.lower() == "https" else 80
    if port == 0:
        raise BlockedUrl("The URL's port is invalid.")
    return port


def _literal(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return None


def _resolve(host: str, port: int, resolver: Resolver) -> list[IPAddress]:
    try:
        infos = resolver(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise BlockedUrl("The URL's host cannot be resolved.") from exc
    addresses: list[IPAddress] = []
    for family, *_rest, sockaddr in infos:
        if family not in (socket.AF_INET, socket.AF_INET6):
            continue
        addresses.append(ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0]))
    if not addresses:
        raise BlockedUrl("The URL's host cannot be resolved.")
    return addresses
