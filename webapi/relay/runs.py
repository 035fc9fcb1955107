"""Flow runs for job attempts: what the single (``webapi.relay.dispatch``) and the batched
(``webapi.relay.batches``) dispatchers share.

A job attempt's ``Plan`` is read in a short transaction (a row whose job no longer wants a
run is closed as ``obsolete``); its parameters are signed for the default blocks
(``flows.binding``) and its flow run is created — a ``fuse-faces`` run under key
``job-<id>-attempt-<n>``, or a ``fuse-batch`` run under the batch's key — on the work queue
of its lane, then recorded on the job, still ``queued`` until the run starts, in a
transaction conditional on the job being queued with no run. A permanent refusal fails
the jobs with ``dispatch_rejected``; an unreachable Prefect defers the rows and pauses
dispatch until its health check answers (``webapi.relay.outage``). Every outcome is
counted in ``faceflow_relay_dispatches_total``.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlmodel import Session, col, select

from flows import binding
from flows.params import (
    DEFAULT_SETTINGS_BLOCK,
    DEFAULT_SIGNING_BLOCK,
    DEFAULT_STORAGE_BLOCK,
    VIDEO_DEPLOYMENT_NAME,
    VIDEO_FLOW_NAME,
    FuseBatchParams,
    FuseFacesParams,
    JobAttempt,
)
from tasks.error_codes import JobErrorCode
from tasks.options import FusionOptions
from webapi.jobstate import transition
from webapi.models import Job, JobStatus, Outbox, OutboxOutcome, utcnow
from webapi.prefect_api import FlowRun, PrefectRejected, PrefectUnavailable
from webapi.relay import leases, outage
from webapi.relay.context import Relay

log = logging.getLogger(__name__)

COUNTER = "faceflow_relay_dispatches_total"
#: The jobs dispatch takes: both inputs stored (an input URL not fetched yet is the fetch
#: lane's).
INPUTS_STORED: sa.ColumnElement[bool] = sa.and_(
    col(Job.source_key).is_not(None), col(Job.target_key).is_not(None)
)

Attempt = TypeVar("Attempt", bound=JobAttempt)


@dataclass(frozen=True)
class Plan:
    """What one dispatch needs, read in a short transaction."""

    job_id: uuid.UUID
    owner_id: uuid.UUID
    attempt: int
    created_at: datetime
    deadline_at: datetime
    queue_deadline_at: datetime
    started: bool
    source_key: str | None
    target_key: str | None
    source_url: str | None
    target_url: str | None
    options: dict[str, object]
    priority: str = "normal"
    dispatch_key: str | None = None
    extra_source_keys: tuple[str, ...] = ()
    reference_keys: tuple[str, ...] = ()
    pixels: int | None = None  # jobs.input_pixels (None on jobs from before it)
    media: str = "photo"

    @property
    def alone(self) -> bool:
        """Whether the job runs in a run of its own: a per-face mapping (``fuse-faces``) or
        a video (``fuse-video``), never in a batch."""
        mapped = self.options.get("mapping") or self.extra_source_keys or self.reference_keys
        return bool(mapped) or self.media == "video"


def plan_of(job: Job, attempt: int) -> Plan:
    """The dispatch plan of ``job``'s attempt ``attempt``."""
    return Plan(
        job_id=job.id,
        owner_id=job.owner_id,
        attempt=attempt,
        created_at=job.created_at,
        deadline_at=job.deadline_at,
        queue_deadline_at=job.queue_deadline_at,
        started=job.started_at is not None,
        source_key=job.source_key,
        target_key=job.target_key,
        source_url=job.source_url,
        target_url=job.target_url,
        options=dict(job.options),
        priority=job.priority,
        dispatch_key=job.dispatch_key,
        extra_source_keys=tuple((job.extra_inputs or {}).get("sources", [])),
        reference_keys=tuple((job.extra_inputs or {}).get("references", [])),
        pixels=job.input_pixels,
        media=job.media,
    )


# --------------------------------------------------------------------------- plans


