"""SSRF guard: blocked URLs are refused after resolution, and no connection is ever made."""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterator
from typing import Any

import pytest

from webapi.config import Settings
from webapi.errors import BlockedUrl
from webapi.urls import (
    DEVELOPMENT,
    Pinned,
    UrlPolicy,
    check_url,
    embedded_ipv4,
    is_public,
    pinned,
)


@pytest.fixture(autouse=True)
def no_connections(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    """Fail the test if anything tries to open a connection."""
    attempts: list[Any] = []

    def refuse(*args: Any, **kwargs: Any) -> None:
        attempts.append(args)
        raise AssertionError(f"a connection was attempted: {args!r}")

    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    yield attempts
    assert attempts == []


def fake_dns(mapping: dict[str, list[str]]) -> Any:
    """A getaddrinfo stand-in answering from ``mapping``."""

    def resolve(host: str, port: int, *args: Any, **kwargs: Any) -> list[tuple[Any, ...]]:
        if host not in mapping:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        out = []
        for address in mapping[host]:
            family = socket.AF_INET6 if ":" in address else socket.AF_INET
            sockaddr = (address, port, 0, 0) if family == socket.AF_INET6 else (address, port)
            out.append((family, socket.SOCK_STREAM, 6, "", sockaddr))
        return out

    return resolve


# Not public: refused unless private addresses are allowed. Every IPv6 form that carries
# an IPv4 address is judged by that address too; IPv4 hosts in decimal, octal or hex are
# read as the address they name (as getaddrinfo and browsers would).
NON_PUBLIC = [
    # IPv4
    "127.0.0.1",
    "127.1.2.3",
    "10.0.0.1",
    "172.16.5.4",
    "192.168.1.1",
    "100.64.0.1",  # CGNAT
    "0.0.0.0",
    "0.1.2.3",
    "224.0.0.1",
    "239.255.255.250",
    "240.0.0.1",
    "255.255.255.255",
    "192.0.2.1",  # documentation
    "198.18.0.1",  # benchmarking
    "192.88.99.1",  # 6to4 relay anycast (deprecated)
    # IPv6
    "[::1]",
    "[::]",
    "[fe80::1]",
    "[fe80::1%25eth0]",
    "[fc00::5]",
    "[fd12:3456:789a::1]",
    "[ff02::1]",
    "[ff0e::1]",
    "[fec0::1]",  # site-local (deprecated)
    "[feff::1]",
    "[2001:db8::1]",
    "[3fff::1]",
    "[100::1]",
    "[5f00::1]",
    # IPv4-mapped
    "[::ffff:127.0.0.1]",
    "[::ffff:7f00:1]",
    "[::FFFF:10.0.0.1]",
    "[0:0:0:0:0:ffff:192.168.0.1]",
    "[::ffff:100.64.0.1]",
    # SIIT IPv4-translated: never public, whatever it carries
    "[::ffff:0:127.0.0.1]",
    "[::ffff:0:7f00:1]",
    "[::ffff:0:8.8.8.8]",
    # IPv4-compatible (deprecated): never public
    "[::127.0.0.1]",
    "[::7f00:1]",
    "[::10.0.0.1]",
    "[::8.8.8.8]",
    # NAT64 well-known prefix, judged by the IPv4 address it carries
    "[64:ff9b::127.0.0.1]",
    "[64:ff9b::7f00:1]",
    "[64:ff9b::a00:1]",
    "[64:ff9b::192.168.1.1]",
    # NAT64 local-use: never public
    "[64:ff9b:1::7f00:1]",
    "[64:ff9b:1:ab::8.8.8.8]",
    # 6to4
    "[2002:7f00:1::1]",
    "[2002:a00:1::]",
    "[2002:c0a8:101::1]",
    # Teredo: never public
    "[2001:0:4136:e378:8000:63bf:3fff:fdd2]",
    "[2001:0:7f00:1::1]",
    # numeric IPv4 hosts
    "2130706433",  # 127.0.0.1 as one integer
    "0x7f000001",
    "0x7f.1",
    "0X7F.0.0.1",
    "0177.0.0.1",
    "0177.1",
    "017700000001",
    "127.1",
    "127.0.1",
    "127.0.0.1.",
    "10.0x1",
    "3232235777",  # 192.168.1.1
    "\uff11\uff12\uff17.\uff10.\uff10.\uff11",  # fullwidth digits: IDNA reads 127.0.0.1
    "127\u30020\u30020\u30021",  # ideographic full stops
]


@pytest.mark.parametrize("host", NON_PUBLIC)
def test_non_public_addresses_are_blocked_in_every_form(host: str) -> None:
    for url in (f"http://{host}/hook", f"https://{host}:8443/hook"):
        with pytest.raises(BlockedUrl, match="non-public"):
            check_url(url)


#: 169.254.169.254 carried in IPv6, in every form.
METADATA_IN_IPV6 = [
    "::ffff:169.254.169.254",
    "::ffff:a9fe:a9fe",
    "0:0:0:0:0:ffff:a9fe:a9fe",
    "::ffff:0:169.254.169.254",
    "::ffff:0:a9fe:a9fe",
    "::169.254.169.254",
    "::a9fe:a9fe",
    "64:ff9b::169.254.169.254",
    "64:ff9b::a9fe:a9fe",
    "64:ff9b:1::a9fe:a9fe",  # local-use prefix, /96 layout
    "64:ff9b:1:0:a9:fea9:fe00:0",  # /64 layout (RFC 6052: bits 64-71 skipped)
    "64:ff9b:1:a9:fe:a9fe::",  # /56 layout
    "64:ff9b:1:a9fe:a9:fe00::",  # /48 layout
    "2002:a9fe:a9fe::1",  # 6to4
    "2001:0:a9fe:a9fe::1",  # Teredo server
    "2001:0:4136:e378:8000:63bf:5601:5601",  # Teredo client (bits inverted)
]

# Cloud metadata endpoints: refused even with private addresses allowed, in every form.
METADATA = [
    "169.254.169.254",
    "169.254.170.2",  # ECS task credentials
    "169.254.170.23",  # EKS pod identity
    "169.254.169.253",  # AWS DNS
    "169.254.0.1",
    "[fd00:ec2::254]",
    "[fd00:ec2::23]",
    "[fd20:ce::254]",  # GCE over IPv6
    "100.100.100.200",  # Alibaba
    "168.63.129.16",  # Azure WireServer: a public-range address
    "192.0.0.192",  # Oracle (legacy)
    *(f"[{address}]" for address in METADATA_IN_IPV6),
    "[::ffff:100.100.100.200]",
    "[64:ff9b::a83f:8110]",  # NAT64 of 168.63.129.16
    # numeric IPv4 hosts
    "2852039166",
    "0xa9fea9fe",
    "0xa9.0xfe.0xa9.0xfe",
    "0251.0376.0251.0376",
    "169.254.43518",
    "169.16689662",
    "0251.0xfe.43518",
]


@pytest.mark.parametrize("host", METADATA)
@pytest.mark.parametrize("allow_private", [False, True])
def test_metadata_endpoints_are_blocked_in_every_form_even_when_private_is_allowed(
    host: str, allow_private: bool
) -> None:
    for url in (f"http://{host}/latest/meta-data/", f"https://{host}/computeMetadata/v1/"):
        with pytest.raises(BlockedUrl, match="metadata"):
            check_url(url, allow_private=allow_private)


@pytest.mark.parametrize(
    ("host", "address"),
    [
        ("93.184.216.34", "93.184.216.34"),
        ("8.8.8.8", "8.8.8.8"),
        ("[2606:2800:220:1::1]", "2606:2800:220:1::1"),
        ("[::ffff:93.184.216.34]", "93.184.216.34"),  # pinned to what a connection reaches
        ("[::ffff:5db8:d822]", "93.184.216.34"),
        ("[64:ff9b::5db8:d822]", "64:ff9b::5db8:d822"),  # DNS64 answers for IPv4-only names
        ("[2002:5db8:d822::1]", "2002:5db8:d822::1"),
    ],
)
def test_public_addresses_pass_in_their_embedded_forms(host: str, address: str) -> None:
    assert check_url(f"https://{host}/x") == [address]
    assert UrlPolicy().check(f"https://{host}:8443/x") == [address]


@pytest.mark.parametrize(
    "host",
    ["1572395042", "0x5db8d822", "0x5d.0xb8.0xd8.0x22", "93.184.55330", "93.184.216.34."],
)
def test_a_public_ipv4_host_must_be_dotted_decimal(host: str) -> None:
    with pytest.raises(BlockedUrl, match=r"dotted decimal \(93\.184\.216\.34\)"):
        check_url(f"https://{host}/x")


@pytest.mark.parametrize(
    "host", ["256.1.1.1", "1.2.3.4.5", "08.1.1.1", "1.2.3.0x100", "4294967296", "example.123"]
)
def test_numbers_that_are_no_ipv4_address_are_refused(host: str) -> None:
    with pytest.raises(BlockedUrl, match="not a valid IPv4"):
        check_url(f"https://{host}/x")


def test_embedded_ipv4_reads_every_layout() -> None:
    metadata = ipaddress.ip_address("169.254.169.254")
    for text in METADATA_IN_IPV6:
        assert metadata in embedded_ipv4(ipaddress.ip_address(text)), text
    assert embedded_ipv4(ipaddress.ip_address("2606:2800:220:1::1")) == ()
    assert embedded_ipv4(ipaddress.ip_address("8.8.8.8")) == ()


@pytest.mark.parametrize(
    ("host", "addresses"),
    [
        ("evil.example", ["127.0.0.1"]),
        ("rebind.example", ["93.184.216.34", "10.1.2.3"]),  # one bad address is enough
        ("six.example", ["2606:2800:220:1::1", "::1"]),
        ("mapped.example", ["::ffff:10.0.0.1"]),
        ("compat.example", ["::127.0.0.1"]),
        ("nat64.example", ["64:ff9b::7f00:1"]),
        ("meta.example", ["169.254.169.254"]),
        ("meta6.example", ["::ffff:169.254.169.254"]),
    ],
)
def test_hostnames_resolving_to_private_addresses_are_blocked(
    monkeypatch: pytest.MonkeyPatch, host: str, addresses: list[str]
) -> None:
    monkeypatch.setattr(socket, "getaddrinfo", fake_dns({host: addresses}))
    with pytest.raises(BlockedUrl, match=r"non-public|metadata"):
        check_url(f"https://{host}/x")


def test_hostnames_resolving_to_metadata_are_blocked_even_when_private_is_allowed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(
        socket,
        "getaddrinfo",
        fake_dns({"meta.example": ["::ffff:169.254.169.254"], "local.example": ["127.0.0.1"]}),
    )
    with pytest.raises(BlockedUrl, match=r"metadata address \(::ffff:a9fe:a9fe = 169.254"):
        check_url("http://meta.example/", allow_private=True)
    assert check_url("http://local.example:8000/", allow_private=True) == ["127.0.0.1"]


def test_public_hosts_return_their_addresses_for_pinning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        socket,
        "getaddrinfo",
        fake_dns({"hooks.example": ["93.184.216.34", "2606:2800:220:1::1", "93.184.216.34"]}),
    )
    assert check_url("https://hooks.example:8443/a?b=c") == ["93.184.216.34", "2606:2800:220:1::1"]
    assert check_url("http://93.184.216.34/x") == ["93.184.216.34"]


