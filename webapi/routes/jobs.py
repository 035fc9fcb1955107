"""The /v1/jobs API: submit, read, list, cancel, download the result."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import IO, Annotated, Any

import anyio.to_thread
from fastapi import APIRouter, Header, Query, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from sqlalchemy.engine import Engine
from sqlmodel import Session
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import FormData, UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser

from flows.params import JobProgress
from tasks.options import MAX_REFERENCES, MAX_SOURCES
from tasks.report import QualityReport
from webapi import crud
from webapi.bodies import limited_stream, parse_json_model, read_limited
from webapi.config import Settings
from webapi.db import read_only
from webapi.deps import CurrentUser, EngineDep, ReadSessionDep, SessionDep, SettingsDep, StoreDep
from webapi.errors import (
    ApiError,
    BlockedUrl,
    InputsPurged,
    InvalidMapping,
    InvalidRequest,
    NotFound,
    PayloadTooLarge,
    ResultExpired,
    UnsupportedMediaType,
)
from webapi.group_commit import Admitted, GroupCommit
from webapi.inputs import InputRef, accept_input, job_pixels
from webapi.job_ends import JOB_ENDS
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
    VideoInputPublic,
    VideoReportPublic,
    WebhookDelivery,
    utcnow,
)
from webapi.ranges import byte_range
from webapi.storage import ObjectNotFound, ObjectStore
from webapi.urls import UrlPolicy

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1/jobs", tags=["jobs"])

#: One input as the request gave it: a data: URI or URL, a file's bytes, or a spooled file
#: (a multipart target, which may be a video).
RawInput = str | bytes | IO[bytes]
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
    422: {
        "description": "Invalid fields, image or video, a blocked URL, or an options.mapping "
        "that does not fit the images given (invalid_mapping)."
    },
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
        async with _submission(request, settings) as (create, sources, target, references):
            admitted = await _admit(
                request,
                store=store,
                settings=settings,
                user=user,
                create=create,
                sources=sources,
                target=target,
                references=references,
                idempotency_key=idempotency_key,
            )
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
    if created:  # its job waits for the fetch lane or for dispatch (a submit sends no webhook)
        _wake_relay(request, "fetch" if admitted.admission.job.awaits_fetch else "dispatch")
    metrics.submit_latency.labels(outcome=str(status_code)).observe(time.perf_counter() - started)
    headers = {"Location": public.urls.self}
    wait_s = min(_wait_seconds(prefer), settings.max_wait_seconds)
    if wait_s > 0:
        public = await _wait_for(request, engine, settings, user, public, wait_s)
        headers["Preference-Applied"] = f"wait={wait_s}"
    return JSONResponse(public.model_dump(mode="json"), status_code=status_code, headers=headers)


async def _admit(
    request: Request,
    *,
    store: ObjectStore,
    settings: Settings,
    user: User,
    create: JobCreate,
    sources: list[RawInput],
    target: RawInput,
    references: list[RawInput],
    idempotency_key: str | None,
) -> Admitted:
    """Validate and store the inputs in a worker thread, then admit the submission (group
    commit); an input retention deleted meanwhile is stored again."""
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
    group_commit: GroupCommit = request.app.state.group_commit
    for _ in range(PURGED_INPUT_RETRIES):
        # A few threads, not the shared pool: validating inputs is CPU work, and more
        # threads only contend for the GIL.
        submission = await anyio.to_thread.run_sync(work, limiter=request.app.state.submit_limiter)
        admitted = await asyncio.wrap_future(group_commit.submit(submission))
        if not isinstance(admitted.admission.error, InputsPurged):
            break  # else retention deleted an input meanwhile: store it again
        _rewind(target)
    if admitted.admission.error is not None:
        raise admitted.admission.error
    return admitted


def _rewind(raw: RawInput) -> None:
    """Read a multipart file again from its start (to store it again)."""
    if not isinstance(raw, str | bytes):
        raw.seek(0)


def _prepare(
    *,
    store: ObjectStore,
    settings: Settings,
    user: User,
    create: JobCreate,
    raw_source: RawInput,
    raw_target: RawInput,
    idempotency_key: str | None,
    raw_extra_sources: Sequence[RawInput] = (),
    raw_references: Sequence[RawInput] = (),
) -> crud.Submission:
    """Check the callback URL, validate and store the inputs: a submission to admit, whose
    images decode to at most the per-job pixel budget together (an input given as a URL
    counts at the per-image limit until the relay has fetched it).

    A per-face mapping's extra sources and references must be given inline (data: URIs or
    files): only the first source and the target may be URLs the relay fetches. The target
    may be a video (probed against the video limits), with a mapping as for a photo
    (docs/video.md: a target number counts the faces of the key frame)."""
    prepared_at = utcnow()  # before any input is found already stored
    urls = UrlPolicy.from_settings(settings)
    if create.callback_url is not None:
        try:
            urls.check(str(create.callback_url))
        except BlockedUrl as exc:
            raise BlockedUrl(f"callback_url: {exc.message}") from exc
    common = {"limits": settings.image_limits, "store": store, "urls": urls}
    source = accept_input(raw_source, name="source", **common)  # type: ignore[arg-type]
    target = accept_input(
        raw_target,
        name="target",
        video_limits=settings.video_limits,
        **common,  # type: ignore[arg-type]
    )
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


@contextlib.asynccontextmanager
async def _submission(
    request: Request, settings: Settings
) -> AsyncIterator[tuple[JobCreate, list[RawInput], RawInput, list[RawInput]]]:
    """The request's options, its sources (one, or several for a mapping), its target and
    its reference images; multipart files stay spooled (on disk past 1 MiB) until the
    block ends."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    is_json = content_type == "application/json" or content_type.endswith("+json")
    if not is_json and content_type != "multipart/form-data":
        raise UnsupportedMediaType()
    sources: list[RawInput]
    references: list[RawInput]
    target: RawInput | None
    form: FormData | None = None
    try:
        if is_json:  # parsed in a worker thread: the event loop keeps serving meanwhile
            body = await read_limited(request, settings.max_json_bytes)
            create = await anyio.to_thread.run_sync(
                _parse_create, body, settings, limiter=request.app.state.submit_limiter
            )
            sources = list(create.sources or ([create.source] if create.source is not None else []))
            target, references = create.target, list(create.references or [])
        else:
            form = await _parse_multipart(request, settings)
            create, sources, target, references = await _read_multipart(form, settings)
        if not sources or target is None:
            missing = " and ".join(n for n, v in (("source", sources), ("target", target)) if not v)
            raise InvalidRequest(f"{missing}: required.")
        problem = create.mapping_problem(len(sources), len(references))
        if problem is not None:
            raise InvalidMapping(problem)
        yield create, sources, target, references
    finally:
        if form is not None:
            await form.close()


