"""reap: crashed, lost and overdue flow runs → re-dispatch or fail; cancellations.

A job's run is reaped when it is ``Crashed``, unknown to Prefect (lost), ``Pending`` for
longer than ``pending_timeout_s``, or not finished by ``deadline_at + running_grace_s``.
The old run is cancelled (a ``cancel_run`` outbox row, written in the same transaction)
and the job either goes back to ``queued`` with a new ``dispatch`` row for attempt n+1 —
when attempts remain and the time left exceeds the expected cost of an attempt — or fails
with ``worker_lost`` / ``deadline_exceeded``. Clearing ``flow_run_id`` fences the old run.
A run that ended (``Failed``, ``Cancelled``, ``Completed``) without storing an outcome for
the job was ended by someone else: ``sync`` takes it as lost the same way
(``outcomes.retry_or_fail``, reason ``no_outcome``).

Cancellation: ``cancel_run`` outbox rows set the run CANCELLED (not started) or
CANCELLING (running); a ``cancel_requested`` job becomes ``cancelled`` when its run is
CANCELLED (``sync``), gone, crashed, or still stopping after ``cancel_grace_s`` (forced).
"""

from __future__ import annotations

import logging
import uuid
from datetime import datetime, timedelta

from sqlmodel import col, select

from flows.params import video_parts_tag
from tasks.error_codes import JobErrorCode
from webapi.jobstate import transition
from webapi.models import ACTIVE_STATUSES, Job, JobStatus, Outbox, utcnow
from webapi.prefect_api import FlowRun, PrefectRejected, PrefectUnavailable, StateType
from webapi.relay import batches, leases, runs
from webapi.relay.context import Relay
from webapi.relay.outcomes import (
    MESSAGES,
    REAPED,
    TRANSITIONS,
    Watched,
    observe,
    retry_or_fail,
    settle,
    watched_jobs,
)

log = logging.getLogger(__name__)


def run_once(relay: Relay, *, read_runs: bool = True) -> int:
    """Process cancel_run rows, then reap runs and overdue jobs; returns actions taken.

    ``read_runs`` False (the runner between safety-net reads, while Prefect's flow-run
    events arrive: a CRASHED event asks for a read): the runs are read only when the job
    store alone shows a watched job due for a look (past its deadline and grace, or a
    cancel past its grace); a lost or stuck-pending run waits for the safety net."""
    done = cancel_runs(relay)
    now = utcnow()
    watched = watched_jobs(relay)
    if read_runs or any(_due(relay, job, now) for job in watched):
        observed = observe(relay, watched)
        if observed is not None:
            now = utcnow()
            done += sum(check(relay, job, run, now=now) for job, run in observed)
    return done + reap_runless(relay)


def _due(relay: Relay, job: Watched, now: datetime) -> bool:
    """Whether the job store alone says ``job``'s run needs a look: overdue, or a cancel
    request older than its grace."""
    t = relay.timings
    if job.status is JobStatus.cancel_requested:
        requested = job.cancel_requested_at or now
        return now - requested > timedelta(seconds=t.cancel_grace_s)
    return now > job.deadline_at + timedelta(seconds=t.running_grace_s)


# --------------------------------------------------------------------------- cancel_run


def cancel_runs(relay: Relay) -> int:
    """Cancel the flow runs named by leased ``cancel_run`` rows; returns rows handled.

    Prefect outages are shared with dispatch (``webapi.relay.outage``): while one lasts no
    rows are claimed, and the first unreachable cancel defers the rest of the batch untried
    (one failed connection and one warning, not one per row); recovery makes them due."""
    if relay.outage.active:
        return 0
    return runs.until_prefect_down(relay, relay.claim("cancel_run"), _cancel_row)


def _cancel_row(relay: Relay, row: Outbox) -> bool:
    """Cancel one row's flow run; False when Prefect was unreachable (row deferred). A run
    that still carries other active jobs is not cancelled: the job is stopped in it."""
    run_id = str(row.payload.get("flow_run_id") or "")
    if run_id and shares_run(relay, uuid.UUID(run_id), row.job_id):
        stop_in_shared_run(relay, row.job_id, uuid.UUID(run_id), row.payload.get("attempt"))
        with relay.session() as session:
            leases.finish(session, row, owner=relay.owner, outcome="done")
            session.commit()
        return True
    state: StateType | None = None
    error: str | None = None
    try:
        run = relay.prefect.read_flow_run(run_id) if run_id else None
        state = (
            relay.prefect.cancel_flow_run(run, message="Cancelled by FaceFlow")
            if run is not None
            else None
        )
        attempt = row.payload.get("attempt")
        if isinstance(attempt, int):  # a video attempt's parts (none for a photo job)
            tag = video_parts_tag(str(row.job_id), attempt)
            relay.prefect.cancel_tagged(tag, message="Cancelled by FaceFlow")
    except PrefectUnavailable as exc:
        runs.prefect_down(relay, row, str(exc))
        return False
    except PrefectRejected as exc:
        error = str(exc)
    with relay.session() as session:
        leases.finish(session, row, owner=relay.owner, outcome="done", error=error)
        session.commit()
    log.info("flow run cancel", extra={"job_id": str(row.job_id), "state": str(state)})
    return True


# --------------------------------------------------------------------------- runs


