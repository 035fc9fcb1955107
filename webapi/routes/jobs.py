"""The /v1/jobs API: submit, read, list, cancel, download the result."""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import time
import uuid
from collections.abc import Sequence
from typing import Annotated, Any

import anyio.to_thread
from fastapi import APIRouter, Header, Query, Request, Response
from fastapi.responses import JSONResponse
from sqlalchemy.engine import Engine
from sqlmodel import Session
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile

from tasks.options import MAX_REFERENCES, MAX_SOURCES
from tasks.report import QualityReport
from webapi import crud
from webapi.admission import Admitter
from webapi.bodies import parse_json_model, read_limited
from webapi.config import Settings
from webapi.db import read_only
from webapi.deps import CurrentUser, EngineDep, ReadSessionDep, SessionDep, SettingsDep, StoreDep
from webapi.errors import (
    ApiError,
    BlockedUrl,
    InputsPurged,
    InvalidRequest,
    NotFound,
    PayloadTooLarge,
    ResultExpired,
    UnsupportedMediaType,
)
from webapi.inputs import InputRef, accept_input, job_pixels
from webapi.logs import log_context
from webapi.metrics import ApiMetrics
from webapi.models import (
    Job,
    JobCallback,
    JobCreate,
    JobError,
    JobPublic,
    JobResult,
    JobsPublic,
    JobStatus,
    JobUrls,
    User,
    WebhookDelivery,
    utcnow,
)
from webapi.storage import ObjectNotFound, ObjectStore
from webapi.urls import UrlPolicy

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1/jobs", tags=["jobs"])

#: Times a submit stores its inputs again when retention deleted one meanwhile.
PURGED_INPUT_RETRIES = 3
_WAIT = re.compile(r"(?:^|[,;\s])wait\s*=\s*(\d+)", re.IGNORECASE)
_ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"description": "Missing or invalid API key."},
    404: {"description": "No such job for this API key."},
}
SUBMIT_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "Idempotent replay: the job created earlier with this key."},
    401: _ERRORS[401],
    403: {"description": "priority 'high' asked by a key of the normal priority class."},
    409: {"description": "Idempotency-Key reused with a different request."},
    413: {
        "description": "A body or image too large, or images that decode to more pixels "
        "together than a job may hold (job_too_large)."
    },
    415: {"description": "Unsupported content type or image format."},
    422: {"description": "Invalid fields, image, or a blocked URL."},
    429: {"description": "Over the quota of unfinished jobs (Retry-After)."},
    503: {"description": "Backlog too long to start within the queue timeout (Retry-After)."},
}
SUBMIT_OPENAPI: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": {"$ref": "#/components/schemas/JobCreate"}},
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["source", "target"],
                    "properties": {
                        "source": {"type": "string", "format": "binary"},
                        "target": {"type": "string", "format": "binary"},
                        "params": {
                            "type": "string",
                            "description": "JobCreate as JSON, without source/target.",
                        },
                    },
                }
            },
        },
    }
}


def openapi_components() -> dict[str, Any]:
    """Schemas the hand-written submit request body refers to."""
    schema = JobCreate.model_json_schema(ref_template="#/components/schemas/{model}")
    defs = schema.pop("$defs", {})
    return {**defs, "JobCreate": schema}


# --------------------------------------------------------------------------- submit


@router.post(
    "",
    status_code=202,
    response_model=JobPublic,
    summary="Submit a fusion job",
    responses=SUBMIT_RESPONSES,
    openapi_extra=SUBMIT_OPENAPI,
)
async def create_job(
    request: Request,
    user: CurrentUser,
    settings: SettingsDep,
    engine: EngineDep,
    store: StoreDep,
    idempotency_key: Annotated[str | None, Header(min_length=1, max_length=255)] = None,
    prefer: Annotated[str | None, Header()] = None,
) -> JSONResponse:
    metrics: ApiMetrics = request.app.state.metrics
    started = time.perf_counter()
    try:
        create, sources, target, references = await _read_submission(request, settings)
        work = functools.partial(
            _prepare,
            store=store,
            settings=settings,
            user=user,
            create=create,
            raw_source=sources[0],
            raw_target=target,
            idempotency_key=idempotency_key,
            raw_extra_sources=sources[1:],
            raw_references=references,
        )
        admitter: Admitter = request.app.state.admitter
        for _ in range(PURGED_INPUT_RETRIES):
            # A few threads, not the shared pool: validating inputs is CPU work, and more
            # threads only contend for the GIL.
            submission = await anyio.to_thread.run_sync(
                work, limiter=request.app.state.submit_limiter
            )
            admitted = await asyncio.wrap_future(admitter.submit(submission))
            if not isinstance(admitted.admission.error, InputsPurged):
                break  # else retention deleted an input meanwhile: store it again
        if admitted.admission.error is not None:
            raise admitted.admission.error
        assert admitted.admission.job is not None
        created = admitted.admission.created
        public = to_public(
            admitted.admission.job,
            base_url=_base_url(request, settings),
            callbacks=admitted.callbacks,
        )
    except ApiError as exc:
        metrics.submit_latency.labels(outcome=str(exc.status_code)).observe(
            time.perf_counter() - started
        )
        raise
    status_code = 202 if created else 200
    with log_context(job=public.id, attempt_no=public.attempts):
        log.info("job %s (owner %s)", "accepted" if created else "replayed", user.id)
    if created:
        _wake_relay(request)
    metrics.submit_latency.labels(outcome=str(status_code)).observe(time.perf_counter() - started)
    headers = {"Location": public.urls.self}
    wait_s = min(_wait_seconds(prefer), settings.max_wait_seconds)
    if wait_s > 0:
        public = await _wait_for(request, engine, settings, user, public, wait_s)
        headers["Preference-Applied"] = f"wait={wait_s}"
    return JSONResponse(public.model_dump(mode="json"), status_code=status_code, headers=headers)


