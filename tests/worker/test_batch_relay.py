"""Micro-batches on the real path: the relay dispatches ``fuse-batch`` runs that the warm
worker runs in its child, on real photos.

- A job cancelled while its batch runs is skipped, a job whose deadline passes while its
  batch is held is dropped, a faceless job fails alone, the rest succeed.
- A child SIGKILLed mid-batch: the job that had already failed keeps its outcome, only
  the unfinished jobs are re-dispatched (attempt 2, together) and succeed.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlmodel import Session

from faceflow.testing.wait import poll
from flows.params import (
    BATCH_DEPLOYMENT_NAME,
    BATCH_FLOW_NAME,
    DEPLOYMENT_NAME,
    FLOW_NAME,
    result_error_key,
    result_key,
    stop_marker_key,
)
from tests.worker.conftest import FUSE_ENTRYPOINT, Api, WarmWorker, live_relay

pytestmark = [pytest.mark.prefect, pytest.mark.slow]

BATCH_ENTRYPOINT = "flows/batch.py:fuse_batch"


@pytest.fixture
def relay(prefect_api: Api, warm_worker: WarmWorker, tmp_path: Path) -> Iterator[Any]:
    """The webapi's relay on a fresh SQLite job store, sharing the flows' local storage,
    batching on; both job flows are deployed into the warm worker's pool."""
    prefect_api.deploy(FLOW_NAME, FUSE_ENTRYPOINT, warm_worker.pool, name=DEPLOYMENT_NAME)
    prefect_api.deploy(
        BATCH_FLOW_NAME, BATCH_ENTRYPOINT, warm_worker.pool, name=BATCH_DEPLOYMENT_NAME
    )
    with live_relay(prefect_api, tmp_path, batch_max_jobs=8, batch_linger_ms=0) as instance:
        yield instance


def _faceless(relay: Any, owner: Any) -> Any:
    from faceflow.testing.jobs import new_job
    from tests.samples import no_face_jpeg_bytes
    from webapi.inputs import store_image

    limits = relay.settings.image_limits
    cup = store_image(no_face_jpeg_bytes(), name="source", limits=limits, store=relay.store)
    return new_job(relay.engine, relay.settings, owner, source=cup, target=cup)


def test_a_batch_on_the_warm_worker_ends_each_job_on_its_own(
    relay: Any, prefect_api: Api, warm_worker: WarmWorker
) -> None:
    from faceflow.testing.jobs import make_user
    from faceflow.testing.relay import job, submit
    from webapi import crud
    from webapi.models import JobStatus
    from webapi.relay import dispatch, reap, sync

    owner = make_user(relay.engine, relay.settings, quota=100)
    pid = warm_worker.wait_idle()["children"][0]["pid"]
    good = [submit(relay.engine, relay.settings, relay.store, owner) for _ in range(2)]
    faceless = _faceless(relay, owner)
    cancelled = submit(relay.engine, relay.settings, relay.store, owner)
    late = submit(relay.engine, relay.settings, relay.store, owner, deadline_seconds=6)
    dispatch.run_once(relay)
    run_id = str(job(relay.engine, faceless.id).flow_run_id)
    assert {str(job(relay.engine, j.id).flow_run_id) for j in [*good, cancelled, late]} == {run_id}

    assert poll(lambda: prefect_api.state(run_id) == "RUNNING", 60, step_s=0.002)
    os.kill(pid, signal.SIGSTOP)  # hold the batch while its jobs are cancelled / time out
    try:
        sync.run_once(relay)
        with Session(relay.engine) as session:
            requested = crud.cancel_job(session, owner=owner.user, job_id=cancelled.id)
        assert requested.status is JobStatus.cancel_requested
        reap.cancel_runs(relay)
        assert job(relay.engine, cancelled.id).status is JobStatus.cancelled  # at once
        assert relay.store.exists(stop_marker_key(str(cancelled.id), 1))
        time.sleep(max(0.0, (late.deadline_at - late.created_at).total_seconds()))
    finally:
        os.kill(pid, signal.SIGCONT)
    final = prefect_api.wait_final(run_id, timeout=180)
    assert final["state_type"] == "COMPLETED", final["state"]
    sync.run_once(relay)

    for j in good:
        done = job(relay.engine, j.id)
        assert done.status is JobStatus.succeeded, (done.status, done.error_code)
        assert (prefect_api.home.storage / result_key(str(j.id), 1, "png")).is_file()
    failed = job(relay.engine, faceless.id)
    assert (failed.status, failed.error_code) == (JobStatus.failed, "no_face_found")
    assert job(relay.engine, cancelled.id).status is JobStatus.cancelled
    assert not (prefect_api.home.storage / result_key(str(cancelled.id), 1, "png")).exists()
    dropped = job(relay.engine, late.id)
    assert (dropped.status, dropped.error_code) == (JobStatus.failed, "deadline_exceeded")


def test_a_child_killed_mid_batch_reruns_only_the_unfinished_jobs(
    relay: Any, prefect_api: Api, warm_worker: WarmWorker
) -> None:
    from faceflow.testing.jobs import make_user
    from faceflow.testing.relay import job, submit
    from webapi.models import JobStatus
    from webapi.relay import dispatch, reap, sync

    owner = make_user(relay.engine, relay.settings, quota=100)
    storage = prefect_api.home.storage
    for _ in range(3):  # a batch too quick to catch between its jobs is simply tried again
        pid = warm_worker.wait_idle()["children"][0]["pid"]
        good = [submit(relay.engine, relay.settings, relay.store, owner) for _ in range(3)]
        faceless = _faceless(relay, owner)
        dispatch.run_once(relay)
        run_id = str(job(relay.engine, faceless.id).flow_run_id)
        failure = storage / result_error_key(str(faceless.id), 1)
        if poll(failure.exists, 120, step_s=0.002):
            os.kill(pid, signal.SIGSTOP)  # after detection, before the others are stored
            if not any((storage / result_key(str(j.id), 1, "png")).exists() for j in good):
                break
            os.kill(pid, signal.SIGCONT)
        prefect_api.wait_final(run_id, timeout=120)
        sync.run_once(relay)
    else:
        pytest.fail("could not catch a batch between its jobs")

    os.kill(pid, signal.SIGKILL)
    crashed = prefect_api.wait_final(run_id, timeout=10)
    assert crashed["state_type"] == "CRASHED", crashed["state"]
    sync.run_once(relay)
    reap.run_once(relay)
    failed = job(relay.engine, faceless.id)
    assert (failed.status, failed.error_code, failed.attempts) == (
        JobStatus.failed,
        "no_face_found",
        1,
    )
    assert all(job(relay.engine, j.id).status is JobStatus.queued for j in good)

    dispatch.run_once(relay)
    again = [job(relay.engine, j.id) for j in good]
    second_run = again[0].flow_run_id
    assert {j.flow_run_id for j in again} == {second_run} and str(second_run) != run_id
    assert [j.attempts for j in again] == [2, 2, 2]
    final = prefect_api.wait_final(str(second_run), timeout=180)
    assert final["state_type"] == "COMPLETED", final["state"]
    sync.run_once(relay)
    for j in good:
        done = job(relay.engine, j.id)
        assert done.status is JobStatus.succeeded, (done.status, done.error_code)
        assert done.result_key == result_key(str(j.id), 2, "png")
    assert job(relay.engine, faceless.id).attempts == 1  # never ran again
