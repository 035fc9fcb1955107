"""20 concurrent duplicate submits against a real uvicorn server → exactly one job."""

from __future__ import annotations

import threading
import uuid
from collections import Counter

import httpx
import pytest
from sqlalchemy.engine import Engine
from sqlmodel import Session

from faceflow.testing.jobs import auth, job_body, jobs_of, make_user, outbox_of
from faceflow.testing.threads import run_threads
from webapi import crud
from webapi.config import Settings
from webapi.inputs import InputRef
from webapi.models import Job, JobCreate

CONCURRENCY = 20


def _race(
    url: str, bodies: list[dict[str, object]], headers: dict[str, str]
) -> list[httpx.Response]:
    barrier = threading.Barrier(len(bodies))
    responses: list[httpx.Response] = []
    lock = threading.Lock()

    def post(body: dict[str, object]) -> None:
        with httpx.Client(base_url=url, timeout=60) as client:
            barrier.wait()
            response = client.post("/v1/jobs", json=body, headers=headers)
        with lock:
            responses.append(response)

    run_threads(post, bodies)
    return responses


def test_concurrent_duplicates_create_one_job(
    live_url: str, engine: Engine, settings: Settings
) -> None:
    user = make_user(engine, settings, quota=CONCURRENCY)
    headers = {**auth(user), "Idempotency-Key": "checkout-7"}
    responses = _race(live_url, [job_body()] * CONCURRENCY, headers)
    codes = Counter(response.status_code for response in responses)
    assert codes == {202: 1, 200: CONCURRENCY - 1}, [
        r.text for r in responses if r.status_code >= 400
    ]
    assert len({response.json()["id"] for response in responses}) == 1
    [job] = jobs_of(engine, user.user.id)
    assert [row.kind for row in outbox_of(engine, job.id)] == ["dispatch"]


def test_concurrent_same_key_different_inputs_conflict(
    live_url: str, engine: Engine, settings: Settings
) -> None:
    user = make_user(engine, settings, quota=CONCURRENCY)
    headers = {**auth(user), "Idempotency-Key": "mixed"}
    bodies = [job_body(options={"identity_weight": 0.1 if i % 2 else 0.9}) for i in range(10)]
    responses = _race(live_url, bodies, headers)
    codes = Counter(response.status_code for response in responses)
    assert codes[202] == 1 and codes[200] == 4 and codes[409] == 5, codes
    [job] = jobs_of(engine, user.user.id)
    winners = {r.json()["id"] for r in responses if r.status_code in (200, 202)}
    assert winners == {str(job.id)}


def test_unique_constraint_backstops_a_missed_lookup(
    engine: Engine, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """If two submits ever pass the lookup together, the loser returns the winner's job."""
    user = make_user(engine, settings)
    first = new_job_with_key(engine, settings, user, "dup")
    real_lookup = crud._by_idempotency_key
    calls: list[str] = []

    def miss_once(session: Session, *, owner_id: uuid.UUID, key: str) -> Job | None:
        calls.append(key)
        return None if len(calls) == 1 else real_lookup(session, owner_id=owner_id, key=key)

    monkeypatch.setattr(crud, "_by_idempotency_key", miss_once)
    again = new_job_with_key(engine, settings, user, "dup", expect_created=False)
    assert again.id == first.id and len(calls) == 2
    assert len(jobs_of(engine, user.user.id)) == 1


def new_job_with_key(
    engine: Engine, settings: Settings, user: crud.NewUser, key: str, *, expect_created: bool = True
) -> Job:
    digest = "ab" * 32
    source = InputRef(name="source", digest=digest, key=f"inputs/ab/{digest}.jpeg")
    with Session(engine, expire_on_commit=False) as session:
        job, created = crud.submit_job(
            session,
            owner=user.user,
            create=JobCreate(),
            source=source,
            target=source,
            settings=settings,
            idempotency_key=key,
        )
    assert created is expect_created
    return job
