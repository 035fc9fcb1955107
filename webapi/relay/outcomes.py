"""Job outcomes written by the relay: what ``sync`` and ``reap`` both build on.

``observe`` reads the non-terminal jobs holding a flow run together with their runs (one
batched call); ``settle`` applies the outcome the flow stored for a job's current attempt
(its ``ResultRef``: succeeded; its ``JobFailure``: failed, or re-dispatched when
retryable), ``settle_all`` the outcomes of many jobs (a batch run's) in one transaction;
``retry_or_fail`` fences off a job's run and re-dispatches the job or fails it
(``worker_lost``, ``deadline_exceeded``). Every write is conditional on the job's current
``flow_run_id`` (``jobstate.transition``): a stale run never writes. Counted in
``faceflow_relay_transitions_total`` and ``faceflow_relay_reaped_total``.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Collection, Sequence
from dataclasses import dataclass, fields
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from pydantic import ValidationError
from sqlmodel import Session, col, select

from flows.params import (
    FINAL_STAGE,
    JobFailure,
    ResultRef,
    VideoResultRef,
    result_error_key,
    result_meta_key,
)
from tasks import errors as pipeline_errors
from tasks.error_codes import JobErrorCode
from tasks.errors import DeadlineExceeded
from webapi.jobstate import transition
from webapi.models import ACTIVE_STATUSES, Job, JobStatus, Outbox, OutboxKind, UTCDateTime, utcnow
from webapi.prefect_api import FlowRun, PrefectUnavailable
from webapi.relay.context import Relay
from webapi.storage import ObjectNotFound, StorageError

log = logging.getLogger(__name__)

WATCH_LIMIT = 5000
TRANSITIONS = "faceflow_relay_transitions_total"
REAPED = "faceflow_relay_reaped_total"
ENDED_FROM = frozenset({JobStatus.queued, JobStatus.running, JobStatus.cancel_requested})
#: Safe messages of the codes the relay fails a job with when its run is gone or late.
MESSAGES: dict[JobErrorCode, str] = {
    JobErrorCode.worker_lost: "The worker running the job was lost.",
    JobErrorCode.deadline_exceeded: DeadlineExceeded.default_message,
}


@dataclass(frozen=True)
class Watched:
    """A non-terminal job with a flow run, as the relay needs it."""

    job_id: uuid.UUID
    flow_run_id: uuid.UUID
    status: JobStatus
    stage: str | None
    attempts: int
    max_attempts: int
    deadline_at: datetime
    started_at: datetime | None
    cancel_requested_at: datetime | None
    media: str = "photo"
    progress: dict[str, Any] | None = None

    @classmethod
    def of(cls, job: Job) -> Watched:
        """``job`` as the relay watches it: ``job_id`` is its ``id``, every other field its
        field of the same name (a job with a flow run)."""
        same = {f.name: getattr(job, f.name) for f in fields(cls) if f.name != "job_id"}
        return cls(job_id=job.id, **same)


def watched_jobs(
    relay: Relay, *, limit: int = WATCH_LIMIT, runs: Collection[str] | None = None
) -> list[Watched]:
    """Non-terminal jobs holding a flow run (one of ``runs`` when given), oldest update
    first."""
    held = (
        col(Job.flow_run_id).is_not(None)
        if runs is None
        else col(Job.flow_run_id).in_([uuid.UUID(run) for run in runs])
    )
    query = (
        select(Job)
        .where(col(Job.status).in_(list(ACTIVE_STATUSES)), held)
        .order_by(col(Job.updated_at))
        .limit(limit)
    )
    with relay.session() as session:
        jobs = session.exec(query).all()
        watched = [Watched.of(job) for job in jobs if job.flow_run_id is not None]
        session.commit()
    return watched


def observe(
    relay: Relay, watched: list[Watched] | None = None
) -> list[tuple[Watched, FlowRun | None]] | None:
    """Each watched job (``watched``, default: ``watched_jobs``) with its flow run (None:
    unknown to Prefect); None if unreachable."""
    watched = watched_jobs(relay) if watched is None else watched
    if not watched:
        return []
    try:
        runs = relay.prefect.read_flow_runs(str(job.flow_run_id) for job in watched)
    except PrefectUnavailable as exc:
        log.debug("sync skipped: Prefect unavailable", extra={"error": str(exc)})
        return None
    return [(job, runs.get(str(job.flow_run_id))) for job in watched]


def _error_classes(base: type[pipeline_errors.FaceFlowError]) -> list[type[Any]]:
    found: list[type[Any]] = [base]
    for sub in base.__subclasses__():
        found += _error_classes(sub)
    return found


#: Safe messages per pipeline error code (the flow's own text may carry internal detail).
PUBLIC_MESSAGES: dict[JobErrorCode, str] = {
    cls.code: cls.default_message for cls in _error_classes(pipeline_errors.FaceFlowError)
}


@dataclass(frozen=True)
class Ending:
    """What the outcome a flow stored asks of its job: move it to ``to`` with ``fields``
    (from the statuses ``ENDED_FROM``), or, with ``retry`` (a retryable failure's code and
    message), re-dispatch it while attempts and time remain (``retry_or_fail``)."""

    to: JobStatus
    fields: dict[str, Any]
    retry: tuple[JobErrorCode, str] | None = None


def settle(relay: Relay, job: Watched, run: FlowRun | None) -> bool | None:
    """Apply the outcome the flow stored for ``job``'s current attempt: its ``ResultRef``
    (succeeded) or its ``JobFailure`` (failed; a retryable failure is re-dispatched while
    attempts and time remain). Returns whether the job changed, or None when the attempt
    stored neither (False, to try again, when storage is down)."""
    return settle_all(relay, [(job, run)])[0]


def settle_all(relay: Relay, jobs: Sequence[tuple[Watched, FlowRun | None]]) -> list[bool | None]:
    """``settle`` for each of ``jobs`` (a batch run's, say): every stored outcome is read
    first, then written in one transaction (``_write_endings``); a job whose guard fails
    (cancelled meanwhile, re-dispatched) is skipped, the others settle. One result per job,
    as ``settle``'s."""
    read = [stored_outcome(relay, job, run) for job, run in jobs]
    written = _write_endings(
        relay,
        [
            (job, run, ending)
            for (job, run), ending in zip(jobs, read, strict=True)
            if isinstance(ending, Ending)
        ],
    )
    return [
        written[job.job_id] is not None if isinstance(outcome, Ending) else outcome
        for (job, _run), outcome in zip(jobs, read, strict=True)
    ]


def _write_endings(
    relay: Relay, due: Sequence[tuple[Watched, FlowRun | None, Ending]]
) -> dict[uuid.UUID, str | None]:
    """Write each job's ``Ending`` in one transaction, each fenced on its job's run as
    alone, in job-id order (one lock order for every writer); then count and log what was
    written. Per job: what ``_apply`` did, None where its guard failed."""
    if not due:
        return {}
    ordered = sorted(due, key=lambda one: one[0].job_id)
    cost_s = relay.expected_cost_s() if any(end.retry for _j, _r, end in ordered) else 0.0
    now = utcnow()
    with relay.session() as session:
        written = {
            job.job_id: _apply(session, job, run, ending, now=now, cost_s=cost_s)
            for job, run, ending in ordered
        }
        session.commit()
    for job, _run, ending in ordered:
        _report(relay, job, ending, written[job.job_id])
    return written


def stored_outcome(relay: Relay, job: Watched, run: FlowRun | None) -> Ending | bool | None:
    """What the outcome the flow stored for ``job``'s current attempt asks (read from
    storage, nothing written); None when the attempt stored neither, False when storage
    is down (to try again)."""
    key = result_meta_key(str(job.job_id), job.attempts)
    try:
        raw = relay.store.get(key)
        ref = ResultRef.model_validate_json(raw)
        video = _video_fields(raw) if ref.content_type.startswith("video/") else {}
    except ObjectNotFound:
        return _failed(relay, job)
    except ValidationError:
        return Ending(
            JobStatus.failed,
            {
                "error_code": JobErrorCode.result_invalid,
                "error_message": "The job finished but its result could not be read.",
            },
        )
    except StorageError as exc:  # storage unreachable: try again next pass
        log.warning("result not readable yet", extra={"job_id": str(job.job_id), "error": str(exc)})
        return False
    started = run.start_time if run is not None else None
    return Ending(
        JobStatus.succeeded,
        {
            "started_at": sa.func.coalesce(
                Job.started_at, sa.literal(started or utcnow(), UTCDateTime)
            ),
            "stage": FINAL_STAGE,
            "result_key": ref.key,
            "result_content_type": ref.content_type,
            "result_width": ref.width,
            "result_height": ref.height,
            "timings": ref.timings_ms,
            "quality": ref.quality.as_json() if ref.quality is not None else None,
            "error_code": None,
            "error_message": None,
            **video,
        },
    )


def _video_fields(raw: bytes) -> dict[str, Any]:
    """A video result's report and final progress, from its ``VideoResultRef``."""
    ref = VideoResultRef.model_validate_json(raw)
    report = ref.model_dump(
        mode="json",
        include={
            "frames",
            "duration_s",
            "chunks",
            "chunks_rendered",
            "cuts",
            "switches",
            "tracks",
            "frame_failures",
            "moderation",
            "marks",
        },
    )
    progress = {
        "frames_analysed": ref.frames,
        "frames_done": ref.frames,
        "frames_total": ref.frames,
        "chunks_done": ref.chunks,
        "chunks_total": ref.chunks,
        "eta_seconds": 0.0,
        "stage": FINAL_STAGE,
    }
    return {"video_report": report, "progress": progress}


def _failed(relay: Relay, job: Watched) -> Ending | bool | None:
    key = result_error_key(str(job.job_id), job.attempts)
    try:
        failure = JobFailure.model_validate_json(relay.store.get(key))
    except (ObjectNotFound, ValidationError):
        return None
    except StorageError as exc:
        log.warning("outcome not readable yet", extra={"job_id": str(job.job_id), "e": str(exc)})
        return False
    if failure.flow_run_id is not None and failure.flow_run_id != str(job.flow_run_id):
        # Written by a run the job does not hold (one created over the Prefect API with this
        # job's id): not this job's outcome.
        log.warning("failure from another run ignored", extra={"job_id": str(job.job_id)})
        return None
    code = failure.code
    message = PUBLIC_MESSAGES.get(code, pipeline_errors.FaceFlowError.default_message)
    fields = {"error_code": code, "error_message": message}
    return Ending(JobStatus.failed, fields, retry=(code, message) if failure.retryable else None)


def _apply(
    session: Session,
    job: Watched,
    run: FlowRun | None,
    ending: Ending,
    *,
    now: datetime,
    cost_s: float,
) -> str | None:
    """Write ``ending`` for ``job`` in ``session`` (not committed): what it did (the status
    ended in, or for a retry what ``_fence`` did), or None when the job's guard failed."""
    if ending.retry is not None:
        return _fence(
            session, job, run, reason="failed", now=now, cost_s=cost_s, failure=ending.retry
        )
    changed = transition(
        session,
        job_id=job.job_id,
        to=ending.to,
        expected=ENDED_FROM,
        expected_flow_run_id=job.flow_run_id,
        commit=False,
        now=now,
        **ending.fields,
    )
    return ending.to.value if changed else None


def _report(relay: Relay, job: Watched, ending: Ending, done: str | None) -> None:
    """Count and log a committed ``_apply`` that did ``done``."""
    if done is not None and ending.retry is not None:
        _reaped(relay, job, "failed", done)
    elif done is not None:
        _ended(relay, job, ending.to)


def end(relay: Relay, job: Watched, to: JobStatus, **fields: Any) -> bool:
    """Move ``job`` to the final status ``to`` with ``fields`` (from ``ENDED_FROM``, fenced
    on its run), as a stored outcome would; whether it moved."""
    return _write_endings(relay, [(job, None, Ending(to, fields))])[job.job_id] is not None


def _ended(relay: Relay, job: Watched, to: JobStatus) -> None:
    relay.metrics.inc(TRANSITIONS, to.value)
    log.info("job ended", extra={"job_id": str(job.job_id), "status": to.value})
    relay.wake("dispatch")  # a run may have ended: batching dispatch may send more


def write(
    relay: Relay,
    job: Watched,
    to: JobStatus,
    expected: JobStatus | frozenset[JobStatus],
    **fields: Any,
) -> bool:
    with relay.session() as session:
        return transition(
            session,
            job_id=job.job_id,
            to=to,
            expected=expected,
            expected_flow_run_id=job.flow_run_id,
            **fields,
        )


def retry_or_fail(
    relay: Relay,
    job: Watched,
    run: FlowRun | None,
    *,
    reason: str,
    now: datetime,
    failure: tuple[JobErrorCode, str] | None = None,
) -> bool:
    """Fence off ``job``'s current run (and cancel it, or stop the job in it when the run
    carries other jobs), then re-dispatch or fail the job. ``failure`` is the (code,
    message) a job fails with when it cannot run again (default ``worker_lost``)."""
    cost_s = relay.expected_cost_s()
    with relay.session() as session:
        outcome = _fence(session, job, run, reason=reason, now=now, cost_s=cost_s, failure=failure)
        session.commit()
    if outcome is not None:
        _reaped(relay, job, reason, outcome)
    return outcome is not None


def _fence(
    session: Session,
    job: Watched,
    run: FlowRun | None,
    *,
    reason: str,
    now: datetime,
    cost_s: float,
    failure: tuple[JobErrorCode, str] | None,
) -> str | None:
    """``retry_or_fail``'s writes in ``session`` (not committed), an attempt expected to
    need ``cost_s``: "redispatched", "failed", or None when the job's guard failed."""
    time_left = (job.deadline_at - now).total_seconds()
    enough_time = time_left > cost_s
    can_retry = reason != "overdue" and job.attempts < job.max_attempts and enough_time
    fields: dict[str, Any]
    if can_retry:  # back to queued without a run: the old run is fenced off
        to = JobStatus.queued
        fields = {"flow_run_id": None, "stage": None, "dispatch_key": None}
    else:
        lost = reason != "overdue" and enough_time
        code = JobErrorCode.worker_lost if lost else JobErrorCode.deadline_exceeded
        code, message = failure if failure and lost else (code, MESSAGES[code])
        to, fields = JobStatus.failed, {"error_code": code, "error_message": message}
    changed = transition(
        session,
        job_id=job.job_id,
        to=to,
        expected=job.status,
        expected_flow_run_id=job.flow_run_id,
        commit=False,
        now=now,
        **fields,
    )
    if not changed:
        return None
    if can_retry:
        session.add(_outbox("dispatch", job.job_id, {"attempt": job.attempts + 1}, now))
    # A video attempt's parts outlive its coordinator: they are cancelled even when the
    # coordinator's run is over (crashed, lost), so no GPU renders for a fenced attempt.
    live_id = run.id if run is not None and not run.state_type.is_final else None
    if live_id is not None or job.media == "video":
        payload = {"flow_run_id": live_id, "attempt": job.attempts}
        session.add(_outbox("cancel_run", job.job_id, payload, now))
    return "redispatched" if can_retry else "failed"


def _reaped(relay: Relay, job: Watched, reason: str, outcome: str) -> None:
    """Count and log a committed ``_fence``."""
    relay.metrics.inc(REAPED, f"{reason}_{outcome}")
    log.warning(
        "flow run reaped",
        extra={
            "job_id": str(job.job_id),
            "attempt": job.attempts,
            "reason": reason,
            "outcome": outcome,
        },
    )


def _outbox(kind: OutboxKind, job_id: uuid.UUID, payload: dict[str, Any], now: datetime) -> Outbox:
    return Outbox(kind=kind, job_id=job_id, payload=payload, created_at=now, next_attempt_at=now)