def plans(relay: Relay, rows: list[Outbox]) -> list[tuple[Outbox, Plan]]:
    """The dispatch plans of leased rows, read in one transaction, with their inputs
    stored (``ready``); rows whose job no longer wants a run are closed as obsolete."""
    with relay.session() as session:
        jobs = {
            job.id: job
            for job in session.exec(select(Job).where(col(Job.id).in_([r.job_id for r in rows])))
        }
        planned: list[tuple[Outbox, Plan]] = []
        obsolete = 0
        for row in rows:
            job = jobs.get(row.job_id)
            attempt = _attempt_of(row, job)
            if job is None or job.status is not JobStatus.queued or job.attempts >= attempt:
                leases.finish(session, row, owner=relay.owner, outcome="obsolete")
                obsolete += 1
                continue
            planned.append((row, plan_of(job, attempt)))
        session.commit()
    if obsolete:
        relay.metrics.inc(COUNTER, "obsolete", obsolete)
    found = [(row, ready(relay, row, plan)) for row, plan in planned]
    return [(row, plan) for row, plan in found if plan is not None]


def _attempt_of(row: Outbox, job: Job | None) -> int:
    return int(row.payload.get("attempt") or ((job.attempts + 1) if job else 1))


def plan_row(relay: Relay, row: Outbox) -> Plan | None:
    """Read the job; close the row (obsolete) when the job no longer wants a run."""
    with relay.session() as session:
        job = session.get(Job, row.job_id)
        attempt = _attempt_of(row, job)
        if job is None or job.status is not JobStatus.queued or job.attempts >= attempt:
            leases.finish(session, row, owner=relay.owner, outcome="obsolete")
            session.commit()
            relay.metrics.inc(COUNTER, "obsolete")
            return None
        plan = plan_of(job, attempt)
        session.commit()  # end the read transaction before any network call
    return plan


def ready(relay: Relay, row: Outbox, plan: Plan) -> Plan | None:
    """``plan`` if it can be dispatched now, or None when the row was deferred instead:
    too late to start (expire or reap ends the job), or an input not fetched yet (the
    fetch lane's; dispatch claims exclude such jobs, so only a row taken otherwise)."""
    now = utcnow()
    if now >= plan.deadline_at or (not plan.started and now >= plan.queue_deadline_at):
        _defer(relay, row, "past the job's deadline", relay.timings.expire_interval_s)
        return None
    if plan.source_key is None or plan.target_key is None:
        _defer(relay, row, "an input URL is not fetched yet", relay.timings.fetch_interval_s)
        relay.wake("fetch")
        return None
    return plan


def _defer(relay: Relay, row: Outbox, error: str, delay_s: float) -> None:
    with relay.session() as session:
        leases.reschedule(
            session, row, owner=relay.owner, error=error, delay_s=delay_s, count_attempt=False
        )
        session.commit()


def update_queued(session: Session, plan: Plan, **fields: Any) -> bool:
    """Write ``fields`` on the job if it is still queued without a flow run."""
    return transition(
        session,
        job_id=plan.job_id,
        to=JobStatus.queued,
        expected=JobStatus.queued,
        expected_flow_run_id=None,
        **fields,
    )


# --------------------------------------------------------------------------- runs


def send_single(relay: Relay, row: Outbox, plan: Plan) -> bool:
    """Create the ``fuse-faces`` run of one job attempt (``fuse-video`` for a video, on its
    deployment's queue) and record it; False when Prefect was unreachable (the row is
    deferred)."""
    params = bound_attempt(
        relay,
        plan,
        FuseFacesParams,
        storage_block=DEFAULT_STORAGE_BLOCK,
        settings_block=DEFAULT_SETTINGS_BLOCK,
        signing_block=DEFAULT_SIGNING_BLOCK,
    )
    video = (VIDEO_FLOW_NAME, VIDEO_DEPLOYMENT_NAME)

    def make(queue: str | None) -> FlowRun:
        if plan.media == "video":
            return relay.prefect.create_flow_run(params, deployment=video)
        return relay.prefect.create_flow_run(params, work_queue_name=queue)

    return create(
        relay,
        [plan],
        {plan.job_id: row},
        make,
        lambda run_id: _record_run(relay, row, plan, run_id),
    )


