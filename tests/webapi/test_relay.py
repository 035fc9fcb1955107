"""The relay against a real Prefect server, on real SQLite and PostgreSQL job stores.

Flow runs are executed in-process by ``execute_run`` (a deterministic worker) or forced
into the states a crashed or stopped worker leaves behind. Each step is driven one pass at
a time except in the end-to-end test, which runs the relay's background threads.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy.engine import Engine
from sqlmodel import Session

from faceflow.testing.jobs import auth, job_body, make_user, outbox_of, source_jpeg, target_jpeg
from faceflow.testing.prefect import PrefectServer
from faceflow.testing.relay import (
    FAST,
    QUALITY,
    SCRIPT,
    CountingTransport,
    ReadCounter,
    body_json,
    execute_run,
    in_thread,
    job,
    receiver,
    submit,
    write_result,
)
from faceflow.testing.wait import wait_for
from faceflow.testing.webhooks import independent_verify
from flows.params import (
    FINAL_STAGE,
    FuseFacesParams,
    idempotency_key,
    result_error_key,
    result_key,
    video_parts_tag,
)
from tests.webapi.conftest import make_settings
from webapi import crud
from webapi.config import Settings
from webapi.main import create_app
from webapi.models import Job, JobStatus, Outbox, utcnow
from webapi.prefect_api import FlowRun, PrefectAPI, PrefectUnavailable, StateType
from webapi.relay import dispatch, expire, fetch_lane, reap, sync
from webapi.relay.context import Relay
from webapi.relay.metrics import METRICS
from webapi.relay.run_events import REREAD_AFTER_S
from webapi.relay.runner import build_relay, reconcile_once, start_relay, stop_relay
from webapi.relay.runs import plan_of
from webapi.storage import LocalObjectStore

pytestmark = pytest.mark.prefect


@pytest.fixture
def settings(database_url: str, tmp_path: Path, prefect_server: PrefectServer) -> Settings:
    return make_settings(database_url, tmp_path, prefect_api_url=prefect_server.api_url)


@pytest.fixture
def relay(engine: Engine, settings: Settings) -> Iterator[Relay]:
    store = LocalObjectStore(tmp_path_of(settings) / "storage")
    SCRIPT.storage_dir = store.basepath
    SCRIPT.behaviours.clear()
    instance = build_relay(settings, engine=engine, store=store, timings=FAST)
    yield instance
    instance.close()


@pytest.fixture
def owner(engine: Engine, settings: Settings) -> crud.NewUser:
    return make_user(engine, settings, quota=100)


def tmp_path_of(settings: Settings) -> Path:
    return Path(settings.home)


def dispatched(relay: Relay, owner: crud.NewUser, **fields: Any) -> uuid.UUID:
    """Submit a job and dispatch it; returns its id (job queued with a Scheduled run)."""
    new = submit(relay.engine, relay.settings, relay.store, owner, **fields)
    dispatch.run_once(relay)
    assert job(relay.engine, new.id).flow_run_id is not None
    return new.id


def running(
    relay: Relay, owner: crud.NewUser, server: PrefectServer, **fields: Any
) -> tuple[uuid.UUID, str]:
    """A dispatched job whose run a worker has started (then stopped reporting)."""
    job_id = dispatched(relay, owner, **fields)
    run_id = str(job(relay.engine, job_id).flow_run_id)
    server.rest.set_state(run_id, "RUNNING")
    sync.run_once(relay)
    assert job(relay.engine, job_id).status is JobStatus.running
    return job_id, run_id


def script_store(settings: Settings) -> LocalObjectStore:
    """The storage the stand-in flow and the relay share, under the settings' home."""
    store = LocalObjectStore(tmp_path_of(settings) / "storage")
    SCRIPT.storage_dir = store.basepath
    return store


def flow_run_of(relay: Relay, job_id: uuid.UUID) -> FlowRun:
    run_id = job(relay.engine, job_id).flow_run_id
    assert run_id is not None
    run = relay.prefect.read_flow_run(str(run_id))
    assert run is not None
    return run


# --------------------------------------------------------------------------- dispatch


def test_dispatch_creates_one_flow_run_per_attempt(
    relay: Relay, owner: crud.NewUser, prefect_server: PrefectServer
) -> None:
    new = submit(relay.engine, relay.settings, relay.store, owner)
    assert dispatch.run_once(relay) == 1

    stored = job(relay.engine, new.id)
    assert stored.status is JobStatus.queued and stored.attempts == 1
    runs = prefect_server.rest.runs_of_job(new.id)
    assert [r["id"] for r in runs] == [str(stored.flow_run_id)]
    run = runs[0]
    assert run["name"] == str(new.id)
    assert set(run["tags"]) >= {f"job:{new.id}", f"owner:{owner.user.id}"}
    assert run["idempotency_key"] == idempotency_key(str(new.id), 1)
    params = FuseFacesParams.model_validate(run["parameters"])
    assert (params.job_id, params.owner_id, params.attempt) == (str(new.id), str(owner.user.id), 1)
    assert params.source_key == stored.source_key and params.target_key == stored.target_key
    assert params.deadline_at == stored.deadline_at
    assert [row.outcome for row in outbox_of(relay.engine, new.id)] == ["done"]
    # Only the options the client set travel: the flow fills the rest from its
    # FusionSettings block (an operator's default detector, fuser, identity weight).
    assert run["parameters"]["options"] == {"identity_weight": 0.8}

    # The same attempt again (a relay that crashed before recording): Prefect returns the
    # same run; a stale dispatch row for an attempt already made is dropped.
    assert relay.prefect.create_flow_run(params).id == str(stored.flow_run_id)
    with Session(relay.engine) as session:
        session.add(Outbox(kind="dispatch", job_id=new.id, payload={"attempt": 1}))
        session.commit()
    dispatch.run_once(relay)
    assert len(prefect_server.rest.runs_of_job(new.id)) == 1
    assert outbox_of(relay.engine, new.id)[-1].outcome == "obsolete"


