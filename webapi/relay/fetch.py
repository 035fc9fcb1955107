"""Download an input image given as an https URL, with the SSRF guard on every hop and a
hard wall-clock deadline for the whole fetch.

``follow_redirects`` is off: each redirect target is checked with ``webapi.urls.check_url``
before it is requested (at most ``max_redirects``), and the request is pinned to the
checked address (``webapi.urls.pinned``: no second DNS lookup), so a DNS answer that
changes between the check and the connection cannot reach a private address. A
redirect's ``Location`` is resolved against the original URL, not the pinned one. The
body is streamed and refused as soon as it passes ``max_bytes``.

The ``Deadline`` covers connecting, TLS, the response head, every redirect and the body
together. httpx's timeouts are per operation (a server trickling one byte a second never
trips a read timeout, in the body or in the headers), so each hop's timeouts are set from
the time left, the deadline is checked at every chunk, and when it passes a timer shuts
down the connection's socket, which ends any read still blocked in it: no fetch outlives
its deadline by more than a scheduling delay. Every request asks the server to close the
connection afterwards, so each hop has a connection of its own that the deadline can cut.
(The DNS lookup of the SSRF check is the system resolver's, bounded by its own timeout.)

Failures are typed: ``FetchRejected`` (permanent: blocked URL, 4xx, too large),
``FetchUnavailable`` (transient: dropped connections, 5xx) and its ``FetchTimedOut``
(the deadline passed).
"""

from __future__ import annotations

import socket
import threading
import time
from types import TracebackType
from typing import Any
from urllib.parse import urljoin

import httpx

from webapi.errors import BlockedUrl
from webapi.urls import Pinned, UrlPolicy

REDIRECT_CODES = frozenset({301, 302, 303, 307, 308})
RETRYABLE_CODES = frozenset({408, 425, 429})
#: httpcore trace events whose ``return_value`` is the stream a request will use.
_CONNECTED = frozenset({"connection.connect_tcp.complete", "connection.start_tls.complete"})


class FetchError(Exception):
    """An input URL could not be fetched; ``public_message`` is safe to show."""

    code = "input_fetch_failed"

    def __init__(self, public_message: str) -> None:
        self.public_message = public_message
        super().__init__(public_message)


class FetchRejected(FetchError):
    """Fetching this URL can never succeed (blocked, refused, too large)."""


class FetchUnavailable(FetchError):
    """The server could not be reached or failed transiently: try again later."""


class FetchTimedOut(FetchUnavailable):
    """The whole fetch did not finish within its deadline."""

    code = "input_fetch_timeout"


class Deadline:
    """A wall-clock limit for one whole fetch, which can also be cut short from another
    thread (``cut``). Used as a context manager: while open, a timer cuts it when the time
    is up, and cutting shuts down the socket of the request in flight."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.at = time.monotonic() + seconds
        self.reason: str | None = None
        self._lock = threading.Lock()
        self._fds: set[int] = set()
        self._timer = threading.Timer(max(0.0, seconds), self.cut, args=("deadline",))
        self._timer.daemon = True

    def __enter__(self) -> Deadline:
        self._timer.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._timer.cancel()

    def left(self) -> float:
        """Seconds left (0 once passed or cut)."""
        return 0.0 if self.reason else max(0.0, self.at - time.monotonic())

    def check(self) -> None:
        """Raise ``FetchTimedOut`` (or ``FetchUnavailable`` when stopped) if over."""
        if self.reason is None and time.monotonic() >= self.at:
            self.reason = "deadline"
        if self.reason == "deadline":
            raise FetchTimedOut(
                f"The input URL did not deliver the image within {self.seconds:g} s."
            )
        if self.reason is not None:
            raise FetchUnavailable(f"The input fetch was stopped ({self.reason}).")

    def cut(self, reason: str = "stopped") -> None:
        """End the fetch now: shut down the socket of the request in flight, if any."""
        with self._lock:
            if self.reason is None:
                self.reason = reason
            for fd in self._fds:
                _shutdown(fd)

    def trace(self, event: str, info: dict[str, Any]) -> None:
        """httpcore's ``trace`` extension: remember each new connection's socket."""
        if event not in _CONNECTED:
            return
        sock = info["return_value"].get_extra_info("socket")
        if sock is None:
            return
        with self._lock:
            self._fds.add(sock.fileno())
            if self.reason is not None:
                _shutdown(sock.fileno())

    def hop_done(self) -> None:
        """Forget the sockets of the finished request (closed by now: their numbers may
        be reused by anything)."""
        with self._lock:
            self._fds.clear()


def _shutdown(fd: int) -> None:
    """Shut down the socket ``fd`` (both ways) without closing it: a read blocked in it
    returns at once; its owner closes it as usual."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        sock.detach()


