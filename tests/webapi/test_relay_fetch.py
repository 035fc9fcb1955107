"""URL inputs: ``fetch_url`` against a real loopback server (SSRF guard on every hop,
redirect and size limits, typed transient/permanent failures, one wall-clock deadline for
the whole fetch however slowly a server trickles bytes)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from faceflow.testing.net import free_port
from faceflow.testing.relay import Receiver, receiver, tarpit
from faceflow.testing.wait import poll
from webapi.relay.fetch import (
    Deadline,
    FetchRejected,
    FetchTimedOut,
    FetchUnavailable,
    fetch_url,
)
from webapi.urls import DEVELOPMENT, UrlPolicy

BODY = b"\x89PNG\r\n\x1a\n" + b"x" * 5000


@pytest.fixture
def server() -> Iterator[Receiver]:
    with receiver() as instance:
        instance.files["/img"] = (200, {"content-type": "image/png"}, BODY)
        yield instance


@pytest.fixture
def client() -> Iterator[httpx.Client]:
    with httpx.Client() as instance:
        yield instance


def fetch(client: httpx.Client, url: str, **kwargs: object) -> bytes:
    options: dict[str, object] = {
        "max_bytes": 10_000,
        "urls": DEVELOPMENT,
        "timeout_s": 5.0,
        **kwargs,
    }
    return fetch_url(client, url, **options)  # type: ignore[arg-type]


def test_fetches_the_body_through_relative_and_absolute_redirects(
    server: Receiver, client: httpx.Client
) -> None:
    server.files["/a"] = (301, {"location": "/b"}, b"")
    server.files["/b"] = (308, {"location": f"{server.url}/img"}, b"")
    assert fetch(client, f"{server.url}/a") == BODY
    assert [r.path for r in server.requests] == ["/a", "/b", "/img"]


def test_too_many_redirects_are_refused(server: Receiver, client: httpx.Client) -> None:
    for hop in range(5):
        server.files[f"/r{hop}"] = (302, {"location": f"/r{hop + 1}"}, b"")
    with pytest.raises(FetchRejected, match="redirected more than 3"):
        fetch(client, f"{server.url}/r0")
    assert len(server.requests) == 4  # the first request and 3 redirects


@pytest.mark.parametrize(
    "target",
    ["http://169.254.169.254/latest/meta-data", "http://[fd00:ec2::254]/", "file:///etc/passwd"],
)
def test_a_redirect_to_a_blocked_address_is_not_followed(
    server: Receiver, client: httpx.Client, target: str
) -> None:
    server.files["/evil"] = (302, {"location": target}, b"")
    with pytest.raises(FetchRejected, match="not allowed"):
        fetch(client, f"{server.url}/evil")
    assert [r.path for r in server.requests] == ["/evil"]


def test_private_addresses_are_refused_before_any_connection(
    server: Receiver, client: httpx.Client
) -> None:
    for url in (f"{server.url}/img", "http://10.0.0.1/x", "http://[::1]/x", "http://localhost/x"):
        with pytest.raises(FetchRejected):
            fetch(client, url, urls=UrlPolicy(schemes=("http", "https"), ports=None))
    assert server.requests == []


def test_plain_http_is_refused_by_default(server: Receiver, client: httpx.Client) -> None:
    with pytest.raises(FetchRejected):
        fetch(client, f"{server.url}/img", urls=UrlPolicy(ports=None, allow_private=True))
    assert server.requests == []


def test_size_limit_by_header_and_while_streaming(server: Receiver, client: httpx.Client) -> None:
    with pytest.raises(FetchRejected, match="larger than"):
        fetch(client, f"{server.url}/img", max_bytes=1000)
    server.files["/unsized"] = (200, {"x-unsized": "1"}, BODY)
    with pytest.raises(FetchRejected, match="larger than"):
        fetch(client, f"{server.url}/unsized", max_bytes=1000)
    assert fetch(client, f"{server.url}/unsized") == BODY


def test_server_errors_are_transient_client_errors_permanent(
    server: Receiver, client: httpx.Client
) -> None:
    server.files["/busy"] = (503, {}, b"")
    with pytest.raises(FetchUnavailable):
        fetch(client, f"{server.url}/busy")
    with pytest.raises(FetchRejected, match="404"):
        fetch(client, f"{server.url}/missing")
    with pytest.raises(FetchUnavailable):
        fetch(client, f"http://127.0.0.1:{free_port()}/img")  # nothing listens there


def test_a_redirect_to_a_port_off_the_allow_list_is_not_followed(client: httpx.Client) -> None:
    """Each hop honours the port allow-list: a public server cannot bounce the fetch to
    another port (here: a second loopback server standing in for, say, Redis)."""
    with receiver() as allowed, receiver() as other:
        other.files["/img"] = (200, {"content-type": "image/png"}, BODY)
        allowed.files["/hop"] = (302, {"location": f"{other.url}/img"}, b"")
        allowed.files["/img"] = (200, {"content-type": "image/png"}, BODY)
        port = int(allowed.url.rsplit(":", 1)[1])
        urls = UrlPolicy(schemes=("http",), ports=frozenset({port}), allow_private=True)
        assert fetch(client, f"{allowed.url}/img", urls=urls) == BODY
        with pytest.raises(FetchRejected, match=f"port must be one of: {port}"):
            fetch(client, f"{allowed.url}/hop", urls=urls)
        assert [r.path for r in allowed.requests] == ["/img", "/hop"]
        assert other.requests == []


@pytest.mark.parametrize("mode", ["head", "body"])
def test_a_tarpit_is_cut_at_the_deadline(client: httpx.Client, mode: str) -> None:
    """One byte a second never trips a read timeout, in the headers or in the body: the
    whole-fetch deadline ends it, and the server sees the connection go."""
    with tarpit(mode=mode, interval_s=1.0) as slow:
        started = time.monotonic()
        with pytest.raises(FetchTimedOut, match="within 2 s") as raised:
            fetch(client, f"{slow.url}/img", timeout_s=2.0)
        took = time.monotonic() - started
        assert raised.value.code == "input_fetch_timeout"
        assert 1.9 <= took < 2.5, took
        poll(lambda: not slow.open, 3, step_s=0.05)
        assert (slow.connections, slow.open) == (1, 0)


def test_the_deadline_covers_every_redirect_hop(server: Receiver, client: httpx.Client) -> None:
    with tarpit(mode="body", interval_s=0.5) as slow:
        server.files["/hop"] = (302, {"location": f"{slow.url}/img"}, b"")
        started = time.monotonic()
        with pytest.raises(FetchTimedOut):
            fetch(client, f"{server.url}/hop", timeout_s=1.5)
        assert time.monotonic() - started < 2.0
        assert [r.path for r in server.requests] == ["/hop"] and slow.connections == 1


def test_a_deadline_cut_from_another_thread_ends_the_fetch_at_once(
    client: httpx.Client,
) -> None:
    """What the fetch lane does when the job is cancelled or the relay stops."""
    with tarpit(mode="head", interval_s=1.0) as slow, Deadline(30.0) as deadline:
        started = time.monotonic()
        timer = threading.Timer(0.5, deadline.cut, args=("the job is no longer queued",))
        timer.start()
        with pytest.raises(FetchUnavailable, match="no longer queued") as raised:
            fetch_url(
                client,
                f"{slow.url}/img",
                max_bytes=10_000,
                urls=DEVELOPMENT,
                deadline=deadline,
            )
        assert not isinstance(raised.value, FetchTimedOut)
        assert time.monotonic() - started < 1.0
