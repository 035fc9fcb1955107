"""sync: Prefect flow-run states → job status, stage, result and error.

Polls the flow runs of every non-terminal job that has one (one batched filter call per
pass, every ``sync_interval_s``). Mapping:

- PENDING / RUNNING → ``running`` (``started_at``; ``stage`` from the run's progress
  artifact ``Stage i/n: <name> ...``, as fuse-faces writes it, or a state message
  ``stage: <name>``; one batched artifact query per pass);
- COMPLETED, FAILED, CANCELLED → the outcome the flow stored for the job's attempt, and
  nothing else (``settle``): its ``ResultRef`` sidecar (``flows.params.result_meta_key``)
  → ``succeeded`` with the result and ``stage`` = the flow's last stage (the progress
  artifact is written lazily and may lag behind a run that finished); its ``JobFailure``
  (``result_error_key``, from the run the job holds) → ``failed`` with its code, or
  re-dispatched when it is retryable. A final run that stored neither was ended by someone
  else (another client of the Prefect API, an operator): a cancel-requested job is then
  ``cancelled``, any other is a lost run, re-dispatched or failed ``worker_lost`` as the
  reaper does (``reap.retry_or_fail``). A state's message never decides an outcome;
- CRASHED, lost runs and overdue runs are the reaper's (``webapi.relay.reap``).

Every write is conditional on the job's current ``flow_run_id``: a stale run never writes.
"""

from __future__ import annotations

import logging
import re
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from pydantic import ValidationError
from sqlmodel import col, select

from flows.params import (
    FINAL_STAGE,
    JobFailure,
    ResultRef,
    result_error_key,
    result_meta_key,
)
from tasks import errors as pipeline_errors
from webapi.jobstate import transition
from webapi.models import ACTIVE_STATUSES, Job, JobStatus, UTCDateTime, utcnow
from webapi.prefect_api import FlowRun, PrefectError, PrefectUnavailable, StateType
from webapi.relay.context import Relay
from webapi.storage import ObjectNotFound, StorageError

log = logging.getLogger(__name__)

WATCH_LIMIT = 5000
COUNTER = "faceflow_relay_transitions_total"
_STAGE = re.compile(r"^\s*stage\s*[:=]\s*([A-Za-z][\w-]{0,31})")
_PROGRESS = re.compile(r"^\s*Stage \d+/\d+:\s*([A-Za-z][\w-]{0,31})")
ENDED_FROM = frozenset({JobStatus.queued, JobStatus.running, JobStatus.cancel_requested})


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


def watched_jobs(relay: Relay, *, limit: int = WATCH_LIMIT) -> list[Watched]:
    """Non-terminal jobs holding a flow run, oldest update first."""
    query = (
        select(Job)
        .where(col(Job.status).in_(list(ACTIVE_STATUSES)), col(Job.flow_run_id).is_not(None))
        .order_by(col(Job.updated_at))
        .limit(limit)
    )
    with relay.session() as session:
        jobs = session.exec(query).all()
        watched = [
            Watched(
                job_id=job.id,
                flow_run_id=job.flow_run_id,
                status=job.status,
                stage=job.stage,
                attempts=job.attempts,
                max_attempts=job.max_attempts,
                deadline_at=job.deadline_at,
                started_at=job.started_at,
                cancel_requested_at=job.cancel_requested_at,
            )
            for job in jobs
            if job.flow_run_id is not None
        ]
        session.commit()
    return watched


def observe(relay: Relay) -> list[tuple[Watched, FlowRun | None]] | None:
    """Each watched job with its flow run (None: unknown to Prefect); None if unreachable."""
    watched = watched_jobs(relay)
    if not watched:
        return []
    try:
        runs = relay.prefect.read_flow_runs(str(job.flow_run_id) for job in watched)
    except PrefectUnavailable as exc:
        log.debug("sync skipped: Prefect unavailable", extra={"error": str(exc)})
        return None
    return [(job, runs.get(str(job.flow_run_id))) for job in watched]


def run_once(relay: Relay) -> int:
    """One sync pass; returns how many jobs changed."""
    observed = [(job, run) for job, run in observe(relay) or [] if run is not None]
    progress = _progress(relay, [run for _job, run in observed])
    return sum(apply_run_state(relay, job, run, progress.get(run.id)) for job, run in observed)


def _progress(relay: Relay, runs: list[FlowRun]) -> dict[str, str]:
    """Progress descriptions of the running runs (one call; empty if it fails)."""
    running = [run.id for run in runs if run.state_type is StateType.RUNNING]
    if not running:
        return {}
    try:
        return relay.prefect.read_progress(running)
    except PrefectError:
        return {}


