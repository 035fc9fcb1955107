"""SSRF guard for callback and input URLs.

``check_url`` accepts only URLs of the allowed schemes and ports, without credentials,
whose host resolves (``socket.getaddrinfo``, no connection is made) exclusively to public
addresses. Every address is normalised first (``embedded_ipv4``): an IPv6 address that
carries an IPv4 address (IPv4-mapped ``::ffff:a.b.c.d``, SIIT ``::ffff:0:a.b.c.d``,
IPv4-compatible ``::a.b.c.d``, NAT64 ``64:ff9b::/96`` and ``64:ff9b:1::/48``, 6to4
``2002::/16``, Teredo ``2001::/32``) is judged by that IPv4 address too, and an IPv4 host
written in decimal, octal or hex (``2130706433``, ``0x7f.1``, ``0177.0.0.1``) is read as
the address it names, then refused for not being dotted decimal. Not public: loopback,
private, link-local, CGNAT, ULA, deprecated site-local ``fec0::/10``, multicast, reserved,
documentation, unspecified and the deprecated IPv4-in-IPv6 forms themselves.

``METADATA_NETWORKS`` (cloud metadata and credential endpoints, all of IPv4 link-local)
stay blocked in every embedded form even when private addresses are allowed.

``UrlPolicy`` is what one deployment allows: production (``from_settings``) is https on
the ports of ``FACEFLOW_URL_PORTS`` to public addresses; ``FACEFLOW_ALLOW_PRIVATE_URLS``
(development and tests only: production refuses it) is ``DEVELOPMENT``: http or https, any
port, private addresses. ``pinned`` turns the checked addresses into a request that
connects to exactly the checked address (no second DNS lookup, so no DNS rebinding
between the check and the connection) while HTTP ``Host`` and TLS (SNI and certificate
verification) still use the original host name. Callers check and pin again on every
redirect.
"""

from __future__ import annotations

import ipaddress
import re
import socket
import unicodedata
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import SplitResult, urlsplit

import httpx

from webapi.errors import BlockedUrl

if TYPE_CHECKING:
    from webapi.config import Settings

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Resolver = Callable[..., Sequence[tuple[Any, ...]]]

MAX_URL_LENGTH = 2000


def _networks(*cidrs: str) -> tuple[Network, ...]:
    return tuple(ipaddress.ip_network(cidr) for cidr in cidrs)


#: Blocked even when private addresses are allowed, in every embedded form.
METADATA_NETWORKS = _networks(
    "169.254.0.0/16",  # link-local: AWS/GCP/Azure/OCI/OpenStack 169.254.169.254, ECS
    # 169.254.170.2, EKS pod identity 169.254.170.23, AWS DNS .253 and NTP .123
    "fd00:ec2::254/128",  # AWS instance metadata over IPv6
    "fd00:ec2::253/128",  # AWS DNS over IPv6
    "fd00:ec2::123/128",  # AWS NTP over IPv6
    "fd00:ec2::23/128",  # EKS pod identity over IPv6
    "fd20:ce::254/128",  # Google Compute Engine metadata over IPv6
    "100.100.100.200/32",  # Alibaba Cloud metadata
    "168.63.129.16/32",  # Azure WireServer (a public-range address)
    "192.0.0.192/32",  # Oracle Cloud legacy metadata
)
#: Never public (on top of what ``ipaddress`` calls non-global, multicast or reserved).
NON_PUBLIC_NETWORKS = _networks(
    "0.0.0.0/8",
    "100.64.0.0/10",  # CGNAT
    "192.88.99.0/24",  # deprecated 6to4 relay anycast
    "224.0.0.0/4",
    "240.0.0.0/4",
    "::/96",  # IPv4-compatible (deprecated), with :: and ::1
    "::ffff:0:0:0/96",  # SIIT IPv4-translated
    "64:ff9b:1::/48",  # NAT64 local-use
    "100::/64",  # discard-only
    "2001::/32",  # Teredo
    "2001:db8::/32",  # documentation
    "3fff::/20",  # documentation
    "5f00::/16",  # SRv6 SIDs
    "fc00::/7",  # unique local
    "fec0::/10",  # site-local (deprecated)
    "fe80::/10",  # link-local
    "ff00::/8",  # multicast
)
MAPPED = ipaddress.ip_network("::ffff:0:0/96")
SIIT = ipaddress.ip_network("::ffff:0:0:0/96")
COMPATIBLE = ipaddress.ip_network("::/96")
NAT64 = ipaddress.ip_network("64:ff9b::/96")
NAT64_LOCAL = ipaddress.ip_network("64:ff9b:1::/48")
#: RFC 6052 prefix lengths a NAT64 local-use prefix may have inside 64:ff9b:1::/48.
NAT64_LOCAL_PREFIXES = (48, 56, 64, 96)