def _prepare(
    *,
    store: ObjectStore,
    settings: Settings,
    user: User,
    create: JobCreate,
    raw_source: str | bytes,
    raw_target: str | bytes,
    idempotency_key: str | None,
    raw_extra_sources: Sequence[str | bytes] = (),
    raw_references: Sequence[str | bytes] = (),
) -> crud.Submission:
    """Check the callback URL, validate and store the inputs: a submission to admit, whose
    images decode to at most the per-job pixel budget together (an input given as a URL
    counts at the per-image limit until the relay has fetched it).

    A per-face mapping's extra sources and references must be given inline (data: URIs or
    files): only the first source and the target may be URLs the relay fetches."""
    prepared_at = utcnow()  # before any input is found already stored
    urls = UrlPolicy.from_settings(settings)
    if create.callback_url is not None:
        try:
            urls.check(str(create.callback_url))
        except BlockedUrl as exc:
            raise BlockedUrl(f"callback_url: {exc.message}") from exc
    common = {"limits": settings.image_limits, "store": store, "urls": urls}
    source = accept_input(raw_source, name="source", **common)  # type: ignore[arg-type]
    target = accept_input(raw_target, name="target", **common)  # type: ignore[arg-type]
    extras = [
        _inline(accept_input(raw, name=f"sources[{i + 1}]", **common))  # type: ignore[arg-type]
        for i, raw in enumerate(raw_extra_sources)
    ]
    references = [
        _inline(accept_input(raw, name=f"references[{i}]", **common))  # type: ignore[arg-type]
        for i, raw in enumerate(raw_references)
    ]
    submission = crud.Submission(
        user,
        create,
        source,
        target,
        idempotency_key,
        extra_sources=tuple(extras),
        references=tuple(references),
        prepared_at=prepared_at,
    )
    limits = settings.image_limits
    limits.check_job_pixels(job_pixels(submission.inputs, limits))  # 413 job_too_large
    return submission


def _inline(ref: InputRef) -> InputRef:
    if ref.key is None:
        raise InvalidRequest(
            f"{ref.name}: give it as a data: URI or a file; only source and target may be URLs."
        )
    return ref


