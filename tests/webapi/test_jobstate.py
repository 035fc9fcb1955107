"""The state machine: compare-and-set on status and flow-run id, and its outbox side effects."""

from __future__ import annotations

import threading
import uuid
from typing import Any

import pytest
from sqlalchemy.engine import Engine
from sqlmodel import Session

from faceflow.testing.jobs import dispatch, make_user, move, new_job, outbox_of
from faceflow.testing.threads import run_threads
from webapi.config import Settings
from webapi.jobstate import ALLOWED, InvalidTransition, transition
from webapi.models import TERMINAL_STATUSES, Job, JobStatus

S = JobStatus


def _job(engine: Engine, job_id: uuid.UUID) -> Job:
    with Session(engine) as session:
        job = session.get(Job, job_id)
        assert job is not None
        return job


def test_terminal_states_allow_nothing_and_is_terminal_agrees() -> None:
    for status in S:
        assert status.is_terminal == (status in TERMINAL_STATUSES)
        assert (ALLOWED[status] == frozenset()) == status.is_terminal


def test_compare_and_set_on_status(engine: Engine, settings: Settings) -> None:
    job = new_job(engine, settings, make_user(engine, settings))
    with Session(engine) as session:
        assert not transition(session, job_id=job.id, to=S.succeeded, expected=S.running)
        assert not transition(session, job_id=uuid.uuid4(), to=S.running, expected=S.queued)
    assert _job(engine, job.id).status is S.queued
    move(engine, job.id, S.running, S.queued)
    with Session(engine) as session:
        assert not transition(session, job_id=job.id, to=S.running, expected=S.queued)


def test_only_the_current_flow_run_writes(engine: Engine, settings: Settings) -> None:
    job = new_job(engine, settings, make_user(engine, settings))
    with Session(engine) as session:
        # dispatch records the run only while there is none yet
        first = uuid.uuid4()
        assert transition(
            session, job_id=job.id, to=S.queued, expected=S.queued,
            expected_flow_run_id=None, flow_run_id=first, attempts=Job.attempts + 1,
        )  # fmt: skip
        assert not transition(
            session, job_id=job.id, to=S.queued, expected=S.queued,
            expected_flow_run_id=None, flow_run_id=uuid.uuid4(),
        )  # fmt: skip
        assert transition(
            session, job_id=job.id, to=S.running, expected=S.queued, expected_flow_run_id=first
        )
        # the reaper re-dispatches: a second attempt replaces the first run
        second = uuid.uuid4()
        assert transition(
            session, job_id=job.id, to=S.queued, expected=S.running,
            expected_flow_run_id=first, flow_run_id=second, attempts=Job.attempts + 1,
        )  # fmt: skip
        assert transition(
            session, job_id=job.id, to=S.running, expected=S.queued, expected_flow_run_id=second
        )
        # the zombie first run finishes late: ignored
        assert not transition(
            session, job_id=job.id, to=S.succeeded, expected=S.running,
            expected_flow_run_id=first, result_key="results/stale.png",
        )  # fmt: skip
        assert transition(
            session, job_id=job.id, to=S.succeeded, expected=S.running,
            expected_flow_run_id=second, result_key="results/fresh.png",
        )  # fmt: skip
    done = _job(engine, job.id)
    assert done.status is S.succeeded and done.result_key == "results/fresh.png"
    assert done.attempts == 2 and done.flow_run_id == second
    assert done.started_at is not None and done.finished_at is not None
    assert done.started_at <= done.finished_at


def test_started_at_is_kept_across_attempts(engine: Engine, settings: Settings) -> None:
    job = new_job(engine, settings, make_user(engine, settings))
    move(engine, job.id, S.running, S.queued)
    first_start = _job(engine, job.id).started_at
    move(engine, job.id, S.queued, S.running)
    move(engine, job.id, S.running, S.queued)
    assert _job(engine, job.id).started_at == first_start