def apply_run_state(relay: Relay, job: Watched, run: FlowRun, progress: str | None = None) -> bool:
    """Write what ``run``'s state means for ``job``; returns whether the job changed.
    ``progress`` is the run's progress-artifact description, if any."""
    state = run.state_type
    if state in (StateType.PENDING, StateType.RUNNING):
        return _started(relay, job, stage_of(run, progress))
    if state in (StateType.COMPLETED, StateType.FAILED, StateType.CANCELLED):
        return _ended(relay, job, run)
    return False  # SCHEDULED, PAUSED, CANCELLING: wait; CRASHED: the reaper's


def stage_of(run: FlowRun, progress: str | None = None) -> str | None:
    """The stage a running flow reports: its state message (``stage: detect``) or its
    progress artifact (``Stage 2/6: detect (attempt 1).``)."""
    match = _STAGE.match(run.state_message or "") or _PROGRESS.match(progress or "")
    return match.group(1).lower() if match else None


def _error_classes(base: type[pipeline_errors.FaceFlowError]) -> list[type[Any]]:
    found: list[type[Any]] = [base]
    for sub in base.__subclasses__():
        found += _error_classes(sub)
    return found


#: Safe messages per pipeline error code (the flow's own text may carry internal detail).
PUBLIC_MESSAGES: dict[str, str] = {
    cls.code: cls.default_message for cls in _error_classes(pipeline_errors.FaceFlowError)
}


def _started(relay: Relay, job: Watched, stage: str | None) -> bool:
    if job.status is JobStatus.queued:
        changed = _write(relay, job, JobStatus.running, JobStatus.queued, stage=stage or "started")
        if changed:
            relay.metrics.inc(COUNTER, JobStatus.running.value)
        return changed
    if job.status is JobStatus.running and stage is not None and stage != job.stage:
        return _write(relay, job, JobStatus.running, JobStatus.running, stage=stage)
    return False


def _ended(relay: Relay, job: Watched, run: FlowRun) -> bool:
    """A final run: the outcome its flow stored, else cancelled (asked for) or lost."""
    settled = settle(relay, job, run)
    if settled is not None:
        return settled
    if job.status is JobStatus.cancel_requested:
        return _end(relay, job, JobStatus.cancelled)
    log.warning(
        "run ended without an outcome: taken as lost",
        extra={"job_id": str(job.job_id), "state": run.state_type.value},
    )
    from webapi.relay.reap import retry_or_fail  # reap builds on sync

    return retry_or_fail(relay, job, run, reason="no_outcome", now=utcnow())


def settle(relay: Relay, job: Watched, run: FlowRun | None) -> bool | None:
    """Apply the outcome the flow stored for ``job``'s current attempt: its ``ResultRef``
    (succeeded) or its ``JobFailure`` (failed; a retryable failure is re-dispatched while
    attempts and time remain). Returns whether the job changed, or None when the attempt
    stored neither (False, to try again, when storage is down)."""
    key = result_meta_key(str(job.job_id), job.attempts)
    try:
        ref = ResultRef.model_validate_json(relay.store.get(key))
    except ObjectNotFound:
        return _failed(relay, job, run)
    except ValidationError:
        return _end(
            relay,
            job,
            JobStatus.failed,
            error_code="result_invalid",
            error_message="The job finished but its result could not be read.",
        )
    except StorageError as exc:  # storage unreachable: try again next pass
        log.warning("result not readable yet", extra={"job_id": str(job.job_id), "error": str(exc)})
        return False
    started = run.start_time if run is not None else None
    return _end(
        relay,
        job,
        JobStatus.succeeded,
        started_at=sa.func.coalesce(Job.started_at, sa.literal(started or utcnow(), UTCDateTime)),
        stage=FINAL_STAGE,
        result_key=ref.key,
        result_content_type=ref.content_type,
        result_width=ref.width,
        result_height=ref.height,
        timings=ref.timings_ms,
        quality=ref.quality.as_json() if ref.quality is not None else None,
        error_code=None,
        error_message=None,
    )


def _failed(relay: Relay, job: Watched, run: FlowRun | None) -> bool | None:
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
    if failure.retryable:
        from webapi.relay.reap import retry_or_fail  # reap builds on sync

        return retry_or_fail(
            relay, job, run, reason="failed", now=utcnow(), failure=(code, message)
        )
    return _end(relay, job, JobStatus.failed, error_code=code, error_message=message)


def _end(relay: Relay, job: Watched, to: JobStatus, **fields: Any) -> bool:
    changed = _write(relay, job, to, ENDED_FROM, **fields)
    if changed:
        relay.metrics.inc(COUNTER, to.value)
        log.info("job ended", extra={"job_id": str(job.job_id), "status": to.value})
        relay.wake("dispatch")  # a run may have ended: batching dispatch may send more
    return changed


def _write(
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
