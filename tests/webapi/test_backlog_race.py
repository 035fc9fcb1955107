"""Regression (found by the fault suite, scenario 8 on PostgreSQL): the global backlog
check (503) counted queued jobs in each submit's own transaction, and submits of
*different* users only locked their own user row, so a burst from many users all saw the
same backlog and were all admitted past the cap. The check must hold under concurrency."""

from __future__ import annotations

import threading
from pathlib import Path

from sqlalchemy.engine import Engine
from sqlmodel import Session

from faceflow.testing.jobs import make_user, source_jpeg, target_jpeg
from faceflow.testing.threads import run_threads
from tests.webapi.conftest import make_settings
from webapi import crud
from webapi.errors import Overloaded
from webapi.inputs import store_image
from webapi.models import JobCreate, JobStatus
from webapi.storage import LocalObjectStore

USERS = 12
CAP = 3


def test_a_burst_from_many_users_never_queues_past_the_backlog_cap(
    engine: Engine, database_url: str, tmp_path: Path
) -> None:
    settings = make_settings(database_url, tmp_path, max_backlog=CAP)
    store = LocalObjectStore(tmp_path / "storage")
    limits = settings.image_limits
    source = store_image(source_jpeg(), name="source", limits=limits, store=store)
    target = store_image(target_jpeg(), name="target", limits=limits, store=store)
    users = [make_user(engine, settings) for _ in range(USERS)]
    barrier = threading.Barrier(USERS)
    outcomes: list[str] = []
    lock = threading.Lock()

    def submit(user: crud.NewUser) -> None:
        create = JobCreate.model_validate({})
        barrier.wait()
        try:
            with Session(engine, expire_on_commit=False) as session:
                crud.submit_job(
                    session,
                    owner=user.user,
                    create=create,
                    source=source,
                    target=target,
                    settings=settings,
                )
            outcome = "created"
        except Overloaded:
            outcome = "503"
        with lock:
            outcomes.append(outcome)

    run_threads(submit, users)
    with Session(engine) as session:
        queued = crud.status_counts(session)[JobStatus.queued]
    assert sorted(outcomes) == ["503"] * (USERS - CAP) + ["created"] * CAP
    assert queued == CAP
