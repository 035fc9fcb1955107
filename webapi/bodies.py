"""Request bodies with bounded work: size limits, a read deadline, and JSON shape bounds.

A JSON body is refused before pydantic parses it when it is larger than
``Settings.max_json_bytes`` (413) or when its shape is hostile (422 ``json_too_complex``):
more keys, strings and list items together than ``json_max_items``, or nesting deeper
than ``json_max_depth``. The shape check is one regex pass over the bytes whose Python
work stops at the bound, so a body of millions of keys costs milliseconds; parsing a
body that passes it is then small work too (``parse_json_model``, run in a worker
thread by the route).

``BodyDeadlineMiddleware`` bounds the time a client may take to send its whole body
(``Settings.body_read_seconds``): a client that sends headers and then stalls gets 408
``request_timeout`` and its connection is closed, instead of holding a request forever.
"""

from __future__ import annotations

import re
import time
from collections.abc import AsyncGenerator
from typing import TypeVar

import anyio
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from webapi.errors import (
    InvalidRequest,
    JsonTooComplex,
    PayloadTooLarge,
    RequestTimeout,
    describe_validation,
)

Model = TypeVar("Model", bound=BaseModel)

#: A JSON string (escapes included), an opening or closing bracket, or a comma: every
#: token that adds a key, a value or a level (numbers and literals are counted by the
#: commas that separate them).
_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[{]|[\]}]|,', re.DOTALL)
_OPEN, _CLOSE = frozenset(b"[{"), frozenset(b"]}")


def check_json_shape(raw: bytes, *, max_items: int, max_depth: int) -> None:
    """``JsonTooComplex`` when ``raw`` holds more than ``max_items`` strings (keys
    included) and list/object items, or nests deeper than ``max_depth``.

    Not a parser: malformed JSON passes here and is refused by the parser after it."""
    items = depth = 0
    for match in _TOKEN.finditer(raw):
        first = raw[match.start()]
        if first in _OPEN:
            depth += 1
            if depth > max_depth:
                raise JsonTooComplex(f"The JSON body nests deeper than {max_depth} levels.")
        elif first in _CLOSE:
            depth -= 1
        else:
            items += 1
            if items > max_items:
                raise JsonTooComplex(
                    f"The JSON body has more than {max_items} keys, strings and items."
                )


def parse_json_model(
    model: type[Model], raw: bytes | str, *, max_items: int, max_depth: int
) -> Model:
    """``model`` from JSON ``raw`` after ``check_json_shape`` (``InvalidRequest`` with a
    short message when it does not validate)."""
    data = raw.encode() if isinstance(raw, str) else raw
    check_json_shape(data, max_items=max_items, max_depth=max_depth)
    try:
        return model.model_validate_json(data)
    except ValidationError as exc:
        raise InvalidRequest(describe_validation(exc.errors())) from exc


async def read_limited(request: Request, limit: int) -> bytes:
    """The whole body, ``PayloadTooLarge`` as soon as it (or its Content-Length) passes
    ``limit`` bytes. Cached on the request, so ``request.form()`` parses it afterwards."""
    body = b"".join([chunk async for chunk in limited_stream(request, limit)])
    request._body = body
    return body


class BodyDeadlineMiddleware:
    """ASGI middleware: the request body must arrive within ``seconds`` of the request's
    start plus one second per ``min_rate`` bytes received (a large video upload earns its
    time as it arrives; a client that trickles a few bytes does not), else
    ``RequestTimeout`` (408) is raised from ``receive`` (the error handlers answer it;
    uvicorn then closes the connection, whose body was not read to the end). Once the body
    is complete, later ``receive`` calls (disconnect checks) are not bound."""

    def __init__(self, app: ASGIApp, *, seconds: float, min_rate: float) -> None:
        self.app = app
        self.seconds = seconds
        self.min_rate = min_rate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        deadline = time.monotonic() + self.seconds
        body_done = False

        async def receive_by_deadline() -> Message:
            nonlocal body_done, deadline
            if body_done:
                return await receive()
            try:
                with anyio.fail_after(max(0.0, deadline - time.monotonic())):
                    message = await receive()
            except TimeoutError:
                raise RequestTimeout(
                    f"The request body did not arrive within {self.seconds:g} s plus one "
                    f"second per {self.min_rate:g} bytes."
                ) from None
            deadline += len(message.get("body", b"")) / self.min_rate
            body_done = message["type"] != "http.request" or not message.get("more_body")
            return message

        await self.app(scope, receive_by_deadline, send)


async def limited_stream(request: Request, limit: int) -> AsyncGenerator[bytes, None]:
    """The body as it arrives, ``PayloadTooLarge`` as soon as it (or its Content-Length)
    passes ``limit`` bytes: for a multipart request parsed as it streams (files spill to
    disk), where ``read_limited`` would hold the whole body in memory."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"The request body exceeds {limit} bytes.")
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"The request body exceeds {limit} bytes.")
        yield chunk