async def _read_submission(
    request: Request, settings: Settings
) -> tuple[JobCreate, list[str | bytes], str | bytes, list[str | bytes]]:
    """The request's options, its sources (one, or several for a mapping), its target and
    its reference images."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    is_json = content_type == "application/json" or content_type.endswith("+json")
    if not is_json and content_type != "multipart/form-data":
        raise UnsupportedMediaType()
    limit = settings.max_json_bytes if is_json else settings.max_request_bytes
    body = await read_limited(request, limit)
    sources: list[str | bytes]
    references: list[str | bytes]
    target: str | bytes | None
    if is_json:  # parsed in a worker thread: the event loop keeps serving meanwhile
        create = await anyio.to_thread.run_sync(
            _parse_create, body, settings, limiter=request.app.state.submit_limiter
        )
        sources = list(create.sources or ([create.source] if create.source is not None else []))
        target, references = create.target, list(create.references or [])
    else:
        create, sources, target, references = await _read_multipart(request, settings)
    if not sources or target is None:
        missing = " and ".join(n for n, v in (("source", sources), ("target", target)) if not v)
        raise InvalidRequest(f"{missing}: required.")
    problem = create.mapping_problem(len(sources), len(references))
    if problem is not None:
        raise InvalidRequest(problem)
    return create, sources, target, references


def _parse_create(raw: bytes | str, settings: Settings) -> JobCreate:
    return parse_json_model(
        JobCreate, raw, max_items=settings.json_max_items, max_depth=settings.json_max_depth
    )


async def _read_multipart(
    request: Request, settings: Settings
) -> tuple[JobCreate, list[str | bytes], str | bytes | None, list[str | bytes]]:
    """``params`` (JSON) and the files: ``source`` (repeat it for several sources, in
    order), ``target`` and ``reference`` (repeatable)."""
    most = MAX_SOURCES + MAX_REFERENCES + 1
    async with request.form(max_files=most, max_fields=most + 1, max_part_size=1024 * 1024) as form:
        field = form.get("params")
        params = (await field.read()) if isinstance(field, UploadFile) else field
        create = _parse_create(params or "{}", settings)
        if any(v is not None for v in (create.source, create.sources, create.target)) or (
            create.references is not None
        ):
            raise InvalidRequest("params: give the images as multipart files.")
        parts: dict[str, list[str | bytes]] = {}
        for name in ("source", "target", "reference"):
            parts[name] = []
            for part in form.getlist(name):
                if isinstance(part, UploadFile):
                    data = await part.read(settings.image_limits.max_bytes + 1)
                    if len(data) > settings.image_limits.max_bytes:
                        raise PayloadTooLarge(f"{name}: the image exceeds the size limit.")
                    parts[name].append(data)
                else:
                    parts[name].append(part)
    if len(parts["source"]) > MAX_SOURCES or len(parts["reference"]) > MAX_REFERENCES:
        raise InvalidRequest(
            f"At most {MAX_SOURCES} source and {MAX_REFERENCES} reference images per job."
        )
    if len(parts["target"]) > 1:
        raise InvalidRequest("target: give one target image.")
    target = parts["target"][0] if parts["target"] else None
    return create, parts["source"], target, parts["reference"]


def _wake_relay(request: Request) -> None:
    """Nudge an in-process relay to dispatch now instead of at its next tick."""
    wake = getattr(getattr(request.app.state, "relay", None), "wake", None)
    if callable(wake):
        wake()


def _wait_seconds(prefer: str | None) -> int:
    match = _WAIT.search(prefer or "")
    return int(match.group(1)) if match else 0


async def _wait_for(
    request: Request,
    engine: Engine,
    settings: Settings,
    user: User,
    public: JobPublic,
    wait_s: int,
) -> JobPublic:
    """Poll the job store until the job is terminal or ``wait_s`` pass (never an error)."""
    deadline = time.monotonic() + wait_s
    status: JobStatus | None = public.status
    while status is not None and not status.is_terminal and time.monotonic() < deadline:
        if await request.is_disconnected():
            break
        await asyncio.sleep(min(settings.wait_poll_seconds, max(0.0, deadline - time.monotonic())))
        status = await run_in_threadpool(_poll_status, engine, public.id)
    if status == public.status:
        return public
    return await run_in_threadpool(
        _read_public, engine, user, public.id, _base_url(request, settings)
    )


def _poll_status(engine: Engine, job_id: uuid.UUID) -> JobStatus | None:
    with Session(read_only(engine)) as session:
        return crud.job_status(session, job_id=job_id)


def _read_public(engine: Engine, user: User, job_id: uuid.UUID, base_url: str) -> JobPublic:
    with Session(read_only(engine), expire_on_commit=False) as session:
        job = crud.get_job(session, owner=user, job_id=job_id)
        callbacks = crud.callbacks_for(session, job_ids=[job.id])
        return to_public(job, base_url=base_url, callbacks=callbacks.get(job.id, []))


# --------------------------------------------------------------------------- read, list


@router.get("/{job_id}", summary="Read a job", responses=_ERRORS)
def read_job(
    request: Request,
    session: ReadSessionDep,
    user: CurrentUser,
    settings: SettingsDep,
    job_id: uuid.UUID,
) -> JobPublic:
    job = crud.get_job(session, owner=user, job_id=job_id)
    callbacks = crud.callbacks_for(session, job_ids=[job.id])
    return to_public(
        job, base_url=_base_url(request, settings), callbacks=callbacks.get(job.id, [])
    )


@router.get("", summary="List the caller's jobs, newest first", responses={401: _ERRORS[401]})
def list_jobs(
    request: Request,
    session: ReadSessionDep,
    user: CurrentUser,
    settings: SettingsDep,
    status: Annotated[JobStatus | None, Query()] = None,
    limit: Annotated[int, Query(ge=1, le=crud.MAX_PAGE)] = 20,
    cursor: Annotated[str | None, Query(max_length=200)] = None,
) -> JobsPublic:
    jobs, next_cursor = crud.list_jobs(
        session, owner=user, status=status, limit=limit, cursor=cursor
    )
    callbacks = crud.callbacks_for(session, job_ids=[job.id for job in jobs])
    base_url = _base_url(request, settings)
    return JobsPublic(
        data=[
            to_public(job, base_url=base_url, callbacks=callbacks.get(job.id, [])) for job in jobs
        ],
        next_cursor=next_cursor,
    )


# --------------------------------------------------------------------------- cancel, result


@router.post(
    "/{job_id}/cancel",
    summary="Cancel a job",
    response_model=JobPublic,
    responses={
        **_ERRORS,
        202: {"description": "Running: cancellation requested."},
        409: {"description": "The job has already finished."},
    },
)
def cancel_job(
    request: Request,
    session: SessionDep,
    user: CurrentUser,
    settings: SettingsDep,
    job_id: uuid.UUID,
) -> JSONResponse:
    job = crud.cancel_job(session, owner=user, job_id=job_id)
    callbacks = crud.callbacks_for(session, job_ids=[job.id])
    public = to_public(
        job, base_url=_base_url(request, settings), callbacks=callbacks.get(job.id, [])
    )
    status_code = 202 if job.status is JobStatus.cancel_requested else 200
    return JSONResponse(public.model_dump(mode="json"), status_code=status_code)


@router.get(
    "/{job_id}/result",
    summary="Download the result image",
    response_class=Response,
    responses={
        **_ERRORS,
        200: {"content": {"image/png": {}, "image/jpeg": {}, "image/webp": {}}},
        410: {"description": "The result was deleted: its retention period is over."},
    },
)
def read_result(
    session: ReadSessionDep, user: CurrentUser, store: StoreDep, job_id: uuid.UUID
) -> Response:
    job = crud.get_job(session, owner=user, job_id=job_id)
    session.commit()
    if job.result_expired_at is not None:
        raise ResultExpired(
            f"The result was deleted at {job.result_expired_at.isoformat()}, when its "
            f"retention period of {job.result_retention_s} s after the job ended was over."
        )
    if job.status is not JobStatus.succeeded or not job.result_key:
        raise NotFound(f"The job has no result (it is {job.status.value}).")
    try:
        data = store.get(job.result_key)
    except ObjectNotFound as exc:
        with log_context(job=job.id, attempt_no=job.attempts):
            log.error("result object missing: %s", job.result_key)
        raise NotFound("The result is no longer available.") from exc
    filename = f"{job.id}.{job.result_key.rsplit('.', 1)[-1]}"
    return Response(
        data,
        media_type=job.result_content_type or "application/octet-stream",
        headers={"Content-Disposition": f'inline; filename="{filename}"'},
    )


# --------------------------------------------------------------------------- presenting


def to_public(job: Job, *, base_url: str, callbacks: Sequence[WebhookDelivery] = ()) -> JobPublic:
    """The API view of a job (absolute URLs under ``base_url``)."""
    self_url = f"{base_url}/v1/jobs/{job.id}"
    result = None
    expired = job.result_expired_at is not None
    if job.status is JobStatus.succeeded and job.result_key and not expired:
        result = JobResult(
            url=f"{self_url}/result",
            content_type=job.result_content_type or "application/octet-stream",
            width=job.result_width or 0,
            height=job.result_height or 0,
        )
    error = None
    if job.error_code:
        error = JobError(code=job.error_code, message=job.error_message or job.error_code)
    return JobPublic(
        id=job.id,
        status=job.status,
        stage=job.stage,
        attempts=job.attempts,
        priority=job.priority,
        options=job.fusion_options,
        created_at=job.created_at,
        queue_deadline_at=job.queue_deadline_at,
        deadline_at=job.deadline_at,
        started_at=job.started_at,
        finished_at=job.finished_at,
        error=error,
        result=result,
        result_expires_at=job.result_purge_at if job.result_key and not expired else None,
        result_expired=expired,
        timings=job.timings or {},
        quality=QualityReport.model_validate(job.quality) if job.quality else None,
        urls=JobUrls(self=self_url, cancel=f"{self_url}/cancel", result=f"{self_url}/result"),
        callback_url=job.callback_url,
        callback_events=job.callback_events or [],
        callbacks=[
            JobCallback(
                event=d.event,
                webhook_id=d.webhook_id,
                attempt=d.attempt,
                at=d.at,
                status_code=d.status_code,
                outcome=d.outcome,
                error=d.error,
            )
            for d in callbacks
        ],
    )


def _base_url(request: Request, settings: Settings) -> str:
    return (settings.public_base_url or str(request.base_url)).rstrip("/")
