"""SSRF guard: blocked URLs are refused after resolution, and no connection is ever made."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import pytest

from webapi.errors import BlockedUrl
from webapi.urls import Pinned, check_url, is_public, pinned


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


BLOCKED = [
    "http://127.0.0.1/hook",
    "http://127.1.2.3:8080/hook",
    "http://10.0.0.1/hook",
    "http://172.16.5.4/hook",
    "http://192.168.1.1/hook",
    "http://169.254.169.254/latest/meta-data/",
    "http://100.64.0.1/hook",
    "http://0.0.0.0/hook",
    "http://224.0.0.1/hook",
    "http://255.255.255.255/hook",
    "http://[::1]/hook",
    "http://[::]/hook",
    "http://[fe80::1]/hook",
    "http://[fd00:ec2::254]/latest",
    "http://[fc00::5]/hook",
    "http://[ff02::1]/hook",
    "http://[::ffff:127.0.0.1]/hook",
    "http://[::ffff:10.0.0.1]/hook",
    "http://[2002:7f00:1::1]/hook",  # 6to4 of 127.0.0.1
    "http://[64:ff9b::a00:1]/hook",  # NAT64 of 10.0.0.1
    "http://2130706433/hook",  # 127.0.0.1 as one integer
    "http://0x7f.1/hook",
    "http://localhost/hook",
    "http://localhost.:9/hook",
]


@pytest.mark.parametrize("url", BLOCKED)
def test_non_public_addresses_are_blocked(url: str) -> None:
    with pytest.raises(BlockedUrl):
        check_url(url)


@pytest.mark.parametrize(
    ("host", "addresses"),
    [
        ("evil.example", ["127.0.0.1"]),
        ("rebind.example", ["93.184.216.34", "10.1.2.3"]),  # one bad address is enough
        ("six.example", ["2606:2800:220:1::1", "::1"]),
        ("meta.example", ["169.254.169.254"]),
    ],
)
def test_hostnames_resolving_to_private_addresses_are_blocked(
    monkeypatch: pytest.MonkeyPatch, host: str, addresses: list[str]
) -> None:
    monkeypatch.setattr(socket, "getaddrinfo", fake_dns({host: addresses}))
    with pytest.raises(BlockedUrl, match="non-public"):
        check_url(f"https://{host}/x")


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
    for url in ("http://169.254.169.254/latest", "http://[fd00:ec2::254]/"):
        with pytest.raises(BlockedUrl):
            check_url(url, allow_private=True)
    with pytest.raises(BlockedUrl):
        check_url("https://user:pw@127.0.0.1/", allow_private=True)


def test_https_only_schemes() -> None:
    with pytest.raises(BlockedUrl, match="scheme"):
        check_url("http://93.184.216.34/", schemes=("https",))


def test_is_public_examples() -> None:
    import ipaddress

    assert is_public(ipaddress.ip_address("8.8.8.8"))
    assert is_public(ipaddress.ip_address("2001:4860:4860::8888"))
    assert not is_public(ipaddress.ip_address("100.127.255.255"))
    assert not is_public(ipaddress.ip_address("::ffff:192.168.0.1"))


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
