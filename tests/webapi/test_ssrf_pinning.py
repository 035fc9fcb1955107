"""DNS rebinding: the input fetch and the webhook POST connect to the address the SSRF
guard checked, never to a second DNS answer.

Real HTTP(S) over loopback with the real relay code. Only the DNS answer is faked (an
attacker's DNS cannot exist here): ``rebind.test`` resolves to 127.0.0.1 on the first
lookup and to 127.0.0.2 on every later one; a server listens on each address, on the
same port, and records what reaches it.
"""

from __future__ import annotations

import datetime
import socket
import ssl
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from sqlalchemy.engine import Engine

from blocks.signing import certificate_builder
from faceflow.testing.jobs import make_user, outbox_of, succeed
from faceflow.testing.relay import FAST, submit
from faceflow.testing.wait import poll
from faceflow.testing.webhooks import independent_verify
from tests.webapi.conftest import make_settings
from webapi.relay import notify
from webapi.relay.fetch import FetchRejected, FetchUnavailable, fetch_url
from webapi.relay.runner import build_relay
from webapi.storage import LocalObjectStore
from webapi.urls import UrlPolicy

NAME = "rebind.test"
GOOD, EVIL = "127.0.0.1", "127.0.0.2"
BODY = b"\x89PNG\r\n\x1a\n" + b"p" * 100


@dataclass
class Server:
    """A threaded ``http.server`` on one loopback address recording every request."""

    httpd: ThreadingHTTPServer
    requests: list[tuple[str, str, dict[str, str], bytes]] = field(default_factory=list)
    sni: list[str | None] = field(default_factory=list)

    @property
    def port(self) -> int:
        return int(self.httpd.server_address[1])

    def paths(self) -> list[str]:
        return [path for _method, path, _headers, _body in self.requests]

    def hosts(self) -> set[str]:
        return {headers.get("host", "") for _method, _path, headers, _body in self.requests}

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def serve(address: str, port: int, tls: ssl.SSLContext | None) -> Server:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            return None

        def _answer(self, status: int, headers: dict[str, str], body: bytes) -> None:
            length = int(self.headers.get("content-length") or 0)
            received = self.rfile.read(length) if length else b""
            server.requests.append(
                (
                    self.command,
                    self.path,
                    {k.lower(): v for k, v in self.headers.items()},
                    received,
                )
            )
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            if self.path == "/hop":
                self._answer(302, {"location": "/img"}, b"")
            else:
                self._answer(200, {"content-type": "image/png"}, BODY)

        def do_POST(self) -> None:
            self._answer(204, {}, b"")

    httpd = ThreadingHTTPServer((address, port), Handler)
    server = Server(httpd)
    if tls is not None:
        tls.sni_callback = lambda _sock, name, _ctx: server.sni.append(name)
        httpd.socket = tls.wrap_socket(httpd.socket, server_side=True)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return server


@dataclass
class Pair:
    """The server the check sees (127.0.0.1) and the one a second lookup would reach
    (127.0.0.2), on the same port."""

    good: Server
    evil: Server

    @property
    def port(self) -> int:
        return self.good.port

    def url(self, path: str, scheme: str = "http") -> str:
        return f"{scheme}://{NAME}:{self.port}{path}"


@contextmanager
def servers(tls: Callable[[], ssl.SSLContext] | None = None) -> Iterator[Pair]:
    """Servers on 127.0.0.1 and 127.0.0.2 (each with its own TLS context from ``tls``)."""
    for _ in range(20):
        good = serve(GOOD, 0, tls() if tls else None)
        try:
            evil = serve(EVIL, good.port, tls() if tls else None)
        except OSError:  # that port is taken on 127.0.0.2: try another one
            good.close()
            continue
        try:
            yield Pair(good, evil)
        finally:
            good.close()
            evil.close()
        return
    pytest.fail("no port free on both 127.0.0.1 and 127.0.0.2")


@dataclass
class Dns:
    """Lookups of ``rebind.test`` answered so far (``rebind`` off: always 127.0.0.1)."""

    answers: list[str] = field(default_factory=list)
    rebind: bool = True


@pytest.fixture
def dns(monkeypatch: pytest.MonkeyPatch) -> Dns:
    """``rebind.test`` answers 127.0.0.1 first, 127.0.0.2 afterwards; other names go to
    the real resolver."""
    state = Dns()
    real = socket.getaddrinfo

    def getaddrinfo(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        name = host.decode("ascii") if isinstance(host, bytes) else host
        if name != NAME:
            return real(host, port, *args, **kwargs)
        state.answers.append(EVIL if state.rebind and state.answers else GOOD)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (state.answers[-1], int(port)))]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return state


@pytest.fixture
def pair() -> Iterator[Pair]:
    with servers() as instance:
        yield instance


def fetch(client: httpx.Client, url: str, schemes: tuple[str, ...] = ("http",)) -> bytes:
    urls = UrlPolicy(schemes=schemes, ports=None, allow_private=True)
    return fetch_url(client, url, max_bytes=10_000, urls=urls, timeout_s=5.0)


def test_the_fake_dns_rebinds_an_unpinned_request(pair: Pair, dns: Dns) -> None:
    """The set-up works: a plain httpx request after a check reaches 127.0.0.2."""
    socket.getaddrinfo(NAME, pair.port)  # what a check sees: 127.0.0.1
    with httpx.Client() as client:
        assert client.get(pair.url("/img")).content == BODY
    assert dns.answers == [GOOD, EVIL]
    assert pair.evil.paths() == ["/img"] and pair.good.requests == []