#: An IPv4 host part as ``inet_aton`` and the WHATWG URL parser read it.
_NUMBER = re.compile(r"0[xX][0-9a-fA-F]*|[0-9]+")
_IDNA_DOTS = re.compile("[\u3002\uff0e\uff61]")


@dataclass(frozen=True)
class UrlPolicy:
    """Which URLs the service may reach: ``schemes``, ``ports`` (None: any) and whether
    private addresses are allowed (metadata endpoints never are)."""

    schemes: tuple[str, ...] = ("https",)
    ports: frozenset[int] | None = frozenset({443, 8443})
    allow_private: bool = False

    @classmethod
    def from_settings(cls, settings: Settings) -> UrlPolicy:
        """Production: https on ``settings.url_ports``; ``DEVELOPMENT`` when
        ``settings.allow_private_urls`` (which production refuses)."""
        if settings.allow_private_urls:
            return DEVELOPMENT
        return cls(schemes=("https",), ports=frozenset(settings.url_ports))

    def check(self, url: str, *, resolver: Resolver | None = None) -> list[str]:
        """``check_url`` under this policy."""
        return check_url(
            url,
            allow_private=self.allow_private,
            schemes=self.schemes,
            ports=self.ports,
            resolver=resolver,
        )

    def check_and_pin(self, url: str) -> Pinned:
        """``check_and_pin`` under this policy: a target pinned to the checked address."""
        return pinned(url, self.check(url))


#: ``FACEFLOW_ALLOW_PRIVATE_URLS``: development and tests (servers on loopback ports).
DEVELOPMENT = UrlPolicy(schemes=("http", "https"), ports=None, allow_private=True)


def check_url(
    url: str,
    *,
    allow_private: bool = False,
    schemes: Sequence[str] = ("http", "https"),
    ports: Collection[int] | None = None,
    resolver: Resolver | None = None,
) -> list[str]:
    """Validate ``url`` and return the addresses its host resolves to (all public unless
    ``allow_private``; IPv4-mapped IPv6 given as IPv4). ``ports``: the ports allowed
    (None: any). Raises ``BlockedUrl`` with the reason otherwise."""
    parts = _split(url, schemes)
    host = parts.hostname or ""
    port = _port(parts)
    if ports is not None and port not in ports:
        allowed = ", ".join(str(p) for p in sorted(ports))
        raise BlockedUrl(f"The URL's port must be one of: {allowed}.")
    literal = _literal(host)
    numeric = None if literal is not None else _numeric_ipv4(host)
    literal = literal or numeric
    if literal is not None:
        addresses = [literal]
    else:
        addresses = _resolve(host, port, resolver or socket.getaddrinfo)
    for address in addresses:
        reason = blocked_reason(address, allow_private=allow_private)
        if reason is not None:
            raise BlockedUrl(f"The URL's host resolves to {reason}.")
    if numeric is not None and str(numeric) != host:
        raise BlockedUrl(f"Write the URL's IPv4 host as dotted decimal ({numeric}).")
    return list(dict.fromkeys(str(normalised(address)) for address in addresses))


def blocked_reason(address: IPAddress, *, allow_private: bool = False) -> str | None:
    """Why ``address`` may not be reached (None: it may): a metadata endpoint in any
    form, or (unless ``allow_private``) any non-public address."""
    shown = _shown(address)
    if is_metadata(address):
        return f"a cloud metadata address ({shown})"
    if not allow_private and not is_public(address):
        return f"a non-public address ({shown})"
    return None