@pytest.mark.parametrize(
    ("to", "expected", "fields"),
    [
        (S.running, [S.succeeded], {}),
        (S.queued, [S.cancelled], {}),
        (S.expired, [S.running], {}),
        (S.queued, [S.queued, S.running], {}),
        (S.failed, [], {}),
        (S.failed, [S.queued], {"owner_id": uuid.uuid4()}),
        (S.failed, [S.queued], {"no_such_column": 1}),
    ],
)
def test_forbidden_moves_raise(
    engine: Engine, to: JobStatus, expected: list[JobStatus], fields: dict[str, Any]
) -> None:
    with Session(engine) as session, pytest.raises(InvalidTransition):
        transition(session, job_id=uuid.uuid4(), to=to, expected=expected, **fields)


def test_webhook_rows_follow_the_subscription(engine: Engine, settings: Settings) -> None:
    user = make_user(engine, settings)
    hook = "https://hooks.example/h"
    default = new_job(engine, settings, user, callback_url=hook)
    assert default.callback_events == [
        "job.succeeded",
        "job.failed",
        "job.cancelled",
        "job.expired",
    ]
    move(engine, default.id, S.running, S.queued)  # job.running is opt-in
    move(
        engine,
        default.id,
        S.failed,
        S.running,
        error_code="no_face_found",
        error_message="No face.",
    )
    [webhook] = [row for row in outbox_of(engine, default.id) if row.kind == "webhook"]
    assert webhook.payload["event"] == "job.failed"
    assert webhook.payload["webhook_id"] == f"msg_{webhook.id.hex}"
    body = webhook.payload["body"]
    assert body["type"] == "job.failed" and body["data"]["id"] == str(default.id)
    assert body["data"]["error"] == {"code": "no_face_found", "message": "No face."}

    opted = new_job(engine, settings, user, callback_url=hook, callback_events=["job.running"])
    move(engine, opted.id, S.running, S.queued)
    move(engine, opted.id, S.running, S.running, stage="fuse")  # same state: no new event
    move(engine, opted.id, S.succeeded, S.running)
    events = [row.payload["event"] for row in outbox_of(engine, opted.id) if row.kind == "webhook"]
    assert events == ["job.running"]

    silent = new_job(engine, settings, user)
    move(engine, silent.id, S.expired, S.queued)
    assert [row.kind for row in outbox_of(engine, silent.id)] == ["dispatch"]


def test_terminal_closes_pending_dispatch_and_cancels_runs(
    engine: Engine, settings: Settings
) -> None:
    user = make_user(engine, settings)
    job = new_job(engine, settings, user)
    run = dispatch(engine, job.id)
    move(engine, job.id, S.expired, S.queued, error_code="queue_timeout")
    rows = outbox_of(engine, job.id)
    assert {(row.kind, row.outcome) for row in rows} == {
        ("dispatch", "obsolete"),
        ("cancel_run", None),
    }
    assert [row.payload for row in rows if row.kind == "cancel_run"] == [
        {"flow_run_id": str(run), "attempt": 1}
    ]

    running = new_job(engine, settings, user)
    run = dispatch(engine, running.id)
    move(engine, running.id, S.running, S.queued)
    move(engine, running.id, S.cancel_requested, S.running)
    assert _job(engine, running.id).cancel_requested_at is not None
    move(engine, running.id, S.cancelled, S.cancel_requested)  # run stopped: nothing more to cancel
    kinds = sorted(row.kind for row in outbox_of(engine, running.id))
    assert kinds == ["cancel_run", "dispatch"]


def test_commit_false_leaves_the_transaction_to_the_caller(
    engine: Engine, settings: Settings
) -> None:
    job = new_job(engine, settings, make_user(engine, settings), callback_url="https://h.example/")
    with Session(engine) as session:
        assert transition(session, job_id=job.id, to=S.cancelled, expected=S.queued, commit=False)
        session.rollback()
    assert _job(engine, job.id).status is S.queued
    assert [row.kind for row in outbox_of(engine, job.id)] == ["dispatch"]


def test_racing_writers_exactly_one_wins(engine: Engine, settings: Settings) -> None:
    job = new_job(engine, settings, make_user(engine, settings))
    barrier = threading.Barrier(8)
    wins: list[JobStatus] = []
    targets = [S.cancelled, S.running, S.expired, S.failed] * 2

    def race(to: JobStatus) -> None:
        with Session(engine) as session:
            barrier.wait()
            if transition(session, job_id=job.id, to=to, expected=S.queued):
                wins.append(to)

    run_threads(race, targets)
    assert len(wins) == 1
    assert _job(engine, job.id).status is wins[0]