def check(relay: Relay, job: Watched, run: FlowRun | None, *, now: datetime) -> bool:
    """Act on one watched job if its run needs reaping; returns whether it acted."""
    t = relay.timings
    if job.status is JobStatus.cancel_requested:
        return _check_cancel(relay, job, run, now=now)
    if run is None or run.state_type is StateType.CRASHED:
        # A job that finished before its run was lost keeps its outcome (a batch run
        # stores each job's as it ends); only the unfinished ones run again.
        settled = settle(relay, job, run)
        if settled is not None:
            return settled
        reason = "lost" if run is None else "crashed"
        return retry_or_fail(relay, job, run, reason=reason, now=now)
    state = run.state_type
    if state.is_final:
        return False  # sync writes Completed / Failed / Cancelled
    if now > job.deadline_at + timedelta(seconds=t.running_grace_s):
        return retry_or_fail(relay, job, run, reason="overdue", now=now)
    since = run.state_timestamp or now
    if state is StateType.PENDING and now - since > timedelta(seconds=t.pending_timeout_s):
        return retry_or_fail(relay, job, run, reason="stuck_pending", now=now)
    return False


def shares_run(relay: Relay, flow_run_id: uuid.UUID, job_id: uuid.UUID) -> bool:
    """Whether another active job holds ``flow_run_id`` (a ``fuse-batch`` run)."""
    query = (
        select(Job.id)
        .where(
            col(Job.flow_run_id) == flow_run_id,
            col(Job.id) != job_id,
            col(Job.status).in_(list(ACTIVE_STATUSES)),
        )
        .limit(1)
    )
    with relay.session() as session:
        other = session.exec(query).first()
        session.commit()
    return other is not None


def stop_in_shared_run(
    relay: Relay, job_id: uuid.UUID, flow_run_id: uuid.UUID, attempt: object = None
) -> bool:
    """End a job inside a run it shares: write the stop marker of its attempt (the run
    skips it; what it still produces is discarded) and move a cancel-requested job holding
    that run to ``cancelled``. Returns whether the job changed."""
    with relay.session() as session:
        job = session.get(Job, job_id)
        session.commit()
    if job is None:
        return False
    batches.stop(relay, str(job_id), int(attempt) if isinstance(attempt, int) else job.attempts)
    with relay.session() as session:
        changed = transition(
            session,
            job_id=job_id,
            to=JobStatus.cancelled,
            expected=JobStatus.cancel_requested,
            expected_flow_run_id=flow_run_id,
        )
    if changed:
        relay.metrics.inc(TRANSITIONS, JobStatus.cancelled.value)
    return changed


def _check_cancel(relay: Relay, job: Watched, run: FlowRun | None, *, now: datetime) -> bool:
    requested = job.cancel_requested_at or now
    overdue = now - requested > timedelta(seconds=relay.timings.cancel_grace_s)
    if run is not None and run.state_type in (StateType.COMPLETED, StateType.FAILED):
        return False  # the real outcome arrived first: sync writes it
    if run is not None and not run.state_type.is_final:
        if not overdue:
            return False
        if shares_run(relay, job.flow_run_id, job.job_id):  # never force batch-mates' run
            return stop_in_shared_run(relay, job.job_id, job.flow_run_id, job.attempts)
        try:  # the worker never stopped it: force the run's end
            relay.prefect.set_state(
                run.id, StateType.CANCELLED, message="Cancel timed out", force=True
            )
        except (PrefectUnavailable, PrefectRejected) as exc:
            log.warning("could not force cancel", extra={"job_id": str(job.job_id), "e": str(exc)})
    with relay.session() as session:
        changed = transition(
            session,
            job_id=job.job_id,
            to=JobStatus.cancelled,
            expected=JobStatus.cancel_requested,
            expected_flow_run_id=job.flow_run_id,
        )
    if changed:
        relay.metrics.inc(TRANSITIONS, JobStatus.cancelled.value)
    return changed


# --------------------------------------------------------------------------- no run


def reap_runless(relay: Relay) -> int:
    """End active jobs without a flow run that are past their deadline (e.g. a re-dispatch
    that Prefect never accepted in time) and cancel-requested jobs that lost their run."""
    now = utcnow()
    cutoff = now - timedelta(seconds=relay.timings.running_grace_s)
    query = (
        select(Job.id, Job.status)
        .where(
            col(Job.status).in_(list(ACTIVE_STATUSES)),
            col(Job.flow_run_id).is_(None),
            (col(Job.deadline_at) <= cutoff) | (col(Job.status) == JobStatus.cancel_requested),
        )
        .limit(relay.timings.batch)
    )
    with relay.session() as session:
        jobs = list(session.exec(query).all())
        session.commit()
    ended = 0
    for job_id, raw_status in jobs:
        status = JobStatus(raw_status)
        cancelling = status is JobStatus.cancel_requested
        to = JobStatus.cancelled if cancelling else JobStatus.failed
        with relay.session() as session:
            if transition(
                session,
                job_id=job_id,
                to=to,
                expected=status,
                expected_flow_run_id=None,
                error_code=None if cancelling else JobErrorCode.deadline_exceeded,
                error_message=None if cancelling else MESSAGES[JobErrorCode.deadline_exceeded],
            ):
                ended += 1
                relay.metrics.inc(REAPED, f"runless_{to.value}")
    return ended