@pytest.mark.parametrize(
    "url",
    [
        "ftp://93.184.216.34/x",
        "file:///etc/passwd",
        "gopher://93.184.216.34/",
        "https://user:pw@93.184.216.34/x",
        "https://user@93.184.216.34/x",
        "https:///nohost",
        "https://93.184.216.34:99999/x",
        "https://93.184.216.34/a b",
        "https://93.184.216.34/\n",
        "https://" + "a" * 3000 + ".example/",
    ],
)
def test_malformed_or_credentialed_urls_are_blocked(url: str) -> None:
    with pytest.raises(BlockedUrl):
        check_url(url)


def test_unresolvable_host_is_blocked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(socket, "getaddrinfo", fake_dns({}))
    with pytest.raises(BlockedUrl, match="resolved"):
        check_url("https://nowhere.example/")


def test_allow_private_lifts_the_address_check_but_not_metadata() -> None:
    assert check_url("http://127.0.0.1:8000/hook", allow_private=True) == ["127.0.0.1"]
    assert check_url("http://[::1]/hook", allow_private=True) == ["::1"]
    assert check_url("http://[::ffff:10.0.0.1]/hook", allow_private=True) == ["10.0.0.1"]
    for url in ("http://169.254.169.254/latest", "http://[fd00:ec2::254]/"):
        with pytest.raises(BlockedUrl):
            check_url(url, allow_private=True)
    with pytest.raises(BlockedUrl):
        check_url("https://user:pw@127.0.0.1/", allow_private=True)