def batch_params(relay: Relay, members: list[Plan]) -> FuseBatchParams:
    """The parameters of one ``fuse-batch`` run of ``members`` (each job attempt signed);
    the run's deadline is the latest of theirs."""
    return FuseBatchParams(
        jobs=[bound_attempt(relay, plan, JobAttempt) for plan in members],
        deadline_at=max(plan.deadline_at for plan in members),
        storage_block=DEFAULT_STORAGE_BLOCK,
        settings_block=DEFAULT_SETTINGS_BLOCK,
        signing_block=DEFAULT_SIGNING_BLOCK,
    )


def create(
    relay: Relay,
    members: list[Plan],
    rows: dict[uuid.UUID, Outbox],
    make: Callable[[str | None], FlowRun],
    record: Callable[[uuid.UUID], None],
) -> bool:
    """Create the flow run of ``members`` (one lane) with ``make(work queue)`` and
    ``record`` its id. Prefect unreachable: ``rows`` are deferred and dispatch pauses
    (returns False); Prefect refuses the run: the jobs fail with ``dispatch_rejected``."""
    try:
        run = make(work_queue(relay, members[0]))
    except PrefectUnavailable as exc:
        held = list(rows.values())
        prefect_down(relay, held[0], str(exc))
        defer_untried(relay, held[1:], str(exc))
        return False
    except PrefectRejected as exc:
        what = "dispatch rejected" if len(members) == 1 else "batch dispatch rejected"
        extra = {"job_id": str(members[0].job_id), "jobs": len(members), "detail": exc.detail}
        log.error(what, extra=extra)
        for plan in members:
            message = "The job could not be scheduled."
            code = JobErrorCode.dispatch_rejected
            fail(relay, rows.get(plan.job_id), plan, code, message, str(exc))
        return True
    relay.outage.dispatched()
    record(uuid.UUID(run.id))
    return True


def bound_attempt(relay: Relay, plan: Plan, model: type[Attempt], **blocks: str) -> Attempt:
    """The parameters of ``plan``'s job attempt as ``model`` (``FuseFacesParams``, or a
    ``JobAttempt`` of a batch), signed for the default storage, settings and signing blocks
    (``flows.binding``): the flow refuses them if anyone changes them."""
    assert plan.source_key is not None and plan.target_key is not None
    job = model(
        job_id=str(plan.job_id),
        owner_id=str(plan.owner_id),
        source_key=plan.source_key,
        target_key=plan.target_key,
        options=FusionOptions.model_validate(plan.options),
        deadline_at=plan.deadline_at,
        attempt=plan.attempt,
        extra_source_keys=list(plan.extra_source_keys),
        reference_keys=list(plan.reference_keys),
        **blocks,
    )
    signature = binding.sign(
        job,
        relay.settings.run_signing_key.get_secret_value(),
        storage_block=DEFAULT_STORAGE_BLOCK,
        settings_block=DEFAULT_SETTINGS_BLOCK,
        signing_block=DEFAULT_SIGNING_BLOCK,
    )
    return job.model_copy(update={"binding": signature})


def work_queue(relay: Relay, plan: Plan) -> str | None:
    """The GPU pool's work queue of the job's lane (None: the deployment's queue)."""
    return relay.settings.priority_work_queue if plan.priority == "high" else None


def _record_run(relay: Relay, row: Outbox, plan: Plan, flow_run_id: uuid.UUID) -> None:
    now = utcnow()
    with relay.session() as session:
        recorded = update_queued(
            session, plan, flow_run_id=flow_run_id, attempts=plan.attempt, commit=False, now=now
        )
        leases.finish(
            session, row, owner=relay.owner, outcome="done" if recorded else "obsolete", now=now
        )
        session.commit()
    if recorded:
        relay.metrics.inc(COUNTER, "dispatched")
        relay.metrics.observe_dispatch_lag((now - plan.created_at).total_seconds())
        log.info("dispatched", extra={"job_id": str(plan.job_id), "attempt": plan.attempt})
        return
    relay.metrics.inc(COUNTER, "obsolete")
    cancel_orphan(relay, flow_run_id)


