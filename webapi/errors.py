"""The API's error hierarchy and its one mapping to HTTP.

Library layers (crud, inputs, urls, storage) raise these domain errors — never
``HTTPException``; ``install`` maps them, the pipeline's ``tasks.errors`` codes, request
validation errors and unexpected exceptions to ``{"error": {"code", "message"}}`` bodies.
"""

from __future__ import annotations

import logging
import math
from typing import Any, ClassVar, NamedTuple

import sqlalchemy as sa
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from tasks import errors as pipeline_errors
from tasks.error_codes import JobErrorCode

log = logging.getLogger(__name__)


class ApiError(Exception):
    """Base of every error the API answers on purpose; its status, code and default
    message come from ``API_ERRORS``."""

    status_code: ClassVar[int]
    code: ClassVar[str]
    default_message: ClassVar[str]

    def __init__(self, message: str | None = None, *, retry_after: float | None = None) -> None:
        self.message = message or self.default_message
        self.retry_after = retry_after
        super().__init__(self.message)

    def headers(self) -> dict[str, str]:
        """Extra response headers (``Retry-After`` in whole seconds, at least 1)."""
        if self.retry_after is None:
            return {}
        return {"Retry-After": str(max(1, math.ceil(self.retry_after)))}


class Unauthorized(ApiError):
    """No API key, or one that is unknown or disabled."""

    def headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": "Bearer"}


class NotFound(ApiError):
    """No such job (or not the caller's)."""


class Forbidden(ApiError):
    """The API key may not do this."""


class PriorityNotAllowed(Forbidden):
    """A high-priority submit from a key of the normal class."""


class ResultExpired(ApiError):
    """The result was deleted by retention."""


class Conflict(ApiError):
    """The request conflicts with the job's or the key's state."""


class IdempotencyKeyReused(Conflict):
    """An ``Idempotency-Key`` sent again with a different request."""


class JobNotCancellable(Conflict):
    """A cancel of a job that has already ended."""


class PayloadTooLarge(ApiError):
    """A body or an input over its limit."""


class RangeNotSatisfiable(ApiError):
    """A ``Range`` that lies outside the object (``webapi.ranges``)."""

    def __init__(self, size: int) -> None:
        super().__init__(f"The result has {size} bytes.")
        self.size = size

    def headers(self) -> dict[str, str]:
        return {"Content-Range": f"bytes */{self.size}"}


class RequestTimeout(ApiError):
    """The client did not send its whole body in time (``webapi.bodies``)."""


class UnsupportedMediaType(ApiError):
    """A body that is neither JSON nor a multipart form."""


class InvalidRequest(ApiError):
    """A request that is well-formed but not acceptable."""


class JsonTooComplex(InvalidRequest):
    """A JSON body with too many keys and items, or nested too deep (``webapi.bodies``)."""


class InvalidMapping(InvalidRequest):
    """``options.mapping`` does not fit the images given (``JobCreate.mapping_problem``)."""


class BlockedUrl(InvalidRequest):
    """A callback or input URL that the SSRF policy refuses (``webapi.urls``)."""


class QuotaExceeded(ApiError):
    """Too many unfinished jobs for this API key."""


class RateLimited(ApiError):
    """Too many requests of one kind from this API key (``Retry-After`` says when)."""


class Overloaded(ApiError):
    """The backlog cannot be finished within the queue timeout."""


class InputsPurged(ApiError):
    """An input stored for this submit was deleted by a retention pass before the job was
    admitted (the same image, uploaded earlier by a job that has since expired). The
    route stores the input again and admits once more; a client only sees this (503)
    when that keeps happening."""


STORE_RETRY_AFTER_S = 2.0
"""The ``Retry-After`` of a ``StoreUnavailable``: a database restart takes a few seconds."""


