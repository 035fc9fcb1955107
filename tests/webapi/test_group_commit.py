"""Group commit of submits (``crud.submit_jobs`` and ``webapi.group_commit.GroupCommit``).

A batch must answer each submission exactly as if it had been submitted alone, in order:
replays and 409s by idempotency key (also between members of one batch), the owner's
quota and the global backlog counting what the batch already admitted, and a refusal of
one member never costs the others their job. Real SQLite and PostgreSQL.
"""

from __future__ import annotations

import threading
import uuid
from pathlib import Path

from sqlalchemy.engine import Engine
from sqlmodel import Session

from faceflow.testing.jobs import jobs_of, make_user, outbox_of
from faceflow.testing.threads import run_threads
from tests.webapi.conftest import make_settings
from webapi import crud
from webapi.errors import IdempotencyKeyReused, Overloaded, QuotaExceeded
from webapi.group_commit import GroupCommit
from webapi.inputs import InputRef
from webapi.models import JobCreate, JobStatus


def _inputs(tag: str = "") -> tuple[InputRef, InputRef]:
    digest = (uuid.uuid5(uuid.NAMESPACE_URL, f"source{tag}").hex * 2)[:64]
    other = (uuid.uuid5(uuid.NAMESPACE_URL, f"target{tag}").hex * 2)[:64]
    return (
        InputRef(name="source", digest=digest, key=f"inputs/{digest[:2]}/{digest}.jpeg"),
        InputRef(name="target", digest=other, key=f"inputs/{other[:2]}/{other}.jpeg"),
    )


def _submission(user: crud.NewUser, key: str | None = None, tag: str = "") -> crud.Submission:
    source, target = _inputs(tag)
    return crud.Submission(user.user, JobCreate.model_validate({}), source, target, key)


def test_a_batch_answers_each_member_as_if_alone(
    engine: Engine, database_url: str, tmp_path: Path
) -> None:
    settings = make_settings(database_url, tmp_path)
    alice = make_user(engine, settings, quota=3)
    bob = make_user(engine, settings, quota=10)
    batch = [
        _submission(alice, key="a"),  # new
        _submission(alice, key="a"),  # same key, same input: the job above
        _submission(alice, key="a", tag="other"),  # same key, other input: 409
        _submission(bob),  # new
        _submission(alice),  # new (alice's 2nd)
        _submission(alice),  # new (alice's 3rd)
        _submission(alice),  # over alice's quota of 3: 429
        _submission(bob, key="b"),  # new: alice's refusal costs bob nothing
    ]
    with Session(engine, expire_on_commit=False) as session:
        admissions = crud.submit_jobs(session, submissions=batch, settings=settings)
    outcomes = [
        type(a.error).__name__ if a.error else ("created" if a.created else "replay")
        for a in admissions
    ]
    assert outcomes == [
        "created",
        "replay",
        IdempotencyKeyReused.__name__,
        "created",
        "created",
        "created",
        QuotaExceeded.__name__,
        "created",
    ]
    assert admissions[1].job is not None and admissions[0].job is not None
    assert admissions[1].job.id == admissions[0].job.id
    created = [a.job.id for a in admissions if a.created and a.job is not None]
    stored = {job.id for job in jobs_of(engine)}
    assert stored == set(created) and len(created) == 5
    for job_id in created:  # each new job committed with its dispatch row
        assert [row.kind for row in outbox_of(engine, job_id)] == ["dispatch"]


def test_the_backlog_counts_what_the_batch_admitted(
    engine: Engine, database_url: str, tmp_path: Path
) -> None:
    settings = make_settings(database_url, tmp_path, max_backlog=3)
    users = [make_user(engine, settings) for _ in range(5)]
    with Session(engine, expire_on_commit=False) as session:
        admissions = crud.submit_jobs(
            session, submissions=[_submission(user) for user in users], settings=settings
        )
    assert [a.created for a in admissions] == [True, True, True, False, False]
    assert all(isinstance(a.error, Overloaded) for a in admissions[3:])
    with Session(engine) as session:
        assert crud.status_counts(session)[JobStatus.queued] == 3


def test_concurrent_submits_form_batches_and_all_commit(
    engine: Engine, database_url: str, tmp_path: Path
) -> None:
    settings = make_settings(database_url, tmp_path)
    users = [make_user(engine, settings, quota=100) for _ in range(4)]
    group_commit = GroupCommit(engine, settings)
    barrier = threading.Barrier(40)
    results: list[crud.Admission] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        user = users[i % len(users)]
        barrier.wait()
        key = "k0" if i % 5 == 0 else None
        admitted = group_commit.submit(_submission(user, key=key, tag=str(i))).result(60)
        with lock:
            results.append(admitted.admission)

    run_threads(one, range(40), timeout_s=120)
    group_commit.close()
    # key "k0" for i in {0, 5, ..., 35}: two threads per user (i % 4), with different
    # inputs → one job each and one idempotency conflict each → 36 jobs in all
    created = [a for a in results if a.created]
    conflicts = [a for a in results if isinstance(a.error, IdempotencyKeyReused)]
    assert len(results) == 40 and len(created) == 36 and len(conflicts) == 4
    assert len(jobs_of(engine)) == 36
    assert group_commit.admitted == 40
