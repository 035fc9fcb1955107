"""The API's error hierarchy and its one mapping to HTTP.

Library layers (crud, inputs, urls, storage) raise these domain errors — never
``HTTPException``; ``install`` maps them, the pipeline's ``tasks.errors`` codes, request
validation errors and unexpected exceptions to ``{"error": {"code", "message"}}`` bodies.
"""

from __future__ import annotations

import logging
import math
from typing import Any, ClassVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from tasks import errors as pipeline_errors

log = logging.getLogger(__name__)


class ApiError(Exception):
    """Base of every error the API answers on purpose."""

    status_code: ClassVar[int] = 400
    code: ClassVar[str] = "bad_request"
    default_message: ClassVar[str] = "The request is invalid."

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
    status_code = 401
    code = "unauthorized"
    default_message = "Missing or invalid API key."

    def headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": "Bearer"}


class NotFound(ApiError):
    status_code = 404
    code = "not_found"
    default_message = "No such job."


class Forbidden(ApiError):
    status_code = 403
    code = "forbidden"
    default_message = "This API key may not do that."


class PriorityNotAllowed(Forbidden):
    code = "priority_not_allowed"
    default_message = (
        "This API key's priority class is normal: it cannot submit high-priority jobs."
    )


class ResultExpired(ApiError):
    status_code = 410
    code = "result_expired"
    default_message = "The result was deleted when its retention period ended."


class Conflict(ApiError):
    status_code = 409
    code = "conflict"


class IdempotencyKeyReused(Conflict):
    code = "idempotency_key_reused"
    default_message = "This Idempotency-Key was used with a different request."


class JobNotCancellable(Conflict):
    code = "job_not_cancellable"
    default_message = "The job has already finished."


class PayloadTooLarge(ApiError):
    status_code = 413
    code = "payload_too_large"
    default_message = "The request body is too large."


class RequestTimeout(ApiError):
    """The client did not send its whole body in time (``webapi.bodies``)."""

    status_code = 408
    code = "request_timeout"
    default_message = "The request body did not arrive in time."


class UnsupportedMediaType(ApiError):
    status_code = 415
    code = "unsupported_media_type"
    default_message = "Send application/json or multipart/form-data."


class InvalidRequest(ApiError):
    status_code = 422
    code = "invalid_request"


class JsonTooComplex(InvalidRequest):
    """A JSON body with too many keys and items, or nested too deep (``webapi.bodies``)."""

    code = "json_too_complex"
    default_message = "The JSON body has too many keys or levels."


class BlockedUrl(InvalidRequest):
    code = "blocked_url"
    default_message = "The URL is not allowed."


class QuotaExceeded(ApiError):
    status_code = 429
    code = "quota_exceeded"
    default_message = "Too many unfinished jobs for this API key."


class Overloaded(ApiError):
    status_code = 503
    code = "overloaded"
    default_message = "The service cannot finish more work within the queue timeout."


class InputsPurged(ApiError):
    """An input stored for this submit was deleted by a retention pass before the job was
    admitted (the same image, uploaded earlier by a job that has since expired). The
    route stores the input again and admits once more; a client only sees this (503)
    when that keeps happening."""

    status_code = 503
    code = "inputs_purged"
    default_message = "An input was removed by retention while the job was being admitted."


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
    return _response(422, "invalid_request", describe_validation(exc.errors()))


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


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return _response(500, "internal_error", "An unexpected error occurred.")


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
    app.add_exception_handler(Exception, _unexpected)