def _parse_create(raw: bytes | str, settings: Settings) -> JobCreate:
    return parse_json_model(
        JobCreate, raw, max_items=settings.json_max_items, max_depth=settings.json_max_depth
    )


async def _parse_multipart(request: Request, settings: Settings) -> FormData:
    """The multipart body parsed as it streams in (``limited_stream``: at most
    ``max_request_bytes`` plus a video's bytes); its files spill to disk past 1 MiB."""
    most = MAX_SOURCES + MAX_REFERENCES + 1
    limit = settings.max_request_bytes + settings.video_limits.max_bytes
    parser = MultiPartParser(
        request.headers,
        limited_stream(request, limit),
        max_files=most,
        max_fields=most + 1,
        max_part_size=1024 * 1024,
    )
    try:
        return await parser.parse()
    except MultiPartException as exc:
        raise InvalidRequest(f"The multipart body is malformed: {exc.message}") from exc


async def _read_multipart(
    form: FormData, settings: Settings
) -> tuple[JobCreate, list[RawInput], RawInput | None, list[RawInput]]:
    """``params`` (JSON) and the files: ``source`` (repeat it for several sources, in
    order), ``target`` (a photo or a video, left spooled) and ``reference`` (repeatable)."""
    field = form.get("params")
    params = (await field.read()) if isinstance(field, UploadFile) else field
    create = _parse_create(params or "{}", settings)
    if any(v is not None for v in (create.source, create.sources, create.target)) or (
        create.references is not None
    ):
        raise InvalidRequest("params: give the images as multipart files.")
    parts: dict[str, list[RawInput]] = {}
    for name in ("source", "target", "reference"):
        parts[name] = []
        for part in form.getlist(name):
            if isinstance(part, UploadFile) and name == "target":
                parts[name].append(part.file)  # a video streams on from here
            elif isinstance(part, UploadFile):
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
        raise InvalidRequest("target: give one target image or video.")
    target = parts["target"][0] if parts["target"] else None
    return create, parts["source"], target, parts["reference"]


