"""Regression (found by the fault suite, scenario 3): a relay SIGKILLed mid-dispatch held
its dispatch rows for the general 60 s lease, as long as the default queue timeout, so the
job being dispatched always expired. Dispatch rows are now leased for
``RelayTimings.dispatch_lease_s`` and another relay takes them over within the timeout."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

from sqlalchemy.engine import Engine
from sqlmodel import Session

from faceflow.testing.jobs import make_user
from faceflow.testing.relay import submit
from tests.webapi.conftest import make_settings
from webapi.models import utcnow
from webapi.prefect_api import PrefectAPI
from webapi.relay import dispatch, leases
from webapi.relay.context import Relay
from webapi.storage import LocalObjectStore


def test_a_dead_relays_dispatch_rows_are_taken_over_well_within_the_queue_timeout(
    engine: Engine, database_url: str, tmp_path: Path
) -> None:
    settings = make_settings(database_url, tmp_path)
    store = LocalObjectStore(tmp_path / "storage")
    job = submit(engine, settings, store, make_user(engine, settings))
    # Nothing listens there: the dead relay never gets as far as calling Prefect.
    dead = Relay(
        engine=engine, prefect=PrefectAPI("http://127.0.0.1:9/api"), store=store, settings=settings
    )
    try:
        [row] = dispatch.claim_due(dead)  # ... and the relay is SIGKILLed here
    finally:
        dead.close()
    assert row.job_id == job.id and row.lease_until is not None
    free_at = row.lease_until
    queue_deadline = job.queue_deadline_at
    # Another relay can claim the row with most of the job's queue time still left.
    assert (queue_deadline - free_at).total_seconds() > settings.default_queue_timeout_seconds / 2
    with Session(engine, expire_on_commit=False) as session:
        assert leases.claim(session, kinds=["dispatch"], owner="other", now=utcnow()) == []
        taken = leases.claim(
            session, kinds=["dispatch"], owner="other", now=free_at + timedelta(milliseconds=10)
        )
    assert [r.id for r in taken] == [row.id]
