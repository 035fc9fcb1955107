"""Download an input image given as an https URL, with the SSRF guard on every hop.

``follow_redirects`` is off: each redirect target is checked with ``webapi.urls.check_url``
before it is requested (at most ``max_redirects``), and the request is pinned to the
checked address (``webapi.urls.pinned``: no second DNS lookup), so a DNS answer that
changes between the check and the connection cannot reach a private address. A
redirect's ``Location`` is resolved against the original URL, not the pinned one. The
body is streamed and refused as soon as it passes ``max_bytes``; connect/read timeouts
bound a slow server.
Failures are typed: ``FetchRejected`` (permanent: blocked URL, 4xx, too large) and
``FetchUnavailable`` (transient: timeouts, dropped connections, 5xx).
"""

from __future__ import annotations

import time
from urllib.parse import urljoin

import httpx

from webapi.errors import BlockedUrl
from webapi.urls import Pinned, UrlPolicy

REDIRECT_CODES = frozenset({301, 302, 303, 307, 308})
RETRYABLE_CODES = frozenset({408, 425, 429})


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


def fetch_url(
    client: httpx.Client,
    url: str,
    *,
    max_bytes: int,
    urls: UrlPolicy,
    timeout_s: float = 10.0,
    max_redirects: int = 3,
) -> bytes:
    """The body of ``url`` (at most ``max_bytes``), following up to ``max_redirects``
    redirects, each one SSRF-checked under ``urls`` (schemes, ports, addresses)."""
    current = url
    for _hop in range(max_redirects + 1):
        try:
            target = urls.check_and_pin(current)
        except BlockedUrl as exc:
            raise FetchRejected(f"The input URL is not allowed: {exc.message}") from exc
        location = _get(client, target, max_bytes=max_bytes, timeout_s=timeout_s)
        if isinstance(location, bytes):
            return location
        current = urljoin(current, location)  # the original URL, never the pinned one
    raise FetchRejected(f"The input URL redirected more than {max_redirects} times.")


def _get(client: httpx.Client, target: Pinned, *, max_bytes: int, timeout_s: float) -> bytes | str:
    """The body, or the redirect target (``Location``) as a string."""
    timeout = httpx.Timeout(timeout_s, connect=min(timeout_s, 5.0))
    try:
        with client.stream(
            "GET",
            target.url,
            timeout=timeout,
            follow_redirects=False,
            headers={"accept": "image/*", **target.headers},
            extensions=dict(target.extensions),
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
            give_up_at = time.monotonic() + timeout_s  # a whole-body limit, not per read
            for chunk in response.iter_bytes():
                body += chunk
                if len(body) > max_bytes:
                    raise FetchRejected(f"The input image is larger than {max_bytes} bytes.")
                if time.monotonic() > give_up_at:
                    raise FetchUnavailable("The input URL was too slow to send the image.")
            return bytes(body)
    except httpx.TransportError as exc:
        raise FetchUnavailable(
            f"The input URL could not be fetched ({type(exc).__name__})."
        ) from exc