class StoreUnavailable(ApiError):
    """The job store cannot be reached right now (a database restart or failover: a
    connection-level error, ``store_unreachable``); the client retries after
    ``Retry-After``."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message, retry_after=STORE_RETRY_AFTER_S)


class HttpAnswer(NamedTuple):
    """How the API answers an error: the status, the body's code and its default message.

    A code a job can end with too (the fetch lane fails a job with the API's error for an
    empty or too large input) is its ``JobErrorCode``."""

    status: int
    code: str
    message: str = "The request is invalid."


#: The one mapping of the API's errors to HTTP.
API_ERRORS: dict[type[ApiError], HttpAnswer] = {
    ApiError: HttpAnswer(400, "bad_request"),
    Unauthorized: HttpAnswer(401, "unauthorized", "Missing or invalid API key."),
    NotFound: HttpAnswer(404, "not_found", "No such job."),
    Forbidden: HttpAnswer(403, "forbidden", "This API key may not do that."),
    PriorityNotAllowed: HttpAnswer(
        403,
        "priority_not_allowed",
        "This API key's priority class is normal: it cannot submit high-priority jobs.",
    ),
    ResultExpired: HttpAnswer(
        410, "result_expired", "The result was deleted when its retention period ended."
    ),
    Conflict: HttpAnswer(409, "conflict"),
    IdempotencyKeyReused: HttpAnswer(
        409, "idempotency_key_reused", "This Idempotency-Key was used with a different request."
    ),
    JobNotCancellable: HttpAnswer(409, "job_not_cancellable", "The job has already finished."),
    PayloadTooLarge: HttpAnswer(
        413, JobErrorCode.payload_too_large, "The request body is too large."
    ),
    RangeNotSatisfiable: HttpAnswer(
        416, "range_not_satisfiable", "The requested range lies outside the result."
    ),
    RequestTimeout: HttpAnswer(408, "request_timeout", "The request body did not arrive in time."),
    UnsupportedMediaType: HttpAnswer(
        415, "unsupported_media_type", "Send application/json or multipart/form-data."
    ),
    InvalidRequest: HttpAnswer(422, JobErrorCode.invalid_request),
    JsonTooComplex: HttpAnswer(
        422, "json_too_complex", "The JSON body has too many keys or levels."
    ),
    InvalidMapping: HttpAnswer(422, "invalid_mapping"),
    BlockedUrl: HttpAnswer(422, "blocked_url", "The URL is not allowed."),
    QuotaExceeded: HttpAnswer(429, "quota_exceeded", "Too many unfinished jobs for this API key."),
    RateLimited: HttpAnswer(429, "rate_limited", "Too many requests for this API key."),
    Overloaded: HttpAnswer(
        503, "overloaded", "The service cannot finish more work within the queue timeout."
    ),
    InputsPurged: HttpAnswer(
        503,
        "inputs_purged",
        "An input was removed by retention while the job was being admitted.",
    ),
    StoreUnavailable: HttpAnswer(
        503, "store_unavailable", "The job store is unreachable for a moment; retry shortly."
    ),
}


def _answer_with(answers: dict[type[ApiError], HttpAnswer]) -> None:
    """Give each error class its status, code and default message from ``answers``."""
    for error, answer in answers.items():
        error.status_code, error.code, error.default_message = answer


_answer_with(API_ERRORS)


#: Pipeline errors that can surface at submit (input validation) → HTTP status.
PIPELINE_STATUS: dict[type[pipeline_errors.FaceFlowError], int] = {
    pipeline_errors.ImageTooLarge: 413,
    pipeline_errors.VideoTooLarge: 413,
    pipeline_errors.UnsupportedFormat: 415,
    pipeline_errors.UnsupportedVideo: 415,
    pipeline_errors.InvalidInput: 422,
    pipeline_errors.PermanentError: 422,
    pipeline_errors.TransientError: 503,
}


def pipeline_status(exc: pipeline_errors.FaceFlowError) -> int:
    """The HTTP status of a pipeline error (most specific class wins)."""
    for cls in type(exc).__mro__:
        if cls in PIPELINE_STATUS:
            return PIPELINE_STATUS[cls]
    return 500


def error_body(code: str, message: str) -> dict[str, Any]:
    """The one error body shape."""
    return {"error": {"code": code, "message": message}}


def _response(
    status: int, code: str, message: str, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(error_body(code, message), status_code=status, headers=headers)


async def _api_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    return _response(exc.status_code, exc.code, exc.message, exc.headers())


async def _pipeline_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, pipeline_errors.FaceFlowError)
    return _response(pipeline_status(exc), exc.code, exc.public_message)


async def _validation_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return _response(422, JobErrorCode.invalid_request, describe_validation(exc.errors()))


async def _http_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    codes = {404: "not_found", 405: "method_not_allowed", 401: "unauthorized"}
    code = codes.get(exc.status_code, "http_error")
    return _response(exc.status_code, code, str(exc.detail), dict(exc.headers or {}))


async def _client_gone(request: Request, exc: Exception) -> JSONResponse:
    """A client that hung up mid-request: one line at info, not a traceback (nobody reads
    the answer)."""
    log.info("client disconnected during %s %s", request.method, request.url.path)
    return _response(400, "client_disconnected", "The client disconnected.")


def store_unreachable(exc: BaseException) -> bool:
    """Is ``exc`` the job store's connection failing (transient), not a bug in a statement?
    SQLAlchemy's ``OperationalError`` and ``InterfaceError``, any DBAPI error that
    invalidated its connection, or the connection pool's ``TimeoutError`` (every pooled
    connection busy for ``pool_timeout``: an overloaded store); an ``IntegrityError`` or
    ``ProgrammingError`` is not."""
    return isinstance(
        exc, sa.exc.OperationalError | sa.exc.InterfaceError | sa.exc.TimeoutError
    ) or (isinstance(exc, sa.exc.DBAPIError) and exc.connection_invalidated)


async def _store_error(request: Request, exc: Exception) -> JSONResponse:
    """A job store that cannot be reached: 503 ``store_unavailable`` and one warning line
    (no traceback); any other database error goes on to ``_unexpected`` (500)."""
    if not store_unreachable(exc):
        raise exc
    log.warning(
        "job store unreachable during %s %s: %s",
        request.method,
        request.url.path,
        type(getattr(exc, "orig", None) or exc).__name__,
    )
    return await _api_error(request, StoreUnavailable())


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return _response(500, JobErrorCode.internal_error, "An unexpected error occurred.")


def describe_validation(errors: Any) -> str:
    """A short human message from pydantic/FastAPI validation errors (no input echo)."""
    parts = []
    for error in list(errors)[:5]:
        where = ".".join(str(p) for p in error.get("loc", ()) if p not in ("body",))
        parts.append(f"{where}: {error.get('msg', 'invalid')}" if where else error.get("msg", ""))
    return "; ".join(parts) or "The request is invalid."


def install(app: FastAPI) -> None:
    """Register every handler on ``app``."""
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(pipeline_errors.FaceFlowError, _pipeline_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(ClientDisconnect, _client_gone)
    app.add_exception_handler(sa.exc.DBAPIError, _store_error)
    app.add_exception_handler(sa.exc.TimeoutError, _store_error)
    app.add_exception_handler(Exception, _unexpected)
