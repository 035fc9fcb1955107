"""Micro-batched dispatch against a real Prefect server, with the real ``fuse-batch`` flow
run in-process (as a worker would run it) on real photos, on SQLite and PostgreSQL.

Each relay step is driven one pass at a time, so every interleaving below is deliberate:
jobs that leave together, a lone job that leaves at once, runs in flight holding jobs
back, a batch whose jobs end each on their own (no face, cancelled before it started,
deadline passed while it waited, cancelled after it finished), and a batch run that is
declared crashed mid-way while it goes on as a zombie.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
from sqlmodel import Session

from faceflow.testing.jobs import make_user, new_job
from faceflow.testing.prefect import PrefectServer
from faceflow.testing.relay import CountingTransport, job, submit, write_result
from faceflow.testing.wait import poll_value
from flows.params import (
    BATCH_DEPLOYMENT_NAME,
    BATCH_FLOW_NAME,
    DEPLOYMENT_NAME,
    FLOW_NAME,
    FuseBatchParams,
    result_key,
    stop_marker_key,
)
from tasks.errors import NoFaceFound
from tests.samples import no_face_jpeg_bytes
from webapi import crud
from webapi.config import Settings
from webapi.inputs import store_image
from webapi.models import Job, JobStatus
from webapi.prefect_api import PrefectAPI
from webapi.relay import batches, dispatch, reap, sync
from webapi.relay.context import Relay
from webapi.relay.runner import RelayRunner, build_relay
from webapi.storage import LocalObjectStore

pytestmark = [pytest.mark.prefect, pytest.mark.slow]


@pytest.fixture
def relay(flow_relays: Callable[..., Relay]) -> Relay:
    return flow_relays(
        batch_max_jobs=8,
        batch_linger_ms=0,
        batch_ahead_linger_ms=0,  # each pass dispatches what is due (one test lingers)
        worker_slots=1,
        runs_ahead_per_slot=2,
    )


@pytest.fixture
def owner(relay: Relay) -> crud.NewUser:
    return make_user(relay.engine, relay.settings, quota=100)


def _submit(relay: Relay, owner: crud.NewUser, **fields: Any) -> Job:
    return submit(relay.engine, relay.settings, relay.store, owner, **fields)


def _submit_faceless(relay: Relay, owner: crud.NewUser) -> Job:
    """A job whose source photo has no face (a coffee cup)."""
    settings: Settings = relay.settings
    source = store_image(
        no_face_jpeg_bytes(), name="source", limits=settings.image_limits, store=relay.store
    )
    target = store_image(
        no_face_jpeg_bytes(), name="target", limits=settings.image_limits, store=relay.store
    )
    return new_job(relay.engine, settings, owner, source=source, target=target)


def _end_run(relay: Relay, server: PrefectServer, lone: Job) -> None:
    """End a lone job's run as its flow would on success: its result stored, the run
    Completed (the relay takes an outcome only from storage)."""
    stored = job(relay.engine, lone.id)
    assert isinstance(relay.store, LocalObjectStore)
    write_result(relay.store.basepath, str(lone.id), stored.attempts)
    server.rest.set_state(str(stored.flow_run_id), "COMPLETED")


def _run(flow_run_id: uuid.UUID | str) -> str:
    """Run an existing ``fuse-batch`` run in this process, as a warm child does."""
    from prefect.client.orchestration import get_client
    from prefect.flow_engine import run_flow

    from flows.batch import fuse_batch

    with get_client(sync_client=True) as client:
        flow_run = client.read_flow_run(uuid.UUID(str(flow_run_id)))
    state = run_flow(fuse_batch, flow_run=flow_run, return_type="state")
    return str(state.type.value)  # type: ignore[union-attr]


def _dispatch_beside(relay: Relay, action: Callable[[], object]) -> tuple[int, float]:
    """One dispatch pass while ``action`` runs on another thread: rows handled, seconds."""
    beside = threading.Thread(target=action)
    started = time.monotonic()
    beside.start()
    handled = dispatch.run_once(relay)
    waited = time.monotonic() - started
    beside.join()
    return handled, waited


def _batch_of(prefect_server: PrefectServer, flow_run_id: uuid.UUID | None) -> FuseBatchParams:
    assert flow_run_id is not None
    return FuseBatchParams.model_validate(prefect_server.rest.run(str(flow_run_id))["parameters"])


def test_jobs_due_together_leave_in_one_batch_run(
    relay: Relay, owner: crud.NewUser, prefect_server: PrefectServer
) -> None:
    jobs = [_submit(relay, owner) for _ in range(3)]
    assert dispatch.run_once(relay) == 3
    stored = [job(relay.engine, j.id) for j in jobs]
    run_ids = {j.flow_run_id for j in stored}
    assert len(run_ids) == 1 and None not in run_ids
    assert all(j.status is JobStatus.queued and j.attempts == 1 for j in stored)
    assert len({j.dispatch_key for j in stored}) == 1
    (run_id,) = run_ids
    assert run_id is not None
    run = prefect_server.rest.run(str(run_id))
    assert {f"job:{j.id}" for j in jobs} <= set(run["tags"])
    assert run["name"].endswith("+2")
    params = FuseBatchParams.model_validate(run["parameters"])
    assert sorted(p.job_id for p in params.jobs) == sorted(str(j.id) for j in jobs)
    assert params.jobs[0].options.model_fields_set == {"identity_weight"}  # as the client set

    assert _run(run_id) == "COMPLETED"
    sync.run_once(relay)
    for j in jobs:
        done = job(relay.engine, j.id)
        assert done.status is JobStatus.succeeded, (done.status, done.error_code)
        assert done.result_key == result_key(str(j.id), 1, "png")
        assert (relay.store.basepath / done.result_key).is_file()  # type: ignore[attr-defined]
        assert set(done.timings) >= {"detect", "fuse"}


def test_a_lone_job_gets_a_run_of_its_own_at_once(
    relay: Relay, owner: crud.NewUser, prefect_server: PrefectServer
) -> None:
    lone = _submit(relay, owner)
    assert dispatch.run_once(relay) == 1
    stored = job(relay.engine, lone.id)
    assert stored.flow_run_id is not None and stored.dispatch_key is None
    run = prefect_server.rest.run(str(stored.flow_run_id))
    assert run["name"] == str(lone.id)  # a fuse-faces run, as without batching
    assert run["idempotency_key"] == f"job-{lone.id}-attempt-1"


def test_runs_in_flight_hold_jobs_back_until_a_run_ends(
    relay: Relay, owner: crud.NewUser, prefect_server: PrefectServer
) -> None:
    first = _submit(relay, owner)
    dispatch.run_once(relay)
    second = _submit(relay, owner)
    dispatch.run_once(relay)  # two runs in flight: worker_slots 1 x runs ahead 2
    waiting = [_submit(relay, owner) for _ in range(4)]
    assert dispatch.run_once(relay) == 0
    assert all(job(relay.engine, j.id).flow_run_id is None for j in waiting)

    second_run = prefect_server.rest.run(str(job(relay.engine, second.id).flow_run_id))
    assert second_run["name"] == str(second.id)  # alone when it came: a run of its own
    _end_run(relay, prefect_server, first)
    sync.run_once(relay)  # the first run ended: a slot is free
    assert job(relay.engine, first.id).status is JobStatus.succeeded
    assert dispatch.run_once(relay) == 4
    runs = {job(relay.engine, j.id).flow_run_id for j in waiting}
    assert len(runs) == 1  # the jobs that waited leave together
    batch = _batch_of(prefect_server, runs.pop())
    assert sorted(j.job_id for j in batch.jobs) == sorted(str(j.id) for j in waiting)


def test_a_batch_run_holds_at_most_the_batch_pixel_budget(
    relay: Relay, owner: crud.NewUser, prefect_server: PrefectServer
) -> None:
    """Four jobs of 0.57 MP each (512 x 600 source, 512 x 512 target) under a batch budget
    of 1.2 MP leave in one pass as two runs of two (``jobs.input_pixels``)."""
    limits = relay.settings.image_limits.model_copy(update={"max_batch_pixels": 1_200_000})
    budgeted = replace(relay, settings=relay.settings.model_copy(update={"image_limits": limits}))
    jobs = [_submit(relay, owner) for _ in range(4)]
    assert {job(relay.engine, j.id).input_pixels for j in jobs} == {512 * 600 + 512 * 512}
    assert dispatch.run_once(budgeted) == 4
    runs = [job(relay.engine, j.id).flow_run_id for j in jobs]
    assert None not in runs and len(set(runs)) == 2
    for run_id in set(runs):
        assert len(_batch_of(prefect_server, run_id).jobs) == 2


def test_a_lane_never_has_more_runs_in_flight_than_it_may(
    relay: Relay, owner: crud.NewUser, prefect_server: PrefectServer
) -> None:
    """The idle high-priority lane's free runs do not widen the busy normal lane's: a burst
    leaves as one more run of at most ``batch_max_jobs`` (8), and jobs that cannot share
    that run (another detector) wait too, instead of becoming runs past the cap."""
    first = _submit(relay, owner)
    dispatch.run_once(relay)  # one run in flight of the lane's two
    burst = [_submit(relay, owner) for _ in range(12)]
    other_detector = [
        _submit(relay, owner, options={"identity_weight": 0.8, "detector": "scrfd"})
        for _ in range(2)
    ]

    dispatch.run_once(relay)
    dispatch.run_once(relay)  # the held-back jobs are due again, and still wait

    stored = [job(relay.engine, j.id) for j in [*burst, *other_detector]]
    runs = {j.flow_run_id for j in stored if j.flow_run_id is not None}
    assert len(runs) == 1
    assert sum(1 for j in stored if j.flow_run_id is not None) == 8
    assert all(j.status is JobStatus.queued and j.attempts <= 1 for j in stored)
    assert batches.free_runs(relay)["normal"] == 0

    _end_run(relay, prefect_server, first)
    sync.run_once(relay)
    dispatch.run_once(relay)
    stored = [job(relay.engine, j.id) for j in [*burst, *other_detector]]
    assert len({j.flow_run_id for j in stored if j.flow_run_id is not None}) == 2
    assert sum(1 for j in stored if j.flow_run_id is None) == 2  # the other detector's


def test_a_run_that_would_queue_behind_a_busy_slot_waits_for_more_jobs(
    relay: Relay, owner: crud.NewUser, prefect_server: PrefectServer
) -> None:
    """With the ahead linger on, a lone job on an idle lane leaves at once; jobs that arrive
    while the worker slot is busy wait (from the oldest's arrival) for the ones that follow
    them, and all leave in one run."""
    relay.settings = relay.settings.model_copy(update={"batch_ahead_linger_ms": 600.0})
    first = _submit(relay, owner)
    started = time.monotonic()
    assert dispatch.run_once(relay) == 1
    assert time.monotonic() - started < 0.5  # idle lane: no linger
    assert job(relay.engine, first.id).flow_run_id is not None

    early = _submit(relay, owner)
    later: list[Job] = []

    def submit_later() -> None:
        time.sleep(0.15)
        later.extend(_submit(relay, owner) for _ in range(3))

    handled, waited = _dispatch_beside(relay, submit_later)

    assert handled == 4 and waited >= 0.4
    runs = {job(relay.engine, j.id).flow_run_id for j in [early, *later]}
    assert len(runs) == 1 and None not in runs
    batch = _batch_of(prefect_server, runs.pop())
    assert sorted(j.job_id for j in batch.jobs) == sorted(str(j.id) for j in [early, *later])


def test_the_ahead_linger_ends_once_the_lane_s_run_ends(
    relay: Relay, owner: crud.NewUser, prefect_server: PrefectServer
) -> None:
    """Jobs lingering behind the lane's running run (for more to join them) leave as soon
    as that run ends, not at the linger's cap: the worker slot would idle meanwhile. A wake
    while the run still runs (a submit's) does not end the linger, and the pass's wakes are
    handed on to the next pass."""
    # a cap far above what the run's end takes even on loaded cores (its end and the
    # settle took 2 s in a full suite beside the slow one, on a slow night)
    relay.settings = relay.settings.model_copy(update={"batch_ahead_linger_ms": 8000.0})
    woken = threading.Event()
    wakes: list[tuple[str, bool]] = []  # each wake, and whether the dispatch pass sent it

    def nap(step: str, seconds: float) -> bool:  # as RelayRunner.nap: the loop's wake
        assert step == "dispatch"
        if not woken.wait(seconds):
            return False
        woken.clear()
        return True

    def wake(step: str) -> None:
        wakes.append((step, threading.current_thread() is threading.main_thread()))
        if step == "dispatch":
            woken.set()

    relay.nap, relay.wake = nap, wake
    first = _submit(relay, owner)
    assert dispatch.run_once(relay) == 1  # idle lane: at once
    prefect_server.rest.set_state(str(job(relay.engine, first.id).flow_run_id), "RUNNING")
    sync.run_once(relay)
    waiting = _submit(relay, owner)

    def submit_then_end_first() -> None:
        time.sleep(0.3)
        woken.set()  # a submit wakes dispatch: the first run still runs, the linger goes on
        time.sleep(0.3)
        _end_run(relay, prefect_server, first)
        sync.run_once(relay)  # settles the first job; its end wakes dispatch

    handled, waited = _dispatch_beside(relay, submit_then_end_first)

    assert job(relay.engine, first.id).status is JobStatus.succeeded
    assert handled == 1 and job(relay.engine, waiting.id).flow_run_id is not None
    assert 0.55 <= waited < 6.0, waited  # after the run's end, well below the 8 s cap
    assert ("dispatch", True) in wakes  # the next pass looks at what woke this one


def test_a_run_ahead_is_created_once_the_lane_s_next_run_is_running(
    relay: Relay, owner: crud.NewUser, prefect_server: PrefectServer
) -> None:
    """A run that would queue behind the lane's next one is not created while that one is
    being handed to the worker slot (created, not running yet): its creation would go to
    Prefect beside that run's start. It leaves once the run is running, not at the cap."""
    relay.settings = relay.settings.model_copy(update={"batch_ahead_linger_ms": 3000.0})
    first = _submit(relay, owner)
    assert dispatch.run_once(relay) == 1  # idle lane: at once
    burst = [_submit(relay, owner) for _ in range(8)]  # a full batch: no linger for more

    def start_first() -> None:
        time.sleep(0.3)
        prefect_server.rest.set_state(str(job(relay.engine, first.id).flow_run_id), "RUNNING")
        sync.run_once(relay)

    handled, waited = _dispatch_beside(relay, start_first)

    assert handled == 8 and job(relay.engine, first.id).status is JobStatus.running
    assert 0.25 <= waited < 2.5, waited  # until the first run ran, far below the 3 s cap
    assert len({job(relay.engine, j.id).flow_run_id for j in burst}) == 1


def test_each_job_of_a_mixed_batch_ends_on_its_own(
    relay: Relay, owner: crud.NewUser, prefect_server: PrefectServer
) -> None:
    good = _submit(relay, owner)
    faceless = _submit_faceless(relay, owner)
    cancelled = _submit(relay, owner)
    late = _submit(relay, owner, deadline_seconds=3)
    finished_late = _submit(relay, owner)
    assert dispatch.run_once(relay) == 5
    run_id = job(relay.engine, good.id).flow_run_id
    assert run_id is not None
    assert all(job(relay.engine, j.id).flow_run_id == run_id for j in (faceless, late))

    with Session(relay.engine) as session:  # cancelled before the run starts
        outcome = crud.cancel_job(session, owner=owner.user, job_id=cancelled.id)
    assert outcome.status is JobStatus.cancelled
    assert reap.cancel_runs(relay) == 1  # a stop marker, not a cancelled run
    assert relay.store.exists(stop_marker_key(str(cancelled.id), 1))
    assert prefect_server.rest.run(str(run_id))["state_type"] == "SCHEDULED"
    time.sleep(max(0.0, (late.deadline_at - job(relay.engine, late.id).created_at).total_seconds()))

    assert _run(run_id) == "COMPLETED"
    with Session(relay.engine) as session:  # finished, but cancelled before the relay saw it
        crud.cancel_job(session, owner=owner.user, job_id=finished_late.id)
    sync.run_once(relay)
    reap.cancel_runs(relay)
    sync.run_once(relay)

    assert job(relay.engine, good.id).status is JobStatus.succeeded
    no_face = job(relay.engine, faceless.id)
    assert (no_face.status, no_face.error_code, no_face.attempts) == (
        JobStatus.failed,
        NoFaceFound.code,
        1,
    )
    assert job(relay.engine, cancelled.id).status is JobStatus.cancelled
    assert not relay.store.exists(result_key(str(cancelled.id), 1, "png"))  # skipped
    timed_out = job(relay.engine, late.id)
    assert (timed_out.status, timed_out.error_code) == (JobStatus.failed, "deadline_exceeded")
    discarded = job(relay.engine, finished_late.id)
    assert discarded.status is JobStatus.cancelled and discarded.result_key is None


def test_a_batch_declared_crashed_mid_way_reruns_only_unfinished_jobs_and_its_zombie_writes_nothing(
    relay: Relay,
    owner: crud.NewUser,
    prefect_server: PrefectServer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The batch stops (its fuse stage hangs) after the no-face job's failure was stored;
    the run is declared Crashed (as a worker reports a killed child): the no-face job keeps
    its outcome, the others run again as attempt 2 in a new batch. Then the first run
    wakes up as a zombie and finishes: none of it reaches the jobs."""
    from tasks import pipeline

    good = [_submit(relay, owner) for _ in range(2)]
    faceless = _submit_faceless(relay, owner)
    dispatch.run_once(relay)
    first_run = job(relay.engine, faceless.id).flow_run_id
    assert first_run is not None

    release, hung = threading.Event(), threading.Event()
    real_fuse = pipeline.fuse_stage

    def hanging_fuse(*args: Any, **kwargs: Any) -> Any:
        if threading.current_thread().name == "zombie":
            hung.set()
            release.wait(60)
        return real_fuse(*args, **kwargs)

    monkeypatch.setattr(pipeline, "fuse_stage", hanging_fuse)
    from faceflow.testing.relay import in_thread

    zombie = in_thread(lambda: _run(first_run), name="zombie")
    assert hung.wait(120), "the batch never reached its fuse stage"
    sync.run_once(relay)  # Running: the jobs are running
    prefect_server.rest.set_state(str(first_run), "CRASHED", "child SIGKILLed")
    sync.run_once(relay)
    reap.run_once(relay)

    no_face = job(relay.engine, faceless.id)
    assert (no_face.status, no_face.error_code, no_face.attempts) == (
        JobStatus.failed,
        NoFaceFound.code,
        1,
    )
    assert all(job(relay.engine, j.id).status is JobStatus.queued for j in good)
    dispatch.run_once(relay)
    second = [job(relay.engine, j.id) for j in good]
    second_run = second[0].flow_run_id
    assert second_run not in (None, first_run) and second[1].flow_run_id == second_run
    assert [j.attempts for j in second] == [2, 2]
    assert _run(second_run) == "COMPLETED"  # type: ignore[arg-type]
    sync.run_once(relay)
    for j in good:
        done = job(relay.engine, j.id)
        assert done.status is JobStatus.succeeded
        assert done.result_key == result_key(str(j.id), 2, "png")

    release.set()  # the zombie finishes attempt 1 late
    zombie.join(120)
    assert not zombie.is_alive()
    sync.run_once(relay)
    reap.run_once(relay)
    for j in good:
        after = job(relay.engine, j.id)
        assert after.status is JobStatus.succeeded and after.attempts == 2
        assert after.result_key == result_key(str(j.id), 2, "png")


def test_the_relay_looks_up_both_job_deployments_when_it_starts(relay: Relay) -> None:
    """Before any job: the first single run and the first batch after a start do not wait
    for their deployment's lookup (a burst's first batch waited 40-170 ms for it)."""
    recorder = CountingTransport()
    counted = build_relay(
        relay.settings,
        engine=relay.engine,
        store=relay.store,
        timings=relay.timings,
        prefect=PrefectAPI(relay.settings.prefect_api_url, transport=recorder),
    )
    runner = RelayRunner(counted)
    wanted = {
        f"/api/deployments/name/{FLOW_NAME}/{DEPLOYMENT_NAME}",
        f"/api/deployments/name/{BATCH_FLOW_NAME}/{BATCH_DEPLOYMENT_NAME}",
    }
    runner.start()
    try:
        looked_up = poll_value(lambda: wanted <= set(recorder.sent) or None, 10, step_s=0.02)
    finally:
        runner.stop()
    assert looked_up, recorder.sent
    assert not any("create_flow_run" in path for path in recorder.sent)
