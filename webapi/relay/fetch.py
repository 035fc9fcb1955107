"""Download an input image given as an https URL, with the SSRF guard on every hop and a
hard wall-clock deadline for the whole fetch.

``follow_redirects`` is off: each redirect target is checked with ``webapi.urls.check_url``
before it is requested (at most ``max_redirects``), and the request is pinned to the
checked address (``webapi.urls.pinned``: no second DNS lookup), so a DNS answer that
changes between the check and the connection cannot reach a private address. A
redirect's ``Location`` is resolved against the original URL, not the pinned one. The
body is streamed into a ``Body`` and refused as soon as it passes its limit: in memory
for an image (``fetch_url``), or for a target that may be a video a ``Spool``, a temporary
file hashed as it arrives, whose limit is the video one once its first bytes show a
video container.

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

import hashlib
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, ClassVar, Protocol, Required, TypedDict, Unpack
from urllib.parse import urljoin

import httpx

from tasks.closing import Closing
from tasks.error_codes import JobErrorCode
from tasks.errors import VideoTooLarge
from webapi.errors import BlockedUrl
from webapi.inputs import is_video
from webapi.urls import Pinned, UrlPolicy

REDIRECT_CODES = frozenset({301, 302, 303, 307, 308})
RETRYABLE_CODES = frozenset({408, 425, 429})
#: httpcore trace events whose ``return_value`` is the stream a request will use.
_CONNECTED = frozenset({"connection.connect_tcp.complete", "connection.start_tls.complete"})


class FetchError(Exception):
    """An input URL could not be fetched; ``public_message`` is safe to show."""

    code: ClassVar[JobErrorCode] = JobErrorCode.input_fetch_failed

    def __init__(self, public_message: str) -> None:
        self.public_message = public_message
        super().__init__(public_message)


class FetchRejected(FetchError):
    """Fetching this URL can never succeed (blocked, refused, too large)."""


class FetchUnavailable(FetchError):
    """The server could not be reached or failed transiently: try again later."""


class FetchTimedOut(FetchUnavailable):
    """The whole fetch did not finish within its deadline."""

    code = JobErrorCode.input_fetch_timeout


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

    def __exit__(self, *exc: object) -> None:
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


class Body(Protocol):
    """Where a fetched body goes, and its size limit: ``expect`` is told the declared
    length (if any) and ``write`` each piece; either raises once the body is too large."""

    accept: str

    def expect(self, declared: int) -> None:
        """The response's ``Content-Length``."""

    def write(self, piece: bytes) -> None:
        """The next piece of the body."""


class Buffer:
    """A body kept in memory, at most ``max_bytes``."""

    accept = "image/*"

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.data = bytearray()

    def expect(self, declared: int) -> None:
        """Refuse a body declared larger than the limit before reading it."""
        if declared > self.max_bytes:
            raise FetchRejected(f"The input image is larger than {self.max_bytes} bytes.")

    def write(self, piece: bytes) -> None:
        """Keep ``piece``, refusing a body past the limit."""
        self.data += piece
        if len(self.data) > self.max_bytes:
            raise FetchRejected(f"The input image is larger than {self.max_bytes} bytes.")


