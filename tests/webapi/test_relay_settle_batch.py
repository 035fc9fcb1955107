"""A batch run's end settles all its jobs in one pass and one transaction.

No Prefect here: an ended run is told to sync as its event would tell it
(``relay.news.ended``), and the outcomes are the ones the flow stores. Each job's write is
fenced as alone: a job cancelled meanwhile is left as it is while the others settle, and
each settled job's webhook is queued in the same transaction.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import event
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from faceflow.testing.jobs import new_job
from faceflow.testing.relay import FAST, job, write_failure, write_result
from tasks.errors import NoFaceFound
from webapi.config import Settings
from webapi.crud import NewUser
from webapi.jobstate import transition
from webapi.models import Job, JobStatus, Outbox
from webapi.relay import sync
from webapi.relay.context import Relay
from webapi.relay.runner import build_relay
from webapi.storage import LocalObjectStore


@pytest.fixture
def relay(engine: Engine, settings: Settings) -> Iterator[Relay]:
    store = LocalObjectStore(Path(settings.home) / "storage")
    instance = build_relay(settings, engine=engine, store=store, timings=FAST)
    yield instance
    instance.close()


def _running_in(engine: Engine, settings: Settings, user: NewUser, run_id: uuid.UUID) -> Job:
    """A job with a webhook for every end, running in the batch run ``run_id``."""
    created = new_job(
        engine,
        settings,
        user,
        callback_url="http://127.0.0.1:9/hook",
        callback_events=["job.succeeded", "job.failed", "job.cancelled"],
    )
    with Session(engine) as session:
        for to, expected, fields in (
            (JobStatus.queued, JobStatus.queued, {"flow_run_id": run_id, "attempts": 1}),
            (JobStatus.running, JobStatus.queued, {"stage": "started"}),
        ):
            assert transition(session, job_id=created.id, to=to, expected=expected, **fields)
    return job(engine, created.id)


def _webhooks(engine: Engine, job_id: uuid.UUID) -> list[str]:
    with Session(engine) as session:
        rows = session.exec(
            select(Outbox).where(col(Outbox.job_id) == job_id, col(Outbox.kind) == "webhook")
        ).all()
        return sorted(row.payload["event"] for row in rows)


def test_a_batch_runs_jobs_end_in_one_pass_and_one_transaction(
    relay: Relay, engine: Engine, settings: Settings, user: NewUser
) -> None:
    run_id = uuid.uuid4()
    done, also_done, failing, cancelled = (
        _running_in(engine, settings, user, run_id) for _ in range(4)
    )
    storage = Path(settings.home) / "storage"
    for stored in (done, also_done, cancelled):
        write_result(storage, str(stored.id), 1)
    write_failure(storage, str(failing.id), 1, NoFaceFound(), str(run_id))
    with Session(engine) as session:  # cancelled meanwhile (its run finished anyway)
        assert transition(
            session, job_id=cancelled.id, to=JobStatus.cancelled, expected=JobStatus.running
        )
    before = job(engine, cancelled.id)

    commits: list[object] = []

    def count(connection: object) -> None:
        commits.append(connection)

    event.listen(engine, "commit", count)
    try:
        relay.news.ended(str(run_id))
        assert sync.run_once(relay, read_runs=False) == 3
    finally:
        event.remove(engine, "commit", count)

    # One commit reads the watched jobs, one writes every outcome (one a job before).
    assert len(commits) == 2
    assert job(engine, done.id).status is JobStatus.succeeded
    assert job(engine, also_done.id).status is JobStatus.succeeded
    ended = job(engine, failing.id)
    assert ended.status is JobStatus.failed and ended.error_code == NoFaceFound.code
    assert job(engine, cancelled.id) == before, "left as it was"
    assert _webhooks(engine, done.id) == ["job.succeeded"]
    assert _webhooks(engine, also_done.id) == ["job.succeeded"]
    assert _webhooks(engine, failing.id) == ["job.failed"]
    assert _webhooks(engine, cancelled.id) == ["job.cancelled"]
    assert not relay.news.take_ended() and sync.run_once(relay, read_runs=False) == 0
