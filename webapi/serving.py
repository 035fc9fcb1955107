"""How uvicorn serves the API: its HTTP protocol with a header read deadline.

uvicorn bounds an idle keep-alive connection (``--timeout-keep-alive``) but not a client
that opens a connection and sends its request headers a byte at a time: ``HttpProtocol``
closes a connection that has no complete request headers ``header_read_seconds`` after it
opened or after its previous response. The body's deadline is the app's
(``webapi.bodies.BodyDeadlineMiddleware``). ``UVICORN_OPTIONS`` is what every launcher
passes (``faceflow up``, the systemd unit):

    uvicorn --factory webapi.main:create_app --http webapi.serving:HttpProtocol ...
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from webapi.config import get_settings

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as _Fastest
except ImportError:  # pragma: no cover - httptools is a dependency; h11 is uvicorn's fallback
    _Fastest = H11Protocol  # type: ignore[assignment,misc]

log = logging.getLogger(__name__)

#: uvicorn options of every launcher of the API (besides host, port and workers).
UVICORN_OPTIONS: tuple[str, ...] = (
    "--http",
    "webapi.serving:HttpProtocol",
    "--timeout-keep-alive",
    "5",
    "--no-access-log",
)


class HeaderDeadline:
    """Mixin for a uvicorn HTTP protocol class: the header read deadline."""

    #: Seconds allowed for a request's headers (None: ``Settings.header_read_seconds``).
    header_read_seconds: float | None = None
    _header_timer: asyncio.TimerHandle | None = None

    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport
    cycle: Any

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)  # type: ignore[misc]
        self._arm_header_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        self._arm_header_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_deadline()
        super().connection_lost(exc)  # type: ignore[misc]

    def _arm_header_deadline(self) -> None:
        self._disarm_header_deadline()
        seconds = self.header_read_seconds or get_settings().header_read_seconds
        self._header_timer = self.loop.call_later(seconds, self._headers_too_slow, seconds)

    def _disarm_header_deadline(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self, seconds: float) -> None:
        self._header_timer = None
        waiting = self.cycle is None or self.cycle.response_complete
        if waiting and not self.transport.is_closing():
            log.info("closed a connection: no complete request headers within %g s", seconds)
            self.transport.close()


class HttpProtocol(HeaderDeadline, _Fastest):  # type: ignore[misc,valid-type]
    """uvicorn's httptools protocol (h11 where httptools is missing) with the deadline."""


class H11HttpProtocol(HeaderDeadline, H11Protocol):  # type: ignore[misc]
    """uvicorn's h11 protocol with the deadline."""