class Spool(Closing):
    """A fetched target streamed to a temporary file and hashed (SHA-256) as it arrives:
    at most ``image_bytes``, or ``video_bytes`` once its first bytes show a video container
    (``webapi.inputs.is_video``); a video past its limit is ``VideoTooLarge``, as an
    upload is. The file is removed on ``close``."""

    accept = "image/*, video/*"

    def __init__(self, *, image_bytes: int, video_bytes: int) -> None:
        self.image_bytes, self.video_bytes = image_bytes, video_bytes
        # closed (and removed) by ``close`` / the ``with`` block
        self.file = tempfile.NamedTemporaryFile(prefix="faceflow-fetch-", suffix=".input")  # noqa: SIM115
        self.sha256 = hashlib.sha256()
        self.size = 0
        self.head = b""
        self.declared: int | None = None

    @property
    def path(self) -> Path:
        """The temporary file (whole once the fetch returned)."""
        return Path(self.file.name)

    @property
    def is_video(self) -> bool:
        """Whether the body is a video container's."""
        return is_video(self.head)

    def expect(self, declared: int) -> None:
        """Remember the declared length: checked once the first bytes tell the limit."""
        self.declared = declared

    def write(self, piece: bytes) -> None:
        """Hash and spool ``piece``, refusing a body past its limit."""
        if len(self.head) < _HEAD:
            self.head += piece[: _HEAD - len(self.head)]
        self.size += len(piece)
        if len(self.head) >= _HEAD:
            self._check(max(self.size, self.declared or 0))
        self.sha256.update(piece)
        self.file.write(piece)

    def finish(self) -> None:
        """Check the whole body (a short one never filled the head) and flush it."""
        self._check(self.size)
        self.file.flush()

    def read(self) -> bytes:
        """The whole body (an image: at most ``image_bytes``)."""
        self.file.seek(0)
        return self.file.read()

    def close(self) -> None:
        """Remove the temporary file."""
        self.file.close()

    def _check(self, size: int) -> None:
        if self.is_video and size > self.video_bytes:
            raise VideoTooLarge(detail=f"more than {self.video_bytes} bytes")
        if not self.is_video and size > self.image_bytes:
            raise FetchRejected(f"The input image is larger than {self.image_bytes} bytes.")


_HEAD = 12  # bytes that tell a video container (``is_video``)


class FetchOptions(TypedDict, total=False):
    """``fetch_into``'s options, as ``fetch_url`` passes them on."""

    urls: Required[UrlPolicy]
    timeout_s: float
    max_redirects: int
    deadline: Deadline | None


def fetch_url(
    client: httpx.Client, url: str, *, max_bytes: int, **options: Unpack[FetchOptions]
) -> bytes:
    """The body of ``url`` (at most ``max_bytes``, in memory): ``fetch_into`` a
    ``Buffer``."""
    body = Buffer(max_bytes)
    fetch_into(client, url, body, **options)
    return bytes(body.data)


def fetch_into(
    client: httpx.Client,
    url: str,
    body: Body,
    *,
    urls: UrlPolicy,
    timeout_s: float = 10.0,
    max_redirects: int = 3,
    deadline: Deadline | None = None,
) -> None:
    """Stream the body of ``url`` into ``body`` (which bounds its size), following up to
    ``max_redirects`` redirects, each one SSRF-checked under ``urls`` (schemes, ports,
    addresses), all within ``deadline`` (default: a new one of ``timeout_s``)."""
    if deadline is None:
        with Deadline(timeout_s) as own:
            fetch_into(client, url, body, urls=urls, max_redirects=max_redirects, deadline=own)
            return
    current = url
    for _hop in range(max_redirects + 1):
        try:
            target = urls.check_and_pin(current)
        except BlockedUrl as exc:
            raise FetchRejected(f"The input URL is not allowed: {exc.message}") from exc
        deadline.check()
        try:
            location = _get(client, target, body, deadline=deadline)
        finally:
            deadline.hop_done()
        if location is None:
            return
        current = urljoin(current, location)  # the original URL, never the pinned one
    raise FetchRejected(f"The input URL redirected more than {max_redirects} times.")


def _get(client: httpx.Client, target: Pinned, body: Body, *, deadline: Deadline) -> str | None:
    """Stream the body into ``body``; or the redirect target (``Location``)."""
    left = deadline.left()
    timeout = httpx.Timeout(left, connect=min(left, 5.0))
    try:
        with client.stream(
            "GET",
            target.url,
            timeout=timeout,
            follow_redirects=False,
            headers={"accept": body.accept, "connection": "close", **target.headers},
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
            if declared is not None and declared.isdigit():
                body.expect(int(declared))
            for chunk in response.iter_bytes():
                body.write(chunk)
                deadline.check()
            deadline.check()  # a cut socket can look like the end of an unsized body
            return None
    except httpx.TransportError as exc:
        deadline.check()  # a timeout or a cut socket: the deadline's error, not httpx's
        raise FetchUnavailable(
            f"The input URL could not be fetched ({type(exc).__name__})."
        ) from exc