def test_https_only_schemes() -> None:
    with pytest.raises(BlockedUrl, match="scheme"):
        check_url("http://93.184.216.34/", schemes=("https",))


def test_is_public_examples() -> None:
    assert is_public(ipaddress.ip_address("8.8.8.8"))
    assert is_public(ipaddress.ip_address("2001:4860:4860::8888"))
    assert not is_public(ipaddress.ip_address("100.127.255.255"))
    assert not is_public(ipaddress.ip_address("::ffff:192.168.0.1"))
    assert not is_public(ipaddress.ip_address("168.63.129.16"))  # metadata, public range


# --------------------------------------------------------------------------- policy


def test_production_policy_is_https_on_the_allowed_ports(monkeypatch: pytest.MonkeyPatch) -> None:
    looked_up: list[str] = []

    def resolve(host: str, *args: Any, **kwargs: Any) -> Any:
        looked_up.append(host)
        return fake_dns({"hooks.example": ["93.184.216.34"]})(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    policy = UrlPolicy.from_settings(
        Settings.model_validate(
            {"environment": "production", "api_key_pepper": "p3pper", "run_signing_key": "k3y"}
        )
    )
    assert policy == UrlPolicy(schemes=("https",), ports=frozenset({443, 8443}))
    for url in (
        "https://hooks.example/h",
        "https://hooks.example:443/h",
        "https://hooks.example:8443/h",
    ):
        assert policy.check(url) == ["93.184.216.34"]
    for port in (22, 25, 80, 2375, 4200, 5432, 6379, 8080, 9200, 11211):
        with pytest.raises(BlockedUrl, match="port must be one of: 443, 8443"):
            policy.check(f"https://hooks.example:{port}/h")
    for url in ("http://hooks.example/h", "http://hooks.example:443/h"):
        with pytest.raises(BlockedUrl, match="scheme must be one of: https"):
            policy.check(url)
    assert looked_up == ["hooks.example"] * 3  # a refused port or scheme resolves nothing


def test_the_ports_come_from_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FACEFLOW_URL_PORTS", "443, 9443")
    policy = UrlPolicy.from_settings(Settings())
    assert policy.ports == frozenset({443, 9443})
    assert policy.check("https://93.184.216.34:9443/") == ["93.184.216.34"]
    with pytest.raises(BlockedUrl, match="port"):
        policy.check("https://93.184.216.34:8443/")
    monkeypatch.setenv("FACEFLOW_URL_PORTS", "[443]")
    assert Settings().url_ports == [443]
    for bad in ("0", "65536", "", "https"):
        monkeypatch.setenv("FACEFLOW_URL_PORTS", bad)
        with pytest.raises(ValueError):
            Settings()


def test_the_development_allowance_is_explicit() -> None:
    """FACEFLOW_ALLOW_PRIVATE_URLS (refused in production): http or https, any port,
    private addresses; still never a metadata endpoint."""
    policy = UrlPolicy.from_settings(Settings.model_validate({"allow_private_urls": True}))
    assert policy is DEVELOPMENT
    assert policy.check("http://127.0.0.1:6379/x") == ["127.0.0.1"]
    assert policy.check("https://[::1]:22/x") == ["::1"]
    with pytest.raises(BlockedUrl, match="metadata"):
        policy.check("http://[::ffff:169.254.169.254]:80/")
    # without it, development is held to the production policy
    assert UrlPolicy.from_settings(Settings.model_validate({})) == UrlPolicy()
    with pytest.raises(BlockedUrl):
        UrlPolicy().check("http://127.0.0.1:8000/x")


# --------------------------------------------------------------------------- pinning


def test_pinned_https_connects_to_the_ip_with_the_original_host_and_sni(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(
        socket, "getaddrinfo", fake_dns({"hooks.example": ["2606:2800:220:1::1", "93.184.216.34"]})
    )
    url = "https://Hooks.Example:443/a/b?c=d%20e"
    target = pinned(url, check_url(url))
    assert target == Pinned(
        url="https://[2606:2800:220:1::1]/a/b?c=d%20e",  # the first address, bracketed
        headers={"host": "hooks.example", "connection": "close"},  # default port left out
        extensions={"sni_hostname": "hooks.example"},
    )


def test_pinned_keeps_a_port_and_encodes_idna() -> None:
    target = pinned("https://bücher.example:8443/x", ["93.184.216.34"])
    assert target.url == "https://93.184.216.34:8443/x"
    assert target.headers["host"] == "xn--bcher-kva.example:8443"
    assert target.extensions == {"sni_hostname": "xn--bcher-kva.example"}


def test_pinned_plain_http_needs_no_sni_and_keeps_connections() -> None:
    target = pinned("http://hooks.example:8080/h?x=1", ["::1"])
    assert target == Pinned(
        url="http://[::1]:8080/h?x=1", headers={"host": "hooks.example:8080"}, extensions={}
    )


def test_pinned_ip_literal_and_no_address() -> None:
    target = pinned("https://[2606:2800:220:1::1]/x", ["2606:2800:220:1::1"])
    assert target.url == "https://[2606:2800:220:1::1]/x" and target.extensions == {}
    assert target.headers["host"] == "[2606:2800:220:1::1]"
    with pytest.raises(BlockedUrl):
        pinned("https://hooks.example/x", [])