def test_fetch_connects_to_the_checked_address(pair: Pair, dns: Dns) -> None:
    with httpx.Client() as client:
        assert fetch(client, pair.url("/img")) == BODY
    assert dns.answers == [GOOD]  # the check's lookup only: the connection made none
    assert pair.good.paths() == ["/img"] and pair.good.hosts() == {f"{NAME}:{pair.port}"}
    assert pair.evil.requests == []


def test_a_redirect_is_resolved_against_the_original_url_and_checked(pair: Pair, dns: Dns) -> None:
    dns.rebind = False
    with httpx.Client() as client:
        assert fetch(client, pair.url("/hop")) == BODY
    assert dns.answers == [GOOD, GOOD]  # one check per hop, no lookup when connecting
    assert pair.good.paths() == ["/hop", "/img"]
    assert pair.good.hosts() == {f"{NAME}:{pair.port}"}  # not the IP: Location joined to
    assert pair.evil.requests == []  # the original URL, and looked up again


def test_webhook_connects_to_the_checked_address(
    pair: Pair, dns: Dns, engine: Engine, database_url: str, tmp_path: Path
) -> None:
    settings = make_settings(database_url, tmp_path)
    relay = build_relay(
        settings, engine=engine, store=LocalObjectStore(tmp_path / "storage"), timings=FAST
    )
    try:
        owner = make_user(engine, settings)
        job = submit(engine, settings, relay.store, owner, callback_url=pair.url("/hook?x=1"))
        succeed(engine, job.id, result_key=f"results/{job.id}/attempt-1.png")
        dns.answers.clear()  # whatever submission looked up: rebinding starts now

        def closed() -> bool:
            notify.run_once(relay)
            [row] = [r for r in outbox_of(engine, job.id) if r.kind == "webhook"]
            return row.done_at is not None

        poll(closed, 15, step_s=0.05)
    finally:
        relay.close()
    [row] = [r for r in outbox_of(engine, job.id) if r.kind == "webhook"]
    assert row.outcome == "done"
    assert dns.answers == [GOOD]
    [(method, path, headers, body)] = pair.good.requests
    assert (method, path, headers["host"]) == ("POST", "/hook?x=1", f"{NAME}:{pair.port}")
    assert headers["webhook-id"] == row.payload["webhook_id"]
    assert independent_verify(owner.webhook_secret, headers, body)
    assert pair.evil.requests == []


def test_an_ipv4_mapped_answer_is_judged_and_pinned_as_its_ipv4_address(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A DNS answer ``::ffff:a.b.c.d`` is the IPv4 address: 127.0.0.1 is fetched (private
    addresses allowed here) over IPv4; the metadata address is refused before connecting."""
    answers = {"mapped.test": "::ffff:127.0.0.1", "meta.test": "::ffff:169.254.169.254"}
    real = socket.getaddrinfo

    def getaddrinfo(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        name = host.decode("ascii") if isinstance(host, bytes) else host
        if name not in answers:
            return real(host, port, *args, **kwargs)
        return [(socket.AF_INET6, socket.SOCK_STREAM, 6, "", (answers[name], int(port), 0, 0))]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    with httpx.Client() as client:
        assert fetch(client, f"http://mapped.test:{pair.port}/img") == BODY
        with pytest.raises(FetchRejected, match="metadata"):
            fetch(client, f"http://meta.test:{pair.port}/img")
    assert pair.good.paths() == ["/img"] and pair.good.hosts() == {f"mapped.test:{pair.port}"}
    assert pair.evil.requests == []


# --------------------------------------------------------------------------- https


def certificate(name: str) -> tuple[bytes, bytes]:
    """A self-signed certificate for ``name`` and its key, PEM."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(hours=1)
    cert = (
        certificate_builder(subject, subject, key.public_key(), start, end)
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


@pytest.mark.parametrize("cert_name", [NAME, "other.test"])
def test_https_keeps_sni_and_certificate_checks_on_the_original_name(
    dns: Dns, tmp_path: Path, cert_name: str
) -> None:
    cert_pem, key_pem = certificate(cert_name)
    (tmp_path / "cert.pem").write_bytes(cert_pem)
    (tmp_path / "key.pem").write_bytes(key_pem)

    def server_tls() -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(tmp_path / "cert.pem", tmp_path / "key.pem")
        return context

    client_tls = ssl.create_default_context(cadata=cert_pem.decode("ascii"))
    with servers(server_tls) as pair, httpx.Client(verify=client_tls) as client:
        if cert_name == NAME:
            assert fetch(client, pair.url("/img", "https"), ("https",)) == BODY
            assert pair.good.paths() == ["/img"]
            assert pair.good.hosts() == {f"{NAME}:{pair.port}"}
        else:  # verified against rebind.test, not against the IP nor skipped
            with pytest.raises(FetchUnavailable):
                fetch(client, pair.url("/img", "https"), ("https",))
            assert pair.good.requests == []
        assert pair.good.sni == [NAME]
        assert pair.evil.requests == [] and pair.evil.sni == []
    assert dns.answers == [GOOD]