def test_a_job_without_options_leaves_every_option_to_the_flow(
    relay: Relay, owner: crud.NewUser, prefect_server: PrefectServer
) -> None:
    new = submit(relay.engine, relay.settings, relay.store, owner, options={})
    assert job(relay.engine, new.id).options == {}
    assert dispatch.run_once(relay) == 1
    [run] = prefect_server.rest.runs_of_job(new.id)
    assert run["parameters"]["options"] == {}


def test_prefect_down_job_stays_queued_then_dispatched(
    relay: Relay, owner: crud.NewUser, prefect_server: PrefectServer
) -> None:
    prefect_server.stop()
    try:
        new = submit(relay.engine, relay.settings, relay.store, owner)
        for _ in range(3):
            dispatch.run_once(relay)
            time.sleep(FAST.dispatch_backoff_cap_s)
        stored = job(relay.engine, new.id)
        assert stored.status is JobStatus.queued and stored.flow_run_id is None
        [row] = outbox_of(relay.engine, new.id)
        assert row.done_at is None and row.attempts == 1 and row.last_error
        assert relay.outage.active  # later passes only probe Prefect's health
        assert METRICS.value("faceflow_relay_dispatches_total", "retry") >= 1
        assert sync.run_once(relay) == 0 and reap.run_once(relay) == 0  # no crash while down
    finally:
        prefect_server.start()
    wait_for(lambda: dispatch.run_once(relay) > 0 and job(relay.engine, new.id).attempts == 1)
    assert len(prefect_server.rest.runs_of_job(new.id)) == 1


@pytest.fixture
def counted(engine: Engine, settings: Settings) -> Iterator[tuple[Relay, CountingTransport]]:
    """A relay whose Prefect requests are counted, with long row backoffs (20-30 s) and a
    short health probe (0.2 s): recovery within seconds shows rows made due, not waited."""
    timings = replace(
        FAST,
        dispatch_backoff_cap_s=30.0,
        dispatch_backoff_base_s=20.0,
        prefect_probe_interval_s=0.2,
    )
    transport = CountingTransport()
    relay = build_relay(
        settings,
        engine=engine,
        store=LocalObjectStore(tmp_path_of(settings) / "storage"),
        timings=timings,
        prefect=PrefectAPI(settings.prefect_api_url, transport=transport),
    )
    yield relay, transport
    relay.close()


@contextmanager
def prefect_down_warned_once(
    server: PrefectServer, caplog: pytest.LogCaptureFixture
) -> Iterator[None]:
    """Prefect stopped for the block (started again after it); the relay's logs during the
    block hold exactly one warning, whatever it tried."""
    server.stop()
    try:
        with caplog.at_level(logging.INFO, logger="webapi.relay"):
            yield
        warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) == 1, [r.getMessage() for r in warnings]
    finally:
        server.start()


