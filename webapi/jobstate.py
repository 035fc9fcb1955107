"""The job state machine: the one function that changes a job's status.

``transition`` is a compare-and-set: a single ``UPDATE jobs ... WHERE id = :id AND status
IN (:expected) [AND flow_run_id = :run]``. It returns whether the row changed, so two
writers racing (an API cancel and the relay's sync, a stale flow run and the current one)
can never both win. Its side effects are written in the same transaction:

- the webhook outbox row, when the new status has an event the job subscribed to;
- a ``cancel_run`` outbox row, when a job holding a flow run is cancel-requested, or is
  cancelled/expired while still queued (the relay then cancels the Prefect flow run);
- pending ``dispatch`` outbox rows are closed as ``obsolete`` when the job goes terminal;
- the retention clock starts when the job goes terminal: ``inputs_purge_at`` and
  ``result_purge_at`` = now + the job's retention times (``webapi.retention`` acts on them);
- a terminal move is announced to the requests waiting for the job when the transaction
  commits (``webapi.job_ends``).

``record_progress`` writes a running video job's ``progress`` under the same
compare-and-set on its run, with a ``job.progress`` webhook row at most once per
``PROGRESS_EVENT_INTERVAL_S`` when the job subscribed to it.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection, Mapping
from datetime import datetime, timedelta
from typing import Any, Final

import sqlalchemy as sa
from sqlmodel import Session, col

from webapi.job_ends import mark_ended
from webapi.models import (
    PROGRESS_EVENT_INTERVAL_S,
    STATUS_EVENTS,
    Job,
    JobStatus,
    Outbox,
    utcnow,
)

S = JobStatus

#: Allowed ``from → to`` moves. A status listed under itself is a same-state update
#: (the relay recording ``flow_run_id`` on dispatch, or a new ``stage`` while running).
ALLOWED: Final[Mapping[JobStatus, frozenset[JobStatus]]] = {
    S.queued: frozenset({S.queued, S.running, S.succeeded, S.failed, S.expired, S.cancelled}),
    # running → queued is a re-dispatch (new attempt) by the reaper.
    S.running: frozenset(
        {S.running, S.queued, S.succeeded, S.failed, S.cancel_requested, S.cancelled}
    ),
    # The run may finish before the cancellation reaches it: its real outcome wins.
    S.cancel_requested: frozenset({S.cancel_requested, S.cancelled, S.succeeded, S.failed}),
    S.succeeded: frozenset(),
    S.failed: frozenset(),
    S.expired: frozenset(),
    S.cancelled: frozenset(),
}

_WRITABLE: Final[frozenset[str]] = frozenset(Job.model_fields) - {"id", "owner_id", "status"}


class InvalidTransition(ValueError):
    """A caller asked for a move the state machine forbids (a programming error)."""


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


UNSET: Final = _Unset()


def transition(
    session: Session,
    *,
    job_id: uuid.UUID,
    to: JobStatus,
    expected: JobStatus | Collection[JobStatus],
    expected_flow_run_id: uuid.UUID | _Unset | None = UNSET,
    commit: bool = True,
    now: datetime | None = None,
    **fields: Any,
) -> bool:
    """Move job ``job_id`` to ``to`` if its status is in ``expected`` (and, when
    ``expected_flow_run_id`` is given, its ``flow_run_id`` equals it; ``None`` means "no
    run yet"). ``fields`` are further ``Job`` columns to set (values or SQL expressions,
    e.g. ``attempts=Job.attempts + 1``).

    Sets ``updated_at``; ``finished_at`` on a terminal move, ``started_at`` on the first
    move to ``running`` and ``cancel_requested_at`` on a cancel request, unless given.
    Returns True when the job changed, False when the compare-and-set lost (nothing is
    written then). Commits unless ``commit=False`` (the caller then owns the transaction).
    Raises ``InvalidTransition`` for a move ``ALLOWED`` forbids or an unknown field.
    """
    expected_set = frozenset({expected} if isinstance(expected, JobStatus) else expected)
    _check(to, expected_set, fields)
    now = now or utcnow()
    values: dict[str, Any] = {"status": to, "updated_at": now, **fields}
    if to.is_terminal:
        values.setdefault("finished_at", now)
    if to is S.running:
        values.setdefault("started_at", sa.func.coalesce(Job.started_at, now))
    if to is S.cancel_requested:
        values.setdefault("cancel_requested_at", now)

    statement = (
        sa.update(Job)
        .where(col(Job.id) == job_id, col(Job.status).in_(expected_set))
        .values(**values)
        .execution_options(synchronize_session=False)
    )
    if not isinstance(expected_flow_run_id, _Unset):
        statement = statement.where(
            col(Job.flow_run_id).is_(None)
            if expected_flow_run_id is None
            else col(Job.flow_run_id) == expected_flow_run_id
        )
    changed = session.execute(statement).rowcount == 1  # type: ignore[attr-defined]
    if changed and to not in expected_set:
        job = session.get(Job, job_id, populate_existing=True)
        if job is not None:
            _side_effects(session, job=job, came_from=expected_set, now=now)
    if commit:
        session.commit()
    return changed


def _check(to: JobStatus, expected: frozenset[JobStatus], fields: Mapping[str, Any]) -> None:
    if not expected:
        raise InvalidTransition("expected must name at least one status")
    forbidden = sorted(status.value for status in expected if to not in ALLOWED[status])
    if forbidden:
        raise InvalidTransition(f"{', '.join(forbidden)} → {to.value} is not allowed")
    if to in expected and len(expected) > 1:
        raise InvalidTransition("a same-state update must expect only that state")
    unknown = sorted(set(fields) - _WRITABLE)
    if unknown:
        raise InvalidTransition(f"not writable job fields: {', '.join(unknown)}")


def _side_effects(
    session: Session, *, job: Job, came_from: frozenset[JobStatus], now: datetime
) -> None:
    status = job.status
    event = STATUS_EVENTS.get(status)
    if event is not None and job.callback_url and event in job.callback_events:
        session.add(webhook_row(job=job, event=event, now=now))
    was_queued = S.queued in came_from
    if job.flow_run_id is not None and (
        status is S.cancel_requested or (was_queued and status in (S.cancelled, S.expired))
    ):
        session.add(
            Outbox(
                kind="cancel_run",
                job_id=job.id,
                payload={"flow_run_id": str(job.flow_run_id), "attempt": job.attempts},
                created_at=now,
                next_attempt_at=now,
            )
        )
    if status.is_terminal:
        mark_ended(session, job.id)  # waiters hear of it when this transaction commits
        session.execute(
            sa.update(Job)
            .where(col(Job.id) == job.id)
            .values(
                inputs_purge_at=now + timedelta(seconds=job.input_retention_s),
                result_purge_at=now + timedelta(seconds=job.result_retention_s),
            )
            .execution_options(synchronize_session=False)
        )
        session.execute(
            sa.update(Outbox)
            .where(
                col(Outbox.job_id) == job.id,
                col(Outbox.kind) == "dispatch",
                col(Outbox.done_at).is_(None),
            )
            .values(done_at=now, outcome="obsolete")
            .execution_options(synchronize_session=False)
        )


#: Where ``record_progress`` keeps, inside ``jobs.progress``, when it last queued a
#: ``job.progress`` webhook (not part of the public ``JobProgress``).
NOTIFIED_AT = "notified_at"


def record_progress(
    session: Session,
    *,
    job_id: uuid.UUID,
    flow_run_id: uuid.UUID,
    progress: Mapping[str, Any],
    now: datetime | None = None,
) -> bool:
    """Set a running job's ``progress`` if ``flow_run_id`` is still its run; queue a
    ``job.progress`` webhook when the job subscribed and the last one is at least
    ``PROGRESS_EVENT_INTERVAL_S`` old. Returns whether the job changed; commits."""
    now = now or utcnow()
    job = session.get(Job, job_id, populate_existing=True)
    if job is None or job.status is not S.running or job.flow_run_id != flow_run_id:
        session.commit()
        return False
    last = (job.progress or {}).get(NOTIFIED_AT)
    due = "job.progress" in (job.callback_events or []) and job.callback_url is not None
    if due and last is not None:
        due = (now - datetime.fromisoformat(last)).total_seconds() >= PROGRESS_EVENT_INTERVAL_S
    stored = {**progress, NOTIFIED_AT: now.isoformat() if due else last}
    changed = transition(
        session,
        job_id=job_id,
        to=S.running,
        expected=S.running,
        expected_flow_run_id=flow_run_id,
        commit=False,
        now=now,
        progress=stored,
    )
    if changed and due:
        job = session.get(Job, job_id, populate_existing=True)
        assert job is not None
        session.add(webhook_row(job=job, event="job.progress", now=now))
    session.commit()
    return changed


def webhook_row(*, job: Job, event: str, now: datetime) -> Outbox:
    """The outbox row of one webhook event, with its body frozen now (Standard Webhooks
    payload: ``type``, ``timestamp``, ``data`` = the job as ``event_data`` shows it)."""
    outbox_id = uuid.uuid4()
    body = {"type": event, "timestamp": now.isoformat(), "data": event_data(job)}
    return Outbox(
        id=outbox_id,
        kind="webhook",
        job_id=job.id,
        payload={"event": event, "webhook_id": f"msg_{outbox_id.hex}", "body": body},
        created_at=now,
        next_attempt_at=now,
    )


def event_data(job: Job) -> dict[str, Any]:
    """The JSON-ready job summary carried by webhooks (URLs relative to the API root)."""
    base = f"/v1/jobs/{job.id}"
    result = None
    if job.status is S.succeeded and job.result_key:
        result = {
            "url": f"{base}/result",
            "content_type": job.result_content_type,
            "width": job.result_width,
            "height": job.result_height,
        }
    error = (
        {"code": job.error_code, "message": job.error_message or job.error_code}
        if job.error_code
        else None
    )
    return {
        "id": str(job.id),
        "status": job.status.value,
        "stage": job.stage,
        "attempts": job.attempts,
        "created_at": _iso(job.created_at),
        "started_at": _iso(job.started_at),
        "finished_at": _iso(job.finished_at),
        "deadline_at": _iso(job.deadline_at),
        "error": error,
        "result": result,
        "quality": job.quality,
        "media": job.media,
        "progress": _public_progress(job.progress),
        "urls": {"self": base, "cancel": f"{base}/cancel", "result": f"{base}/result"},
    }


def _public_progress(progress: Mapping[str, Any] | None) -> dict[str, Any] | None:
    return None if progress is None else {k: v for k, v in progress.items() if k != NOTIFIED_AT}


def _iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()