def cancel_orphan(relay: Relay, flow_run_id: uuid.UUID) -> None:
    """Cancel a run created for jobs that were cancelled or expired while it was being
    created (it is Scheduled, so no worker has it yet; best effort, the reaper covers
    failures)."""
    try:
        run = relay.prefect.read_flow_run(str(flow_run_id))
        if run is not None:
            relay.prefect.cancel_flow_run(run, message="FaceFlow job is no longer queued")
    except (PrefectUnavailable, PrefectRejected) as exc:
        log.warning("could not cancel an orphaned run", extra={"error": str(exc)})


def fail(
    relay: Relay, row: Outbox | None, plan: Plan, code: JobErrorCode, message: str, detail: str
) -> None:
    """Fail the queued job of ``plan`` with ``code`` and close its row (if held)."""
    with relay.session() as session:
        # Close the row first: the terminal transition would close it as "obsolete".
        if row is not None:
            leases.finish(session, row, owner=relay.owner, outcome="done", error=detail)
        transition(
            session,
            job_id=plan.job_id,
            to=JobStatus.failed,
            expected=JobStatus.queued,
            expected_flow_run_id=None,
            error_code=code,
            error_message=message[:500],
            commit=False,
        )
        session.commit()
    relay.metrics.inc(COUNTER, "rejected")


def close(relay: Relay, row: Outbox, outcome: OutboxOutcome) -> None:
    """Close a leased row with ``outcome``."""
    with relay.session() as session:
        leases.finish(session, row, owner=relay.owner, outcome=outcome)
        session.commit()


# --------------------------------------------------------------------------- Prefect outages


def until_prefect_down(
    relay: Relay, rows: list[Outbox], handle: Callable[[Relay, Outbox], bool]
) -> int:
    """``handle`` each leased row in turn until one finds Prefect unreachable (it returns
    False), then defer the rest untried; returns how many rows were leased. Shared by the
    rows that call Prefect: dispatch and ``cancel_run``."""
    for index, row in enumerate(rows):
        if not handle(relay, row):
            defer_untried(relay, rows[index + 1 :], row.last_error or "Prefect unavailable")
            break
    return len(rows)


def prefect_down(relay: Relay, row: Outbox, error: str) -> None:
    """Defer ``row`` (marked as an outage deferral) and enter outage mode; one warning per
    outage, not one per row. Used for dispatch and ``cancel_run`` rows alike."""
    marked = outage.mark(error)
    reschedule_after_backoff(relay, row, marked)
    row.last_error = marked
    t = relay.timings
    if relay.outage.begin(probe_s=t.prefect_probe_interval_s, cap_s=t.dispatch_backoff_cap_s):
        log.warning(
            "Prefect unavailable: dispatch and cancellations paused until its health check "
            "answers: %s",
            error,
            extra={"job_id": str(row.job_id)},
        )


def defer_untried(relay: Relay, rows: list[Outbox], error: str) -> None:
    """Release the rest of a claimed batch untried (Prefect is unreachable): one UPDATE."""
    if not rows:
        return
    with relay.session() as session:
        deferred = outage.defer_rows(
            session,
            rows,
            owner=relay.owner,
            error=error,
            delay_s=relay.timings.dispatch_backoff_cap_s,
        )
        session.commit()
    relay.metrics.inc(COUNTER, "deferred", deferred)


def reschedule_after_backoff(
    relay: Relay, row: Outbox, error: str, *, counter: str = COUNTER
) -> float:
    """Release ``row`` to be tried again after its exponential backoff, counted as a
    ``retry`` in ``counter``; the delay (s)."""
    t = relay.timings
    delay = leases.backoff_s(
        row.attempts + 1, base_s=t.dispatch_backoff_base_s, cap_s=t.dispatch_backoff_cap_s
    )
    with relay.session() as session:
        leases.reschedule(session, row, owner=relay.owner, error=error, delay_s=delay)
        session.commit()
    relay.metrics.inc(counter, "retry")
    return delay
