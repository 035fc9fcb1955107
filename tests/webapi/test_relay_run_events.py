"""Issue 24: the relay learns run starts and ends from Prefect's event stream.

A real ``prefect server start`` that asks for a credential, the stand-in ``fuse-faces``
deployment run in this process: the stream delivers a run's states to ``RunEvents``; a
relay whose run-state poll is 30 s apart still ends a job within about a second of its run
(only the event can have told it); without the stream (refused, or cut) the relay polls at
its fast interval again, and a cut stream reconnects and reads what it missed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.engine import Engine
from sqlmodel import Session

from faceflow.testing.jobs import make_user
from faceflow.testing.prefect import PrefectServer
from faceflow.testing.relay import (
    FAST,
    SCRIPT,
    ReadCounter,
    execute_run,
    job,
    submit,
    write_result,
)
from faceflow.testing.wait import poll_value
from tests.webapi.conftest import PREFECT_AUTH as AUTH
from tests.webapi.conftest import stand_in_run
from webapi import crud
from webapi.config import Settings
from webapi.models import Job, JobStatus
from webapi.prefect_api import PrefectAPI
from webapi.relay.run_events import (
    REREAD_AFTER_S,
    RunEvents,
    events_url,
    wait_connected,
    watched_run,
)
from webapi.relay.runner import RelayRunner, build_relay
from webapi.storage import LocalObjectStore

pytestmark = pytest.mark.prefect

#: Run-state polls this far apart cannot be what ends a job within a few seconds.
SLOW_POLL = replace(FAST, sync_interval_s=30.0, sync_safety_net_s=30.0)


@pytest.fixture
def settings(locked_settings: Settings) -> Settings:
    return locked_settings


def _until(ready: Callable[[], Any], timeout_s: float) -> Any:
    value = poll_value(lambda: ready() or None, timeout_s, step_s=0.02)
    return ready() if value is None else value


def _runner(settings: Settings, engine: Engine, timings: Any = SLOW_POLL) -> RelayRunner:
    store = LocalObjectStore(Path(settings.home) / "storage")
    SCRIPT.storage_dir = store.basepath
    return RelayRunner(build_relay(settings, engine=engine, store=store, timings=timings))


@contextmanager
def _connected(runner: RelayRunner, engine: Engine, settings: Settings) -> Iterator[crud.NewUser]:
    """Start ``runner`` and wait for its event stream; a user to submit as; stop it after."""
    owner = make_user(engine, settings, quota=10)
    runner.start()
    try:
        assert runner.events is not None and wait_connected(runner.events, 20)
        yield owner
    finally:
        runner.stop()


def _dispatched(runner: RelayRunner, owner: crud.NewUser, **fields: Any) -> tuple[Job, str]:
    """Submit a job (request ``fields``) to ``runner``'s relay and wait until it is
    dispatched: (job, run id)."""
    relay = runner.relay
    new = submit(relay.engine, relay.settings, relay.store, owner, **fields)
    runner.wake()
    run_id = _until(lambda: job(relay.engine, new.id).flow_run_id, 20)
    assert run_id is not None, "dispatched"
    return new, str(run_id)


def test_the_stream_url_and_what_counts_as_a_run_change() -> None:
    assert events_url("http://127.0.0.1:4200/api") == "ws://127.0.0.1:4200/api/events/out"
    assert events_url("https://prefect.internal/api/") == "wss://prefect.internal/api/events/out"
    resource = {"prefect.resource.id": "prefect.flow-run.abc", "prefect.state-type": "COMPLETED"}
    occurred = "2026-12-06T10:00:00.123456Z"
    event = {"type": "event", "event": {"resource": resource, "occurred": occurred}}
    at = datetime(2026, 12, 6, 10, 0, 0, 123456, tzinfo=UTC)
    assert watched_run(event) == ("abc", "COMPLETED", at)
    scheduled = {**resource, "prefect.state-type": "SCHEDULED"}
    assert watched_run({"type": "event", "event": {"resource": scheduled}}) is None


def test_the_stream_delivers_a_runs_states_with_the_credential_only(
    locked: PrefectServer,
) -> None:
    heard: list[tuple[str, str]] = []
    events = RunEvents(
        locked.api_url,
        auth_string=AUTH,
        on_change=lambda run, state, _at: heard.append((run, state)),
        on_connect=lambda: None,
    )
    wrong = RunEvents(
        locked.api_url,
        auth_string="faceflow:guess",
        on_change=lambda run, state, _at: heard.append(("wrong", state)),
        on_connect=lambda: None,
    )
    events.start()
    wrong.start()
    try:
        assert wait_connected(events, 20)
        run = stand_in_run(locked, "heard")
        locked.rest.set_state(run["id"], "RUNNING")
        locked.rest.set_state(run["id"], "COMPLETED")
        assert _until(lambda: (run["id"], "COMPLETED") in heard, 20), heard
        assert (run["id"], "RUNNING") in heard
        assert not wrong.connected and all(who != "wrong" for who, _ in heard)
    finally:
        events.stop()
        wrong.stop()


def test_a_job_ends_on_its_runs_event_not_on_the_poll(
    engine: Engine, settings: Settings, locked: PrefectServer
) -> None:
    runner = _runner(settings, engine)
    with _connected(runner, engine, settings) as owner:
        new, run_id = _dispatched(runner, owner)
        assert execute_run(run_id) == "COMPLETED"
        ended = time.monotonic()
        done = _until(lambda: job(engine, new.id).status.is_terminal, 10)
        took = time.monotonic() - ended
        assert done and job(engine, new.id).status is JobStatus.succeeded
        assert took < 10, "within the wait above, far inside the 30 s poll"
        print(f"\nrun COMPLETED -> job succeeded: {took * 1000:.0f} ms (poll every 30 s)")


def test_without_the_stream_the_relay_polls_at_its_fast_interval(
    engine: Engine, settings: Settings, locked: PrefectServer
) -> None:
    """A stream Prefect refuses (wrong credential on the websocket only, as a proxy that
    blocks websockets would): the job still ends, by the 0.2 s poll."""
    runner = _runner(settings, engine, timings=replace(FAST, sync_safety_net_s=30.0))
    assert runner.events is not None
    runner.events._auth_string = "faceflow:guess"  # the REST client keeps the real one
    owner = make_user(engine, settings, quota=10)
    runner.start()
    try:
        new, run_id = _dispatched(runner, owner)
        assert execute_run(run_id) == "COMPLETED"
        assert _until(lambda: job(engine, new.id).status is JobStatus.succeeded, 10)
        assert not runner.events.connected and runner.events.connects == 0
    finally:
        runner.stop()


def test_a_cut_stream_reconnects_and_reads_what_it_missed(
    engine: Engine, settings: Settings, locked: PrefectServer
) -> None:
    """The stream is cut while a run ends (its event is lost); the reconnect's own pass
    ends the job, long before the 30 s poll."""
    runner = _runner(settings, engine)
    owner = make_user(engine, settings, quota=10)
    runner.start()
    try:
        events = runner.events
        assert events is not None and wait_connected(events, 20)
        new, run_id = _dispatched(runner, owner)
        events._on_change = lambda _run, _state, _at: None  # events are lost from here on
        assert execute_run(run_id) == "COMPLETED"
        assert job(engine, new.id).status is not JobStatus.succeeded
        events._on_change = lambda _run, _state, _at: runner.wake("sync")
        socket = events._socket
        assert socket is not None
        socket.close()
        assert _until(lambda: job(engine, new.id).status is JobStatus.succeeded, 10)
        assert _until(lambda: events.connects >= 2, 10), "reconnected"
    finally:
        runner.stop()


def moves_on_events_alone(
    engine: Engine, settings: Settings, server: PrefectServer
) -> tuple[float, float]:
    """A job's run goes RUNNING then COMPLETED while the poll is 30 s apart: the job is
    marked running at the RUNNING event's time and ends on the COMPLETED event, and the
    relay (sync and reap) reads neither the run nor its artifacts over REST, not even a
    second later (the events were enough: nothing to re-read). The seconds from each
    state's write to the job's (state set over REST, job store polled every 20 ms)."""
    reads = ReadCounter()
    prefect = PrefectAPI(settings.prefect_api_url, auth_string=AUTH, transport=reads)
    store = LocalObjectStore(Path(settings.home) / "storage")
    SCRIPT.storage_dir = store.basepath
    relay = build_relay(settings, engine=engine, prefect=prefect, store=store, timings=SLOW_POLL)
    runner = RelayRunner(relay)
    with _connected(runner, engine, settings) as owner:
        time.sleep(1.0)  # the reaper's first read on the stream sets its 30 s period
        new, run_id = _dispatched(runner, owner)
        assert job(engine, new.id).status is JobStatus.queued
        before = reads.reads
        set_at = time.monotonic()
        server.rest.set_state(run_id, "RUNNING")
        assert _until(lambda: job(engine, new.id).status is JobStatus.running, 10)
        to_running = time.monotonic() - set_at
        started = job(engine, new.id)
        run = server.rest.call("GET", f"/flow_runs/{run_id}")
        assert started.stage == "started" and started.started_at is not None
        assert started.started_at == datetime.fromisoformat(run["state"]["timestamp"])
        write_result(store.basepath, str(new.id), 1)
        set_at = time.monotonic()
        server.rest.set_state(run_id, "COMPLETED")
        assert _until(lambda: job(engine, new.id).status is JobStatus.succeeded, 10)
        to_succeeded = time.monotonic() - set_at
        time.sleep(REREAD_AFTER_S[-1] + 0.2)
        assert reads.reads == before, "no REST read of the run"
    return to_running, to_succeeded


def test_a_run_moves_its_job_from_events_alone_without_reading_it(
    engine: Engine, settings: Settings, locked: PrefectServer
) -> None:
    moves_on_events_alone(engine, settings, locked)


def test_a_missed_running_event_still_starts_the_job_by_the_safety_net(
    engine: Engine, settings: Settings, locked: PrefectServer
) -> None:
    """The stream is up but the run's RUNNING event is lost (as when the subscriber's queue
    overflows): the safety-net read, here every second, marks the job running; its
    COMPLETED event still ends it."""
    runner = _runner(settings, engine, timings=replace(FAST, sync_safety_net_s=1.0))
    events = runner.events
    assert events is not None
    on_change = events._on_change

    def on_change_but_running(run: str, state: str, at: datetime) -> None:
        if state != "RUNNING":
            on_change(run, state, at)

    events._on_change = on_change_but_running
    owner = make_user(engine, settings, quota=10)
    runner.start()
    try:
        assert wait_connected(events, 20)
        new, run_id = _dispatched(runner, owner)
        locked.rest.set_state(run_id, "RUNNING")
        assert _until(lambda: job(engine, new.id).status is JobStatus.running, 10)
        write_result(SCRIPT.storage(), str(new.id), 1)
        locked.rest.set_state(run_id, "COMPLETED")
        assert _until(lambda: job(engine, new.id).status is JobStatus.succeeded, 10)
    finally:
        runner.stop()


def test_a_crashed_runs_event_gets_its_job_reaped_long_before_the_safety_net(
    engine: Engine, settings: Settings, locked: PrefectServer
) -> None:
    """Reads of the runs 30 s apart: a CRASHED event makes the reaper read the run, and the
    job goes back to the queue for its second attempt."""
    runner = _runner(settings, engine)
    with _connected(runner, engine, settings) as owner:
        new, run_id = _dispatched(runner, owner)
        locked.rest.set_state(run_id, "RUNNING")
        assert _until(lambda: job(engine, new.id).status is JobStatus.running, 10)
        locked.rest.set_state(run_id, "CRASHED")
        assert _until(lambda: job(engine, new.id).attempts == 2, 10), "reaped, re-dispatched"
        assert str(job(engine, new.id).flow_run_id) != run_id


def test_a_run_lost_without_an_event_is_found_by_the_safety_net(
    engine: Engine, settings: Settings, locked: PrefectServer
) -> None:
    """The stream is up, the runs are read every second (the safety net), and a running
    job's run is deleted from Prefect: no state event says so, yet the safety-net read
    finds the run gone and the reaper re-dispatches the job (its second attempt)."""
    runner = _runner(settings, engine, timings=replace(FAST, sync_safety_net_s=1.0))
    with _connected(runner, engine, settings) as owner:
        new, run_id = _dispatched(runner, owner)
        locked.rest.set_state(run_id, "RUNNING")
        assert _until(lambda: job(engine, new.id).status is JobStatus.running, 10)
        locked.rest.call("DELETE", f"/flow_runs/{run_id}")
        assert _until(lambda: job(engine, new.id).attempts == 2, 10), "lost, re-dispatched"
        assert str(job(engine, new.id).flow_run_id) != run_id


def test_a_run_stuck_pending_without_an_event_is_found_by_the_safety_net(
    engine: Engine, settings: Settings, locked: PrefectServer
) -> None:
    """The stream is up, the runs are read every second (the safety net), and a job's run
    goes Pending (a worker claimed it) and stays there: no later event comes, yet past
    ``pending_timeout_s`` a safety-net read finds it stuck and the reaper re-dispatches the
    job (its second attempt) on a new run."""
    timings = replace(FAST, sync_safety_net_s=1.0)
    runner = _runner(settings, engine, timings=timings)
    with _connected(runner, engine, settings) as owner:
        new, run_id = _dispatched(runner, owner)
        locked.rest.set_state(run_id, "PENDING")
        pending = time.monotonic()
        assert _until(lambda: job(engine, new.id).attempts == 2, 15), "stuck, re-dispatched"
        took = time.monotonic() - pending
        assert took >= timings.pending_timeout_s, "not before its Pending timeout"
        assert str(job(engine, new.id).flow_run_id) != run_id
        print(f"\nPending -> re-dispatched: {took:.1f} s (timeout 2 s, safety net every 1 s)")


#: Reads of the runs 30 s apart while the stream is up; a cancel's grace outlasts the
#: re-reads that the run's CANCELLING event asks for (up to REREAD_AFTER_S[-1] later).
REAP_ON_STREAM = replace(SLOW_POLL, cancel_grace_s=REREAD_AFTER_S[-1] + 4.0)


def _running_on_the_stream(
    runner: RelayRunner, owner: crud.NewUser, locked: PrefectServer, **fields: Any
) -> tuple[Job, str, float]:
    """Start ``runner``, wait for its stream, then dispatch a job and set its run RUNNING
    (the event marks the job running): (job, run id, monotonic time the stream was up).
    The reaper read the runs on connecting; its next read as a poll is 30 s later."""
    runner.start()
    assert runner.events is not None and wait_connected(runner.events, 20)
    connected = time.monotonic()
    new, run_id = _dispatched(runner, owner, **fields)
    locked.rest.set_state(run_id, "RUNNING")
    assert _until(lambda: job(runner.relay.engine, new.id).status is JobStatus.running, 10)
    return new, run_id, connected


def test_an_overdue_running_job_is_reaped_between_the_safety_net_reads(
    engine: Engine, settings: Settings, locked: PrefectServer
) -> None:
    """The stream is up and the runs are read 30 s apart; a job whose run stays RUNNING
    past its deadline and running grace is failed (deadline_exceeded) and its run
    cancelled by the reaper within a few of its passes: the job store alone shows it due."""
    runner = _runner(settings, engine, timings=REAP_ON_STREAM)
    owner = make_user(engine, settings, quota=10)
    try:
        new, run_id, connected = _running_on_the_stream(runner, owner, locked, deadline_seconds=3)
        overdue = new.deadline_at.timestamp() + REAP_ON_STREAM.running_grace_s
        assert _until(lambda: job(engine, new.id).status.is_terminal, 15), "reaped"
        ended = job(engine, new.id)
        took = time.monotonic() - connected
        assert (ended.status, ended.error_code) == (JobStatus.failed, "deadline_exceeded")
        assert ended.finished_at is not None and ended.finished_at.timestamp() >= overdue
        assert took < REAP_ON_STREAM.sync_safety_net_s, "before the safety net's next read"
        assert _until(lambda: locked.rest.run(run_id)["state_type"] == "CANCELLING", 10)
        print(f"\nstream up -> overdue job failed: {took:.1f} s (safety net every 30 s)")
    finally:
        runner.stop()


def test_a_cancel_whose_run_never_stops_is_forced_between_the_safety_net_reads(
    engine: Engine, settings: Settings, locked: PrefectServer
) -> None:
    """The stream is up and the runs are read 30 s apart; a running job's cancel sets its
    run CANCELLING, the run never stops, and once cancel_grace_s is past the reaper forces
    the run CANCELLED and the job cancelled, long before the safety net's next read."""
    runner = _runner(settings, engine, timings=REAP_ON_STREAM)
    owner = make_user(engine, settings, quota=10)
    try:
        new, run_id, connected = _running_on_the_stream(runner, owner, locked)
        with Session(engine) as session:
            crud.cancel_job(session, owner=owner.user, job_id=new.id)
        assert _until(lambda: locked.rest.run(run_id)["state_type"] == "CANCELLING", 10)
        requested = job(engine, new.id).cancel_requested_at
        assert requested is not None
        assert _until(lambda: job(engine, new.id).status.is_terminal, 20), "forced"
        took = time.monotonic() - connected
        ended = job(engine, new.id)
        assert ended.status is JobStatus.cancelled
        assert ended.finished_at is not None
        assert ended.finished_at - requested > timedelta(seconds=REAP_ON_STREAM.cancel_grace_s)
        assert took < REAP_ON_STREAM.sync_safety_net_s, "before the safety net's next read"
        assert locked.rest.run(run_id)["state_type"] == "CANCELLED"
        print(f"\nstream up -> stuck cancel forced: {took:.1f} s (safety net every 30 s)")
    finally:
        runner.stop()