def fetch_url(
    client: httpx.Client,
    url: str,
    *,
    max_bytes: int,
    urls: UrlPolicy,
    timeout_s: float = 10.0,
    max_redirects: int = 3,
    deadline: Deadline | None = None,
) -> bytes:
    """The body of ``url`` (at most ``max_bytes``), following up to ``max_redirects``
    redirects, each one SSRF-checked under ``urls`` (schemes, ports, addresses), all within
    ``deadline`` (default: a new one of ``timeout_s``)."""
    if deadline is None:
        with Deadline(timeout_s) as own:
            return fetch_url(
                client,
                url,
                max_bytes=max_bytes,
                urls=urls,
                max_redirects=max_redirects,
                deadline=own,
            )
    current = url
    for _hop in range(max_redirects + 1):
        try:
            target = urls.check_and_pin(current)
        except BlockedUrl as exc:
            raise FetchRejected(f"The input URL is not allowed: {exc.message}") from exc
        deadline.check()
        try:
            location = _get(client, target, max_bytes=max_bytes, deadline=deadline)
        finally:
            deadline.hop_done()
        if isinstance(location, bytes):
            return location
        current = urljoin(current, location)  # the original URL, never the pinned one
    raise FetchRejected(f"The input URL redirected more than {max_redirects} times.")


def _get(
    client: httpx.Client, target: Pinned, *, max_bytes: int, deadline: Deadline
) -> bytes | str:
    """The body, or the redirect target (``Location``) as a string."""
    left = deadline.left()
    timeout = httpx.Timeout(left, connect=min(left, 5.0))
    try:
        with client.stream(
            "GET",
            target.url,
            timeout=timeout,
            follow_redirects=False,
            headers={"accept": "image/*", "connection": "close", **target.headers},
            extensions={**target.extensions, "trace": deadline.trace},
        ) as response:
            code = response.status_code
            if code in REDIRECT_CODES:
                location = response.headers.get("location")
                if not location:
                    raise FetchRejected("The input URL redirected without a Location.")
                return location
            if code >= 500 or code in RETRYABLE_CODES:
                raise FetchUnavailable(f"The input URL answered HTTP {code}.")
            if code != 200:
                raise FetchRejected(f"The input URL answered HTTP {code}.")
            declared = response.headers.get("content-length")
            if declared is not None and declared.isdigit() and int(declared) > max_bytes:
                raise FetchRejected(f"The input image is larger than {max_bytes} bytes.")
            body = bytearray()
            for chunk in response.iter_bytes():
                body += chunk
                if len(body) > max_bytes:
                    raise FetchRejected(f"The input image is larger than {max_bytes} bytes.")
                deadline.check()
            deadline.check()  # a cut socket can look like the end of an unsized body
            return bytes(body)
    except httpx.TransportError as exc:
        deadline.check()  # a timeout or a cut socket: the deadline's error, not httpx's
        raise FetchUnavailable(
            f"The input URL could not be fetched ({type(exc).__name__})."
        ) from exc
