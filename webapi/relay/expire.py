"""expire: queued jobs that never started by ``queue_deadline_at`` → ``expired``.

No GPU is spent: a job whose run is already Pending/Running is left to ``sync`` (it has
started); otherwise the job expires and ``jobstate`` writes a ``cancel_run`` outbox row
for its Scheduled flow run, if it has one. If Prefect cannot be asked, the job expires
anyway (a queued job must end).
"""

from __future__ import annotations

import logging

from sqlmodel import col, select

from tasks.error_codes import JobErrorCode
from webapi.jobstate import transition
from webapi.models import Job, JobStatus, utcnow
from webapi.prefect_api import PrefectUnavailable, StateType
from webapi.relay.context import Relay

log = logging.getLogger(__name__)

QUEUE_TIMEOUT_MESSAGE = "The job did not start before its queue timeout."
STARTED = frozenset({StateType.PENDING, StateType.RUNNING})


def run_once(relay: Relay) -> int:
    """Expire overdue queued jobs; returns how many expired."""
    now = utcnow()
    query = (
        select(Job.id, Job.flow_run_id)
        .where(
            col(Job.status) == JobStatus.queued,
            col(Job.started_at).is_(None),
            col(Job.queue_deadline_at) <= now,
        )
        .order_by(col(Job.queue_deadline_at))
        .limit(relay.timings.batch)
    )
    with relay.session() as session:
        overdue = list(session.exec(query).all())
        session.commit()
    if not overdue:
        return 0
    started: set[str] = set()
    run_ids = [str(run_id) for _job_id, run_id in overdue if run_id is not None]
    if run_ids:
        try:
            runs = relay.prefect.read_flow_runs(run_ids)
            started = {run_id for run_id, run in runs.items() if run.state_type in STARTED}
        except PrefectUnavailable as exc:
            log.warning("expiring without Prefect's view", extra={"error": str(exc)})
    expired = 0
    for job_id, run_id in overdue:
        if run_id is not None and str(run_id) in started:
            continue
        with relay.session() as session:
            if transition(
                session,
                job_id=job_id,
                to=JobStatus.expired,
                expected=JobStatus.queued,
                expected_flow_run_id=run_id,
                error_code=JobErrorCode.queue_timeout,
                error_message=QUEUE_TIMEOUT_MESSAGE,
            ):
                expired += 1
                relay.metrics.inc("faceflow_relay_transitions_total", JobStatus.expired.value)
                log.info("job expired", extra={"job_id": str(job_id)})
    return expired