def test_prefect_outage_defers_the_batch_after_one_try_and_recovery_makes_it_due(
    counted: tuple[Relay, CountingTransport],
    owner: crud.NewUser,
    prefect_server: PrefectServer,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Regression (fault suite, scenario 2): while Prefect was down every claimed row tried
    its own connection and logged a warning, and after the outage each row waited out its
    own backoff (up to 30 s) while its queue deadline ran, so jobs expired though Prefect was
    back. Now one failure defers the whole batch, and Prefect's recovery makes it due."""
    relay, transport = counted
    engine = relay.engine
    other = build_relay(  # a 2nd replica
        relay.settings, engine=engine, store=relay.store, timings=relay.timings
    )
    try:
        with prefect_down_warned_once(prefect_server, caplog):
            jobs = [submit(engine, relay.settings, relay.store, owner).id for _ in range(6)]
            assert dispatch.run_once(relay) == 6
            assert len(transport.sent) == 1  # one failed connection for six rows
            deferred = [r for j in jobs for r in outbox_of(engine, j)]
            assert all(r.lease_owner is None and r.done_at is None for r in deferred)
            assert all(r.next_attempt_at > utcnow() + timedelta(seconds=5) for r in deferred)
            assert dispatch.run_once(relay) == 0  # in the outage: nothing claimed ...
            time.sleep(0.5)
            assert dispatch.run_once(relay) == 0  # ... only the health probe is sent
            assert transport.sent[1:] == ["/api/health"]
            assert dispatch.run_once(other) == 0  # the other replica: nothing due
        back = time.monotonic()
        wait_for(
            lambda: (
                dispatch.run_once(relay) >= 0
                and all(job(engine, j).flow_run_id is not None for j in jobs)
            ),
            timeout_s=10,
        )
        assert time.monotonic() - back < 5  # not after the rows' 10-20 s backoff
        assert not relay.outage.active
        assert all(len(prefect_server.rest.runs_of_job(j)) == 1 for j in jobs)
        assert all([r.outcome for r in outbox_of(engine, j)] == ["done"] for j in jobs)
    finally:
        other.close()


def test_cancels_wait_out_a_prefect_outage_with_one_try_and_go_at_recovery(
    counted: tuple[Relay, CountingTransport],
    owner: crud.NewUser,
    prefect_server: PrefectServer,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``cancel_run`` rows follow dispatch's outage handling: while Prefect was down each row
    tried its own connection and waited out its own backoff afterwards. Now one failure
    defers the batch, nothing is claimed while the outage lasts, and recovery makes the
    rows due at once."""
    relay, transport = counted
    engine = relay.engine
    jobs = [dispatched(relay, owner) for _ in range(4)]
    with Session(engine, expire_on_commit=False) as session:
        for job_id in jobs:
            assert (
                crud.cancel_job(session, owner=owner.user, job_id=job_id).status
                is JobStatus.cancelled
            )
    runs = [str(job(engine, j).flow_run_id) for j in jobs]
    with prefect_down_warned_once(prefect_server, caplog):
        sent_before = len(transport.sent)
        assert reap.cancel_runs(relay) == 4
        assert len(transport.sent) == sent_before + 1  # one failed call for 4 rows
        assert relay.outage.active
        rows = [r for j in jobs for r in outbox_of(engine, j) if r.kind == "cancel_run"]
        assert len(rows) == 4
        assert all(r.done_at is None and r.lease_owner is None for r in rows)
        assert all(r.next_attempt_at > utcnow() + timedelta(seconds=5) for r in rows)
        assert reap.cancel_runs(relay) == 0  # nothing claimed in the outage
        assert len(transport.sent) == sent_before + 1
    back = time.monotonic()
    wait_for(lambda: dispatch.run_once(relay) >= 0 and not relay.outage.active, timeout_s=10)
    assert reap.cancel_runs(relay) == 4  # due at once, not after their 20-30 s backoff
    assert time.monotonic() - back < 5
    for run_id in runs:
        run = relay.prefect.read_flow_run(run_id)
        assert run is not None and run.state_type is StateType.CANCELLED
    done = [r for j in jobs for r in outbox_of(engine, j) if r.kind == "cancel_run"]
    assert [r.outcome for r in done] == ["done"] * 4


def test_dispatch_rejected_by_prefect_fails_the_job(relay: Relay, owner: crud.NewUser) -> None:
    """Prefect refuses the run (422: its pool's job template needs a variable the relay does
    not send): the job fails with ``dispatch_rejected``, with no run."""
    strict = PrefectAPI(relay.settings.prefect_api_url, flow_name="fuse-faces-strict")
    strict_relay = replace(relay, prefect=strict)
    new = submit(relay.engine, relay.settings, relay.store, owner)
    dispatch.run_once(strict_relay)
    stored = job(relay.engine, new.id)
    assert stored.status is JobStatus.failed and stored.error_code == "dispatch_rejected"
    [row] = [r for r in outbox_of(relay.engine, new.id) if r.kind == "dispatch"]
    assert "422" in (row.last_error or "") and "gpu_index" in (row.last_error or "")
    assert stored.flow_run_id is None
    strict.close()


def test_url_input_is_fetched_by_the_fetch_lane_then_dispatched(
    relay: Relay, owner: crud.NewUser
) -> None:
    photo = source_jpeg()
    with receiver() as server:
        server.files["/start"] = (302, {"location": "/hop"}, b"")
        server.files["/hop"] = (307, {"location": f"{server.url}/photo.jpg"}, b"")
        server.files["/photo.jpg"] = (200, {"content-type": "image/jpeg"}, photo)
        server.files["/meta"] = (302, {"location": "http://169.254.169.254/latest"}, b"")
        good = submit(
            relay.engine, relay.settings, relay.store, owner, source_url=f"{server.url}/start"
        )
        blocked = submit(
            relay.engine, relay.settings, relay.store, owner, source_url=f"{server.url}/meta"
        )
        assert dispatch.run_once(relay) == 0  # not dispatch's: the fetch lane's
        assert server.requests == []
        assert fetch_lane.run_once(relay) == 2
        assert dispatch.run_once(relay) == 1
        asked = [r.path for r in server.requests]

    fetched = job(relay.engine, good.id)
    assert fetched.flow_run_id is not None and fetched.source_key is not None
    assert relay.store.get(fetched.source_key) == photo
    assert flow_run_of(relay, good.id).parameters["source_key"] == fetched.source_key
    refused = job(relay.engine, blocked.id)
    assert refused.status is JobStatus.failed and refused.error_code == "input_fetch_failed"
    assert asked.count("/meta") == 1 and "/latest" not in asked  # never followed


# --------------------------------------------------------------------------- sync


def test_sync_maps_completed_failed_cancelled_and_running(
    relay: Relay, owner: crud.NewUser, prefect_server: PrefectServer
) -> None:
    ok, bad, stopped, busy, staged = (dispatched(relay, owner) for _ in range(5))
    SCRIPT.behaviours[str(bad)] = "fail"
    assert execute_run(str(job(relay.engine, ok).flow_run_id)) == "COMPLETED"
    assert execute_run(str(job(relay.engine, bad).flow_run_id)) == "FAILED"
    prefect_server.rest.set_state(str(job(relay.engine, stopped).flow_run_id), "CANCELLED")
    prefect_server.rest.set_state(
        str(job(relay.engine, busy).flow_run_id), "RUNNING", "stage: detect"
    )
    staged_run = str(job(relay.engine, staged).flow_run_id)
    prefect_server.rest.set_state(staged_run, "RUNNING")
    prefect_server.rest.report_progress(staged_run, "Stage 4/6: fuse (attempt 1).")

    assert sync.run_once(relay) == 5
    done = job(relay.engine, ok)
    assert done.status is JobStatus.succeeded and done.started_at and done.finished_at
    assert done.stage == FINAL_STAGE  # never a stage the lagging progress artifact named
    assert (done.result_key, done.result_content_type) == (
        result_key(str(ok), 1, "png"),
        "image/png",
    )
    assert (done.result_width, done.result_height, done.timings) == (24, 16, {"fuse": 1.5})
    assert done.quality == QUALITY.as_json()  # copied from the result's sidecar
    failed = job(relay.engine, bad)
    assert failed.status is JobStatus.failed and failed.error_code == "no_face_found"
    assert failed.error_message == "No face was found in the image."
    # Cancelled without a cancel request and with no outcome of its own: a lost run.
    lost = job(relay.engine, stopped)
    assert lost.status is JobStatus.queued and lost.flow_run_id is None
    assert ("dispatch", 2) in [
        (r.kind, r.payload.get("attempt")) for r in outbox_of(relay.engine, stopped)
    ]
    running = job(relay.engine, busy)
    assert running.status is JobStatus.running and running.stage == "detect"
    assert job(relay.engine, staged).stage == "fuse"
    prefect_server.rest.report_progress(staged_run, "Stage 5/6: postprocess (attempt 1).")
    assert sync.run_once(relay) == 1 and job(relay.engine, staged).stage == "postprocess"
    assert sync.run_once(relay) == 0  # nothing new


def test_a_failure_record_with_an_unknown_code_fails_the_job_with_the_fallback(
    relay: Relay, owner: crud.NewUser, prefect_server: PrefectServer
) -> None:
    """A ``JobFailure`` whose code this version does not list (written by a newer flow) is
    still the job's outcome: failed ``internal_error`` with that code's public message, not
    a lost run; the run's state message, which names the code, is not read."""
    job_id = dispatched(relay, owner)
    run_id = str(job(relay.engine, job_id).flow_run_id)
    record = {"code": "code_of_a_newer_flow", "message": "internal detail", "flow_run_id": run_id}
    relay.store.put(result_error_key(str(job_id), 1), json.dumps(record).encode())
    prefect_server.rest.set_state(run_id, "FAILED", "[code_of_a_newer_flow] internal detail")

    assert sync.run_once(relay) == 1
    failed = job(relay.engine, job_id)
    assert (failed.status, failed.attempts) == (JobStatus.failed, 1)
    assert (failed.error_code, failed.error_message) == ("internal_error", "The job failed.")


def test_stale_flow_run_late_result_is_ignored(
    relay: Relay, owner: crud.NewUser, prefect_server: PrefectServer
) -> None:
    job_id, first = running(relay, owner, prefect_server)
    prefect_server.rest.set_state(first, "CRASHED")
    assert reap.run_once(relay) >= 1
    dispatch.run_once(relay)
    second = str(job(relay.engine, job_id).flow_run_id)
    assert second != first and job(relay.engine, job_id).attempts == 2

    # Attempt 1's zombie finishes now, with a result of its own: nothing changes.
    write_result(SCRIPT.storage(), str(job_id), 1)
    prefect_server.rest.set_state(first, "COMPLETED")
    sync.run_once(relay)
    stale = job(relay.engine, job_id)
    assert stale.status is JobStatus.queued and stale.result_key is None

    assert execute_run(second) == "COMPLETED"
    sync.run_once(relay)
    final = job(relay.engine, job_id)
    assert final.status is JobStatus.succeeded
    assert final.result_key == result_key(str(job_id), 2, "png")


def test_an_ended_runs_event_settles_its_job_from_storage_fenced_on_the_run(
    relay: Relay, owner: crud.NewUser, prefect_server: PrefectServer
) -> None:
    """A run that an event said ended settles its job from the stored outcome before the
    runs are read (Prefect still shows it RUNNING here, as when the event outruns the
    state's commit); a run the job does not hold, and a job not yet marked started, are
    left to the read of the runs."""
    job_id, first = running(relay, owner, prefect_server)
    prefect_server.rest.set_state(first, "CRASHED")
    assert reap.run_once(relay) >= 1
    dispatch.run_once(relay)
    second = str(job(relay.engine, job_id).flow_run_id)
    prefect_server.rest.set_state(second, "RUNNING")
    assert sync.run_once(relay) == 1 and job(relay.engine, job_id).status is JobStatus.running
    started_at = job(relay.engine, job_id).started_at
    unstarted = dispatched(relay, owner)
    unstarted_run = str(job(relay.engine, unstarted).flow_run_id)
    write_result(SCRIPT.storage(), str(unstarted), 1)

    # Attempt 1's zombie "ends" with a result of its own: not the run the job holds.
    write_result(SCRIPT.storage(), str(job_id), 1)
    for run_id in (first, str(uuid.uuid4()), unstarted_run):
        relay.news.ended(run_id)
    assert sync.run_once(relay) == 0
    assert job(relay.engine, job_id).status is JobStatus.running
    assert job(relay.engine, unstarted).status is JobStatus.queued

    write_result(SCRIPT.storage(), str(job_id), 2)
    relay.news.ended(second)
    assert sync.run_once(relay, read_runs=False) == 1
    done = job(relay.engine, job_id)
    assert done.status is JobStatus.succeeded and done.stage == FINAL_STAGE
    assert done.result_key == result_key(str(job_id), 2, "png")
    assert done.started_at == started_at and done.finished_at is not None
    assert relay.prefect.read_flow_run(second).state_type is StateType.RUNNING  # type: ignore[union-attr]
    assert sync.run_once(relay) == 0 and not relay.news.take_ended()


def test_a_running_event_starts_its_job_at_the_events_time_without_a_rest_read(
    engine: Engine, settings: Settings, owner: crud.NewUser, prefect_server: PrefectServer
) -> None:
    """A RUNNING event marks its queued job running (stage "started", ``started_at`` the
    event's time) from the job store alone: no flow-run or artifact read reaches Prefect.
    The event of a run the job no longer holds (a re-dispatched job's first run) writes
    nothing; a run no job holds yet is looked for again after the re-read delay."""
    reads = ReadCounter()
    prefect = PrefectAPI(settings.prefect_api_url, transport=reads)
    relay = build_relay(
        settings, engine=engine, prefect=prefect, store=script_store(settings), timings=FAST
    )
    job_id, first = running(relay, owner, prefect_server)
    prefect_server.rest.set_state(first, "CRASHED")
    assert reap.run_once(relay) >= 1
    dispatch.run_once(relay)
    second = str(job(relay.engine, job_id).flow_run_id)
    queued = job(relay.engine, job_id)
    assert queued.status is JobStatus.queued and second != first
    before = reads.reads

    relay.news.started(first, utcnow())  # the stale run: it is not the job's run any more
    assert sync.run_once(relay, read_runs=False) == 0
    assert job(relay.engine, job_id).updated_at == queued.updated_at
    fresh = dispatched(relay, owner)
    fresh_run = str(job(relay.engine, fresh).flow_run_id)
    unknown = str(uuid.uuid4())
    at = utcnow() - timedelta(seconds=3)
    for run_id in (unknown, fresh_run, second):
        relay.news.started(run_id, at)
    assert sync.run_once(relay, read_runs=False) == 2
    started = job(relay.engine, fresh)
    assert started.status is JobStatus.running and started.stage == "started"
    assert started.started_at == at
    again = job(relay.engine, job_id)  # its first attempt's start stays the job's start
    assert again.status is JobStatus.running and again.started_at == queued.started_at
    assert reads.reads == before, "decided from the events alone"
    time.sleep(REREAD_AFTER_S[0])
    again_ids = {noted.run_id for noted in relay.news.take_started()}
    assert unknown in again_ids and not again_ids & {fresh_run, second}, "looked for again"


# --------------------------------------------------------------------------- expire


def test_expire_without_creating_a_flow_run(
    relay: Relay, owner: crud.NewUser, prefect_server: PrefectServer
) -> None:
    new = submit(relay.engine, relay.settings, relay.store, owner, queue_timeout_seconds=1)
    time.sleep(1.1)
    assert dispatch.run_once(relay) == 1  # too late: deferred, no run created
    assert expire.run_once(relay) == 1
    stored = job(relay.engine, new.id)
    assert stored.status is JobStatus.expired and stored.error_code == "queue_timeout"
    assert stored.flow_run_id is None and prefect_server.rest.runs_of_job(new.id) == []
    assert all(row.done_at for row in outbox_of(relay.engine, new.id))


def test_expire_cancels_a_scheduled_flow_run(
    relay: Relay, owner: crud.NewUser, prefect_server: PrefectServer
) -> None:
    job_id = dispatched(relay, owner, queue_timeout_seconds=1)
    time.sleep(1.1)
    assert expire.run_once(relay) == 1
    assert job(relay.engine, job_id).status is JobStatus.expired
    reap.run_once(relay)  # processes the cancel_run row
    assert flow_run_of(relay, job_id).state_type is StateType.CANCELLED


# --------------------------------------------------------------------------- reap


def test_reap_crashed_run_redispatches_then_stops_at_max_attempts(
    relay: Relay, owner: crud.NewUser, prefect_server: PrefectServer
) -> None:
    job_id = dispatched(relay, owner)
    for attempt in (1, 2):
        run = flow_run_of(relay, job_id)
        assert run.idempotency_key == idempotency_key(str(job_id), attempt)
        prefect_server.rest.set_state(run.id, "RUNNING")
        sync.run_once(relay)
        assert job(relay.engine, job_id).status is JobStatus.running
        prefect_server.rest.set_state(run.id, "CRASHED")
        assert reap.run_once(relay) >= 1
        dispatch.run_once(relay)

    final = job(relay.engine, job_id)
    assert final.status is JobStatus.failed and final.error_code == "worker_lost"
    assert final.attempts == 2 and len(prefect_server.rest.runs_of_job(job_id)) == 2
    kinds = [(row.kind, row.payload.get("attempt")) for row in outbox_of(relay.engine, job_id)]
    assert kinds.count(("dispatch", 2)) == 1 and ("dispatch", 3) not in kinds


def test_reap_lost_run_redispatches(
    relay: Relay, owner: crud.NewUser, prefect_server: PrefectServer
) -> None:
    job_id = dispatched(relay, owner)
    prefect_server.rest.delete_run(str(job(relay.engine, job_id).flow_run_id))
    assert reap.run_once(relay) >= 1
    dispatch.run_once(relay)
    stored = job(relay.engine, job_id)
    assert stored.status is JobStatus.queued and stored.attempts == 2
    assert [r["idempotency_key"] for r in prefect_server.rest.runs_of_job(job_id)] == [
        idempotency_key(str(job_id), 2)
    ]


def test_reap_running_past_deadline_fails_and_cancels_the_run(
    relay: Relay, owner: crud.NewUser, prefect_server: PrefectServer
) -> None:
    job_id, run_id = running(relay, owner, prefect_server, deadline_seconds=1)
    time.sleep(1 + FAST.running_grace_s + 0.1)
    assert reap.run_once(relay) >= 1
    stored = job(relay.engine, job_id)
    assert stored.status is JobStatus.failed and stored.error_code == "deadline_exceeded"
    reap.run_once(relay)  # the cancel_run row
    assert relay.prefect.read_flow_run(run_id).state_type is StateType.CANCELLING  # type: ignore[union-attr]


def test_cancel_running_job_then_scheduled_job(
    relay: Relay, owner: crud.NewUser, prefect_server: PrefectServer
) -> None:
    (busy, busy_run), waiting = running(relay, owner, prefect_server), dispatched(relay, owner)
    with Session(relay.engine, expire_on_commit=False) as session:
        assert (
            crud.cancel_job(session, owner=owner.user, job_id=busy).status
            is JobStatus.cancel_requested
        )
        assert (
            crud.cancel_job(session, owner=owner.user, job_id=waiting).status is JobStatus.cancelled
        )

    reap.run_once(relay)
    assert relay.prefect.read_flow_run(busy_run).state_type is StateType.CANCELLING  # type: ignore[union-attr]
    assert flow_run_of(relay, waiting).state_type is StateType.CANCELLED
    assert job(relay.engine, busy).status is JobStatus.cancel_requested
    prefect_server.rest.set_state(busy_run, "CANCELLED")  # the worker stopped the process
    sync.run_once(relay)
    assert job(relay.engine, busy).status is JobStatus.cancelled


def test_cancel_stops_the_video_parts_of_the_cancelled_attempt_only(
    relay: Relay, owner: crud.NewUser, prefect_server: PrefectServer
) -> None:
    """A video attempt's ``fuse-video-part`` runs carry its tag: a cancel stops them with
    its coordinator (running → Cancelling, not started → Cancelled), not another attempt's."""
    job_id, run_id = running(relay, owner, prefect_server)
    flow_id = prefect_server.rest.run(run_id)["flow_id"]

    def part(attempt: int, state: str) -> str:
        return prefect_server.rest.run_in(flow_id, state, [video_parts_tag(str(job_id), attempt)])

    busy, waiting, other = part(1, "RUNNING"), part(1, "SCHEDULED"), part(2, "RUNNING")
    done = part(1, "COMPLETED")
    with Session(relay.engine) as session:
        crud.cancel_job(session, owner=owner.user, job_id=job_id)
    reap.run_once(relay)
    states = prefect_server.rest.state_types((busy, waiting, other, done))
    assert states == {busy: "CANCELLING", waiting: "CANCELLED", other: "RUNNING", done: "COMPLETED"}


def test_a_cancel_never_overwrites_what_the_run_did_after_it_was_read(
    relay: Relay, owner: crud.NewUser, prefect_server: PrefectServer
) -> None:
    """A cancel reads a run, then proposes its cancel: a run that ended or started in
    between is cancelled by its new state, and an end is never overwritten (a forced
    Cancelling over a part that had just completed left it Cancelling for ever: CI)."""
    _job_id, run_id = running(relay, owner, prefect_server)
    flow_id = prefect_server.rest.run(run_id)["flow_id"]

    run_in = partial(prefect_server.rest.run_in, flow_id)
    ended, started, claimed = run_in("RUNNING"), run_in("SCHEDULED"), run_in("SCHEDULED")
    waiting = run_in("SCHEDULED")
    runs = (ended, started, claimed, waiting)
    stale = relay.prefect.read_flow_runs(runs)
    prefect_server.rest.set_state(ended, "COMPLETED")  # each moves on after the read
    prefect_server.rest.set_state(started, "RUNNING")
    prefect_server.rest.set_state(claimed, "PENDING")
    cancel = relay.prefect.cancel_flow_run
    assert cancel(stale[ended], message="late") is StateType.COMPLETED
    assert cancel(stale[started], message="late") is StateType.CANCELLING
    assert cancel(stale[claimed], message="late") is StateType.CANCELLING
    assert cancel(stale[waiting], message="late") is StateType.CANCELLED  # no worker has it
    assert prefect_server.rest.state_types(runs) == {
        ended: "COMPLETED",
        started: "CANCELLING",
        claimed: "CANCELLING",
        waiting: "CANCELLED",
    }


def test_a_crashed_video_coordinators_parts_are_cancelled_and_the_job_runs_again(
    relay: Relay, owner: crud.NewUser, prefect_server: PrefectServer
) -> None:
    """A video attempt's parts outlive its coordinator: when the coordinator's run crashes
    (its control-pool process killed) the relay re-dispatches the job and cancels the
    fenced attempt's parts, though the crashed run itself needs no cancel."""
    job_id, run_id = running(relay, owner, prefect_server)
    with Session(relay.engine) as session:  # a video job as the relay sees it
        stored = session.get(Job, job_id)
        assert stored is not None
        stored.media = "video"
        session.add(stored)
        session.commit()
    flow_id = prefect_server.rest.run(run_id)["flow_id"]

    def part(state: str) -> str:
        return prefect_server.rest.run_in(flow_id, state, [video_parts_tag(str(job_id), 1)])

    busy, claimed, waiting = part("RUNNING"), part("PENDING"), part("SCHEDULED")
    prefect_server.rest.set_state(run_id, "CRASHED")
    assert reap.run_once(relay) >= 1
    assert job(relay.engine, job_id).status is JobStatus.queued
    reap.run_once(relay)  # the cancel_run row
    runs = (busy, claimed, waiting, run_id)
    # a claimed part is left to its worker (a Cancelled one could still start); no worker
    # holds a scheduled one
    assert prefect_server.rest.state_types(runs) == {
        busy: "CANCELLING",
        claimed: "CANCELLING",
        waiting: "CANCELLED",
        run_id: "CRASHED",
    }


def test_cancel_that_never_stops_is_forced_after_grace(
    relay: Relay, owner: crud.NewUser, prefect_server: PrefectServer
) -> None:
    job_id, run_id = running(relay, owner, prefect_server)
    with Session(relay.engine) as session:
        crud.cancel_job(session, owner=owner.user, job_id=job_id)
    reap.run_once(relay)
    time.sleep(FAST.cancel_grace_s + 0.1)
    reap.run_once(relay)
    assert job(relay.engine, job_id).status is JobStatus.cancelled
    assert relay.prefect.read_flow_run(run_id).state_type is StateType.CANCELLED  # type: ignore[union-attr]


# --------------------------------------------------------------------------- replicas


class CountingPrefect(PrefectAPI):
    """A real client that records, per job, the flow runs it created and whether two
    replicas were ever creating the same job's run at the same time."""

    created: dict[str, int]
    in_flight: set[str]
    overlaps: list[str]
    lock = threading.Lock()

    def create_flow_run(self, params: FuseFacesParams, **kwargs: object) -> FlowRun:  # type: ignore[override]
        with self.lock:
            if params.job_id in self.in_flight:
                self.overlaps.append(params.job_id)
            self.in_flight.add(params.job_id)
        try:
            run = super().create_flow_run(params)
        finally:
            with self.lock:
                self.in_flight.discard(params.job_id)
        with self.lock:
            self.created[params.job_id] = self.created.get(params.job_id, 0) + 1
        return run


def test_two_relays_never_double_dispatch(relay: Relay, owner: crud.NewUser) -> None:
    created: dict[str, int] = {}
    in_flight: set[str] = set()
    overlaps: list[str] = []
    replicas = []
    for _ in range(2):
        client = CountingPrefect(relay.settings.prefect_api_url)
        client.created, client.in_flight, client.overlaps = created, in_flight, overlaps
        replicas.append(
            replace(
                relay,
                prefect=client,
                owner=f"replica-{uuid.uuid4().hex[:6]}",
                timings=replace(FAST, batch=5),
            )
        )
    jobs = [submit(relay.engine, relay.settings, relay.store, owner).id for _ in range(30)]
    stop = threading.Event()
    handled: dict[str, int] = {}

    def loop(replica: Relay) -> None:
        while not stop.is_set():
            handled[replica.owner] = handled.get(replica.owner, 0) + dispatch.run_once(replica)

    threads = [in_thread(partial(loop, r), f"replica-{i}") for i, r in enumerate(replicas)]
    wait_for(lambda: all(job(relay.engine, j).flow_run_id for j in jobs), timeout_s=60)
    stop.set()
    for thread in threads:
        thread.join(10)
    for replica in replicas:
        replica.prefect.close()
    # Prefect's SQLite server answers some concurrent writes 503: those rows back off and
    # are retried, but no job's run is ever being created by two replicas at once.
    assert overlaps == []
    assert created == {str(j): 1 for j in jobs}
    assert all(count > 0 for count in handled.values()), handled  # both took work


# --------------------------------------------------------------------------- end to end


def test_relay_threads_end_to_end_with_signed_webhook(
    relay: Relay, owner: crud.NewUser, prefect_server: PrefectServer
) -> None:
    with receiver() as hooks:
        runner = start_relay(relay=relay)
        try:
            new = submit(
                relay.engine,
                relay.settings,
                relay.store,
                owner,
                callback_url=f"{hooks.url}/hook",
                callback_events=["job.running", "job.succeeded"],
            )
            runner.wake()
            wait_for(lambda: job(relay.engine, new.id).flow_run_id is not None)
            run_id = str(job(relay.engine, new.id).flow_run_id)
            finished: list[float] = []

            def worker() -> None:
                execute_run(run_id)
                finished.append(time.monotonic())

            in_thread(worker, "worker").join(60)
            wait_for(lambda: job(relay.engine, new.id).status is JobStatus.succeeded)
            lag = time.monotonic() - finished[0]
            assert lag < 2.0, f"succeeded {lag:.2f} s after the run finished"
            wait_for(lambda: "job.succeeded" in {body_json(p)["type"] for p in hooks.posts()})
        finally:
            stop_relay()
    ids: dict[str, set[str]] = {}
    for post in hooks.posts():
        assert independent_verify(owner.webhook_secret, post.headers, post.body)
        ids.setdefault(body_json(post)["type"], set()).add(post.headers["webhook-id"])
    assert all(len(found) == 1 for found in ids.values())  # one webhook-id per event
    assert body_json(hooks.posts()[-1])["data"]["id"] == str(new.id)
    assert "faceflow_relay_dispatches_total" in METRICS.render()


def test_reconcile_once_runs_every_step(relay: Relay, owner: crud.NewUser) -> None:
    new = submit(relay.engine, relay.settings, relay.store, owner)
    counts = reconcile_once(relay=relay)
    assert set(counts) == {"fetch", "dispatch", "sync", "expire", "reap", "notify"}
    assert counts["dispatch"] == 1 and job(relay.engine, new.id).flow_run_id is not None


def test_app_lifespan_runs_the_relay_in_process(
    engine: Engine, settings: Settings, owner: crud.NewUser
) -> None:
    """The API with ``run_relay``: submit over HTTP, the in-process relay dispatches at once
    (woken by the submit), a worker runs the flow, and GET shows the result."""
    app_settings = settings.model_copy(update={"run_relay": True})
    SCRIPT.storage_dir = Path(app_settings.storage_url.removeprefix("file://"))
    with TestClient(create_app(app_settings)) as client:
        response = client.post("/v1/jobs", json=job_body(), headers=auth(owner))
        assert response.status_code == 202, response.text
        job_id = uuid.UUID(response.json()["id"])
        waited = wait_for(lambda: job(engine, job_id).flow_run_id is not None)
        assert waited < 2.0  # woken, not waiting for a poll interval
        run_id = str(job(engine, job_id).flow_run_id)
        in_thread(partial(execute_run, run_id), "worker").join(60)

        def shown() -> dict[str, Any]:
            return dict(client.get(f"/v1/jobs/{job_id}", headers=auth(owner)).json())

        wait_for(lambda: shown()["status"] == "succeeded", timeout_s=5)
        assert shown()["result"]["content_type"] == "image/png" and shown()["attempts"] == 1
        metrics = client.get("/metrics").text
        assert "faceflow_dispatch_lag_seconds_count" in metrics


def test_the_real_fuse_faces_flow_accepts_the_relays_parameters(
    relay: Relay, owner: crud.NewUser, prefect_server: PrefectServer
) -> None:
    """Contract check: a deployment of ``flows.fuse.fuse_faces`` (parameter schema
    enforced) takes what dispatch sends; the run is cancelled, never executed."""
    from flows.fuse import fuse_faces

    deployment: Any = fuse_faces.to_deployment(name="relay-contract")  # sync in a sync test
    deployment.apply()
    real = PrefectAPI(relay.settings.prefect_api_url, deployment_name="relay-contract")
    try:
        new = submit(relay.engine, relay.settings, relay.store, owner)
        dispatch.run_once(replace(relay, prefect=real))
        stored = job(relay.engine, new.id)
        assert stored.status is JobStatus.queued and stored.flow_run_id is not None
        run = real.read_flow_run(str(stored.flow_run_id))
        assert run is not None and run.parameters["job_id"] == str(new.id)
        assert real.cancel_flow_run(run, message="contract test") is StateType.CANCELLED
    finally:
        real.close()


def test_a_mapped_job_dispatches_alone_with_its_extra_images(
    relay: Relay, owner: crud.NewUser, prefect_server: PrefectServer
) -> None:
    from webapi.inputs import store_image
    from webapi.models import JobCreate
    from webapi.relay import batches

    limits = relay.settings.image_limits
    source = store_image(source_jpeg(), name="source", limits=limits, store=relay.store)
    other = store_image(target_jpeg(), name="sources[1]", limits=limits, store=relay.store)
    create = JobCreate.model_validate(
        {"options": {"mapping": [{"source": 0, "target": 0}, {"source": 1, "reference": 0}]}}
    )
    with Session(relay.engine, expire_on_commit=False) as session:
        mapped, _ = crud.submit_job(
            session,
            owner=owner.user,
            create=create,
            source=source,
            target=other,
            settings=relay.settings,
            extra_sources=[other],
            references=[source],
        )
    plain, plain_too = (submit(relay.engine, relay.settings, relay.store, owner) for _ in "ab")
    plans = [
        (Outbox(kind="dispatch", job_id=j.id), plan_of(job(relay.engine, j.id), 1))
        for j in (mapped, plain, plain_too)
    ]
    chunks = {frozenset(p.job_id for p in c.plans) for c in batches.group(plans, 8)}
    assert chunks == {frozenset({mapped.id}), frozenset({plain.id, plain_too.id})}

    assert dispatch.run_once(relay) == 3
    [run] = prefect_server.rest.runs_of_job(mapped.id)
    params = FuseFacesParams.model_validate(run["parameters"])
    assert params.extra_source_keys == [other.key] and params.reference_keys == [source.key]
    assert [m.model_dump() for m in params.options.mapping] == [
        {"source": 0, "target": 0, "reference": None},
        {"source": 1, "target": None, "reference": 0},
    ]
    [plain_run] = prefect_server.rest.runs_of_job(plain.id)
    assert FuseFacesParams.model_validate(plain_run["parameters"]).extra_source_keys == []


def test_a_busy_prefect_is_asked_again_before_it_counts_as_an_outage() -> None:
    """Prefect on SQLite answers 503 for tens of milliseconds while a burst of writes holds
    its database (a run ending): the relay asks again after 50 and 150 ms; only a 503 that
    outlasts both pauses dispatch (issue 24: a job submitted right after another one ended
    waited out the 1 s outage probe). The server is a stand-in here because a real one
    cannot be made busy on cue."""
    answers = iter([503, 503, 201])
    seen: list[float] = []

    def busy_then_free(request: httpx.Request) -> httpx.Response:
        seen.append(time.monotonic())
        return httpx.Response(next(answers), json={"id": "run"})

    with PrefectAPI("http://127.0.0.1:9/api", transport=httpx.MockTransport(busy_then_free)) as api:
        assert api._request("POST", "flow_runs/filter").status_code == 201
        assert len(seen) == 3 and seen[2] - seen[0] >= 0.2
        seen.clear()
        always = httpx.MockTransport(lambda request: httpx.Response(503))
        api._http = httpx.Client(base_url="http://127.0.0.1:9/api/", transport=always)
        with pytest.raises(PrefectUnavailable, match="503"):
            api._request("POST", "flow_runs/filter")
