"""JSON-lines logging with correlation ids (request id, job id, attempt).

``request_id``, ``job_id`` and ``attempt`` are context variables: the request middleware
sets the first (from ``X-Request-ID`` or a fresh one, echoed in the response), code that
handles a job sets the others with ``log_context(job_id=..., attempt=...)``, and every
record carries whatever is set. Messages never include image bytes, keys or secrets:
callers log ids and codes, and ``redact_url`` strips credentials and queries from URLs.
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

request_id: ContextVar[str | None] = ContextVar("faceflow_request_id", default=None)
job_id: ContextVar[str | None] = ContextVar("faceflow_job_id", default=None)
attempt: ContextVar[int | None] = ContextVar("faceflow_attempt", default=None)

_access = logging.getLogger("webapi.access")
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


_CONTEXT = (("request_id", request_id), ("job_id", job_id), ("attempt", attempt))
_STAMP = "faceflow_context"
_base_factory = logging.getLogRecordFactory()


def _record_with_context(*args: Any, **kwargs: Any) -> logging.LogRecord:
    """Stamp the correlation ids on each record when it is created (so handlers that format
    later, in another thread or after the request, still see them).

    They go under one private attribute, not as ``record.job_id``: ``Logger.makeRecord``
    refuses ``extra`` keys that the record already has, so stamping ``job_id`` itself made
    every ``log.info(..., extra={"job_id": ...})`` (the relay's) raise ``KeyError``.
    """
    record = _base_factory(*args, **kwargs)
    setattr(record, _STAMP, {name: var.get() for name, var in _CONTEXT})
    return record


logging.setLogRecordFactory(_record_with_context)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, correlation ids, error."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        stamped = getattr(record, _STAMP, None) or {}
        for name, var in _CONTEXT:
            value = getattr(record, name, None) or stamped.get(name) or var.get()
            if value is not None:
                entry[name] = value
        if record.exc_info:
            entry["error"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure_logging(level: str = "INFO") -> None:
    """Send every log record to stderr as JSON lines (idempotent)."""
    root = logging.getLogger()
    if not any(isinstance(h.formatter, JsonFormatter) for h in root.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(JsonFormatter())
        root.addHandler(handler)
    root.setLevel(level.upper())


@contextmanager
def log_context(
    *, job: str | uuid.UUID | None = None, attempt_no: int | None = None
) -> Iterator[None]:
    """Set the job id and attempt on every record logged inside the block."""
    job_token = job_id.set(None if job is None else str(job))
    attempt_token = attempt.set(attempt_no)
    try:
        yield
    finally:
        attempt.reset(attempt_token)
        job_id.reset(job_token)


def redact_url(url: str) -> str:
    """``url`` without credentials, query or fragment (safe to log)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable url>"
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


class RequestIdMiddleware:
    """ASGI middleware: adopt a well-formed ``X-Request-ID`` or make one, set it for the
    request's logs, and echo it on the response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = Headers(scope=scope).get("x-request-id", "")
        value = given if _REQUEST_ID.match(given) else uuid.uuid4().hex
        token = request_id.set(value)

        started = time.perf_counter()
        status: list[int] = []

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message).append("X-Request-ID", value)
                status.append(int(message["status"]))
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            _access.info(
                "%s %s %s %.1f ms",
                scope.get("method", "-"),
                scope.get("path", "-"),  # the path only: query strings are never logged
                status[0] if status else "-",
                (time.perf_counter() - started) * 1000.0,
            )
            request_id.reset(token)