def _wake_relay(request: Request, *loops: str) -> None:
    """Nudge an in-process relay's ``loops`` (default: fetch, dispatch, notify) to run now
    instead of at their next tick."""
    wake = getattr(getattr(request.app.state, "relay", None), "wake", None)
    if callable(wake):
        wake(*loops)


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
    """Wait until the job is terminal or ``wait_s`` pass (never an error): woken when its
    end commits (``webapi.job_ends``), reading the job store every ``wait_poll_seconds``
    as the safety net."""
    deadline = time.monotonic() + wait_s
    status: JobStatus | None = public.status
    while status is not None and not status.is_terminal and time.monotonic() < deadline:
        if await request.is_disconnected():
            break
        left = max(0.0, deadline - time.monotonic())
        await JOB_ENDS.wait(public.id, min(settings.wait_poll_seconds, left))
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
        return _public_one(session, crud.get_job(session, owner=user, job_id=job_id), base_url)


def _public_one(session: Session, job: Job, base_url: str) -> JobPublic:
    """The public view of one job, with its webhook deliveries."""
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
    return _public_one(session, job, _base_url(request, settings))


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
    public = _public_one(session, job, _base_url(request, settings))
    if job.status in (JobStatus.cancel_requested, JobStatus.cancelled):
        _wake_relay(request, "reap")  # its cancel_run row, if any: the run is cancelled now
    status_code = 202 if job.status is JobStatus.cancel_requested else 200
    return JSONResponse(public.model_dump(mode="json"), status_code=status_code)


@router.get(
    "/{job_id}/result",
    summary="Download the result image or video",
    response_class=Response,
    responses={
        **_ERRORS,
        200: {"content": {"image/png": {}, "image/jpeg": {}, "image/webp": {}, "video/mp4": {}}},
        206: {"description": "The byte range asked for with Range (players seek with it)."},
        410: {"description": "The result was deleted: its retention period is over."},
        416: {"description": "The Range lies outside the result."},
    },
)
def read_result(
    session: ReadSessionDep,
    user: CurrentUser,
    store: StoreDep,
    job_id: uuid.UUID,
    range_header: Annotated[str | None, Header(alias="range")] = None,
) -> Response:
    """The result, streamed from storage; ``Range: bytes=a-b`` (one range) answers 206."""
    job = crud.get_job(session, owner=user, job_id=job_id)
    session.commit()
    if job.result_expired_at is not None:
        raise ResultExpired(
            f"The result was deleted at {job.result_expired_at.isoformat()}, when its "
            f"retention period of {job.result_retention_s} s after the job ended was over."
        )
    if job.status is not JobStatus.succeeded or not job.result_key:
        raise NotFound(f"The job has no result (it is {job.status.value}).")
    key = job.result_key
    try:
        size = store.size(key)
        wanted = byte_range(range_header, size)
        start, end = wanted or (0, size - 1)
        pieces = store.read_range(key, start, end) if size else iter(())
    except ObjectNotFound as exc:
        with log_context(job=job.id, attempt_no=job.attempts):
            log.error("result object missing: %s", key)
        raise NotFound("The result is no longer available.") from exc
    headers = {
        "Content-Disposition": f'inline; filename="{job.id}.{key.rsplit(".", 1)[-1]}"',
        "Accept-Ranges": "bytes",
        "Content-Length": str(end - start + 1 if size else 0),
        "ETag": f'"{key.rsplit("/", 1)[-1]}-{size}"',
    }
    if wanted is not None:
        headers["Content-Range"] = f"bytes {start}-{end}/{size}"
    return StreamingResponse(
        pieces,
        status_code=206 if wanted is not None else 200,
        media_type=job.result_content_type or "application/octet-stream",
        headers=headers,
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
        media=job.media,
        progress=JobProgress.model_validate(job.progress) if job.progress else None,
        video=VideoInputPublic.model_validate(job.video_input) if job.video_input else None,
        video_report=(
            VideoReportPublic.model_validate(job.video_report) if job.video_report else None
        ),
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
        callbacks=[JobCallback.model_validate(d, from_attributes=True) for d in callbacks],
    )


def _base_url(request: Request, settings: Settings) -> str:
    return (settings.public_base_url or str(request.base_url)).rstrip("/")
