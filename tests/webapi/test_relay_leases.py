"""Outbox leases on real SQLite and PostgreSQL: disjoint concurrent claims, expiry and
take-over, and writes conditional on still holding the lease."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from faceflow.testing.jobs import make_user, outbox_of
from faceflow.testing.relay import submit
from faceflow.testing.threads import run_threads
from tests.webapi.conftest import make_settings
from webapi.config import Settings
from webapi.models import Outbox, utcnow
from webapi.relay import leases
from webapi.storage import LocalObjectStore


@pytest.fixture
def settings(database_url: str, tmp_path: Path) -> Settings:
    return make_settings(database_url, tmp_path)


@pytest.fixture
def rows(engine: Engine, settings: Settings, tmp_path: Path) -> Iterator[list[uuid.UUID]]:
    """Twenty jobs, each with its due dispatch row; yields the row ids."""
    owner = make_user(engine, settings, quota=50)
    store = LocalObjectStore(tmp_path / "storage")
    jobs = [submit(engine, settings, store, owner).id for _ in range(20)]
    yield [outbox_of(engine, job_id)[0].id for job_id in jobs]


def claim(engine: Engine, owner: str, **kwargs: object) -> list[Outbox]:
    with Session(engine, expire_on_commit=False) as session:
        return leases.claim(session, kinds=["dispatch"], owner=owner, **kwargs)  # type: ignore[arg-type]


def test_a_leased_row_is_not_claimed_again_until_its_lease_expires(
    engine: Engine, rows: list[uuid.UUID]
) -> None:
    first = claim(engine, "a", limit=100, lease_s=30)
    assert sorted(row.id for row in first) == sorted(rows)
    assert all(row.lease_owner == "a" and row.lease_until for row in first)
    assert claim(engine, "b", limit=100) == []

    later = utcnow() + timedelta(seconds=31)  # replica a died: its leases run out
    taken = claim(engine, "b", limit=5, now=later)
    assert len(taken) == 5 and all(row.lease_owner == "b" for row in taken)
    with Session(engine) as session:
        assert not leases.finish(session, taken[0], owner="a")  # a lost it
        assert leases.finish(session, taken[0], owner="b")
        session.commit()
    with Session(engine) as session:
        assert not leases.finish(session, taken[0], owner="b")  # closed once
    with Session(engine) as session:
        assert leases.pending_count(session, kinds=["dispatch"]) == len(rows) - 1


def test_reschedule_counts_the_attempt_and_delays_the_row(
    engine: Engine, rows: list[uuid.UUID]
) -> None:
    [row] = claim(engine, "a", limit=1)
    with Session(engine) as session:
        assert leases.reschedule(session, row, owner="a", error="HTTP 503", delay_s=60)
        session.commit()
    [stored] = [r for r in outbox_of_rows(engine) if r.id == row.id]
    assert stored.attempts == 1 and stored.last_error == "HTTP 503" and stored.lease_owner is None
    assert stored.next_attempt_at > utcnow() + timedelta(seconds=55)
    assert row.id not in {r.id for r in claim(engine, "b", limit=100)}
    assert row.id in {r.id for r in claim(engine, "c", now=utcnow() + timedelta(seconds=61))}


def outbox_of_rows(engine: Engine) -> list[Outbox]:
    with Session(engine) as session:
        return list(session.exec(select(Outbox)))


def test_concurrent_claimers_get_disjoint_rows(engine: Engine, rows: list[uuid.UUID]) -> None:
    got: dict[str, list[uuid.UUID]] = {}
    barrier = threading.Barrier(4)

    def claimer(name: str) -> None:
        barrier.wait()
        mine: list[uuid.UUID] = []
        while batch := claim(engine, name, limit=3):
            mine += [row.id for row in batch]
        got[name] = mine

    run_threads(claimer, (f"r{i}" for i in range(4)), timeout_s=60)
    claimed = [row_id for ids in got.values() for row_id in ids]
    assert sorted(claimed) == sorted(rows)  # every row once, none twice


def test_backoff_grows_with_jitter_and_is_capped() -> None:
    delays = [leases.backoff_s(n, base_s=0.5, cap_s=30) for n in range(1, 12)]
    assert 0.25 <= delays[0] <= 0.5
    assert all(15 <= d <= 30 for d in delays[7:])
    assert len({round(leases.backoff_s(4), 6) for _ in range(20)}) > 1