def is_metadata(address: IPAddress) -> bool:
    """Whether ``address``, or an IPv4 address embedded in it, is a metadata endpoint."""
    return any(
        candidate in network
        for candidate in (address, *embedded_ipv4(address))
        for network in METADATA_NETWORKS
        if network.version == candidate.version
    )


def is_public(address: IPAddress) -> bool:
    """Whether ``address`` (and every IPv4 address embedded in it) is publicly routable."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return is_public(address.ipv4_mapped)
    if is_metadata(address) or any(
        address in network for network in NON_PUBLIC_NETWORKS if network.version == address.version
    ):
        return False
    embedded = embedded_ipv4(address)
    if embedded:  # NAT64 (64:ff9b::/96) and 6to4 reach the IPv4 address they carry
        return all(is_public(candidate) for candidate in embedded)
    return address.is_global and not address.is_multicast and not address.is_reserved


def embedded_ipv4(address: IPAddress) -> tuple[ipaddress.IPv4Address, ...]:
    """The IPv4 addresses an IPv6 address carries (mapped, SIIT, compatible, NAT64, 6to4,
    Teredo server and client); for the NAT64 local-use /48, one per RFC 6052 layout."""
    if not isinstance(address, ipaddress.IPv6Address):
        return ()
    value = int(address)
    if any(address in network for network in (MAPPED, SIIT, COMPATIBLE, NAT64)):
        return (ipaddress.IPv4Address(value & 0xFFFFFFFF),)
    if address in NAT64_LOCAL:
        return tuple(_rfc6052(value, length) for length in NAT64_LOCAL_PREFIXES)
    if address.sixtofour is not None:
        return (address.sixtofour,)
    if address.teredo is not None:
        return address.teredo
    return ()


def normalised(address: IPAddress) -> IPAddress:
    """``address`` as a connection reaches it: an IPv4-mapped IPv6 address as IPv4."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _rfc6052(value: int, prefix_length: int) -> ipaddress.IPv4Address:
    """The IPv4 address in an IPv4-embedded IPv6 address (RFC 6052 §2.2): 32 bits after
    the prefix, skipping bits 64-71 (the "u" octet)."""
    if prefix_length == 96:
        return ipaddress.IPv4Address(value & 0xFFFFFFFF)
    bits = f"{value:0128b}"
    without_u = bits[:64] + bits[72:]
    return ipaddress.IPv4Address(int(without_u[prefix_length : prefix_length + 32], 2))


def _shown(address: IPAddress) -> str:
    embedded = embedded_ipv4(address)
    return f"{address} = {', '.join(map(str, embedded))}" if embedded else str(address)


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


def _numeric_ipv4(host: str) -> ipaddress.IPv4Address | None:
    """The IPv4 address of a host whose last label is a number (WHATWG URL "ends in a
    number"): one to four parts, each decimal, ``0x`` hex or ``0``-led octal, the last
    filling the remaining bytes (``inet_aton``). None for a host name; ``BlockedUrl`` for
    a number that is no IPv4 address. Unicode digits and dots count as what IDNA makes
    of them (fullwidth digits, ideographic full stops)."""
    labels = _IDNA_DOTS.sub(".", unicodedata.normalize("NFKC", host)).split(".")
    if len(labels) > 1 and labels[-1] == "":
        labels.pop()
    if not _NUMBER.fullmatch(labels[-1]):
        return None
    if len(labels) > 4 or not all(_NUMBER.fullmatch(label) for label in labels):
        raise BlockedUrl("The URL's host is not a valid IPv4 address.")
    numbers = [_number(label) for label in labels]
    *head, last = numbers
    if any(n > 255 for n in head) or last >= 256 ** (5 - len(numbers)):
        raise BlockedUrl("The URL's host is not a valid IPv4 address.")
    value = last
    for index, number in enumerate(head):
        value += number << (8 * (3 - index))
    return ipaddress.IPv4Address(value)


def _number(label: str) -> int:
    if label[:2].lower() == "0x":
        return int(label[2:] or "0", 16)
    if len(label) > 1 and label.startswith("0"):
        if not set(label) <= set("01234567"):
            raise BlockedUrl("The URL's host is not a valid IPv4 address.")
        return int(label, 8)
    return int(label)


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
