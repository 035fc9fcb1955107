"""The fetch lane: no user's slow input URLs stall another's job.

Real HTTP over loopback (a tarpit trickling one byte a second, a well-behaved server),
the real relay against a real Prefect server, on SQLite and PostgreSQL job stores.
"""

from __future__ import annotations

import hashlib
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.engine import Engine
from sqlmodel import Session

from faceflow.testing.jobs import make_user, outbox_of, source_jpeg
from faceflow.testing.net import free_port
from faceflow.testing.prefect import PrefectServer
from faceflow.testing.relay import (
    FAST,
    SCRIPT,
    Receiver,
    Tarpit,
    job,
    receiver,
    submit,
    tarpit,
)
from faceflow.testing.wait import wait_for
from tests.samples import flat_png
from tests.videos import Videos
from tests.webapi.conftest import make_settings
from webapi import crud
from webapi.config import Settings
from webapi.models import JobStatus, Outbox
from webapi.relay import batches, dispatch, fetch_lane, runs
from webapi.relay.context import Relay
from webapi.relay.fetch_lane import FetchLane
from webapi.relay.runner import RelayRunner, build_relay
from webapi.storage import LocalObjectStore

pytestmark = pytest.mark.prefect

DEADLINE_S = 2.0


@pytest.fixture
def settings(database_url: str, tmp_path: Path, prefect_server: PrefectServer) -> Settings:
    return make_settings(
        database_url,
        tmp_path,
        prefect_api_url=prefect_server.api_url,
        fetch_concurrency=4,
        fetch_per_user=2,
        fetch_deadline_seconds=DEADLINE_S,
        fetch_tries=2,
    )


@pytest.fixture
def relay(engine: Engine, settings: Settings, tmp_path: Path) -> Iterator[Relay]:
    store = LocalObjectStore(tmp_path / "storage")
    SCRIPT.storage_dir = store.basepath
    instance = build_relay(settings, engine=engine, store=store, timings=FAST)
    yield instance
    instance.close()


@pytest.fixture
def runner(relay: Relay) -> Iterator[RelayRunner]:
    instance = RelayRunner(relay)
    instance.start()
    yield instance
    instance.stop()


@pytest.fixture
def user_a(engine: Engine, settings: Settings) -> crud.NewUser:
    return make_user(engine, settings, quota=100)


@pytest.fixture
def user_b(engine: Engine, settings: Settings) -> crud.NewUser:
    return make_user(engine, settings, quota=100)


def url_job(relay: Relay, owner: crud.NewUser, url: str, **fields: Any) -> uuid.UUID:
    return submit(relay.engine, relay.settings, relay.store, owner, source_url=url, **fields).id


def open_after(slow: Tarpit, count: int, timeout_s: float = 5.0) -> None:
    wait_for(lambda: slow.open == count, timeout_s=timeout_s)


def test_tarpit_jobs_of_one_user_do_not_delay_another_users_jobs(
    relay: Relay, runner: RelayRunner, user_a: crud.NewUser, user_b: crud.NewUser
) -> None:
    """Five of A's jobs point at a tarpit: at most two of them are fetched at once (the
    per-user bound), none holds dispatch, and B's jobs (stored inputs, or a URL that
    answers) are dispatched within normal time while A's fetches hang."""
    photo = source_jpeg()
    with tarpit(interval_s=1.0) as slow, receiver() as good:
        good.files["/photo.jpg"] = (200, {"content-type": "image/jpeg"}, photo)
        hung = [url_job(relay, user_a, f"{slow.url}/{i}.jpg") for i in range(5)]
        runner.wake()
        open_after(slow, 2)  # A's two fetch slots are taken
        stored = submit(relay.engine, relay.settings, relay.store, user_b).id
        by_url = url_job(relay, user_b, f"{good.url}/photo.jpg")
        started = time.monotonic()
        runner.wake()
        wait_for(lambda: job(relay.engine, stored).flow_run_id is not None, timeout_s=5)
        stored_after = time.monotonic() - started
        wait_for(lambda: job(relay.engine, by_url).flow_run_id is not None, timeout_s=5)
        by_url_after = time.monotonic() - started
        assert slow.open == 2 and slow.peak == 2  # never more of A's at once
        assert all(job(relay.engine, j).flow_run_id is None for j in hung)
    # Well under one of A's fetches (DEADLINE_S): B waited for none of them (a loaded
    # two-core machine dispatches within ~0.1-0.5 s).
    assert stored_after < DEADLINE_S / 2, stored_after
    assert by_url_after < DEADLINE_S / 2, by_url_after
    assert relay.store.get(str(job(relay.engine, by_url).source_key)) == photo


def test_the_per_user_bound_holds_over_two_replicas(
    relay: Relay, user_a: crud.NewUser, user_b: crud.NewUser
) -> None:
    """Two replicas share A's bound of two: the count is taken from the outbox leases,
    under one lock, so the second replica takes one more of A's, not three."""
    replicas = [replace(relay, owner=f"replica-{i}") for i in range(2)]
    lanes = [FetchLane(1), FetchLane(4)]
    with tarpit(interval_s=1.0) as slow:
        for i in range(5):
            url_job(relay, user_a, f"{slow.url}/a{i}.jpg")
        for i in range(2):
            url_job(relay, user_b, f"{slow.url}/b{i}.jpg")
        started = [lane.run_once(r) for lane, r in zip(lanes, replicas, strict=True)]
        open_after(slow, 4)
        assert started == [1, 3]  # A's first; then A's second and both of B's
        assert sum(lane.run_once(r) for lane, r in zip(lanes, replicas, strict=True)) == 0
        time.sleep(0.3)  # nothing more arrives
        assert slow.peak == 4
        assert sorted(slow.paths) == ["/a0.jpg", "/a1.jpg", "/b0.jpg", "/b1.jpg"]
        for lane in lanes:
            lane.close()


def test_a_tarpit_fails_its_job_with_input_fetch_timeout_after_the_tries(
    relay: Relay, runner: RelayRunner, user_a: crud.NewUser
) -> None:
    with tarpit(interval_s=1.0) as slow:
        job_id = url_job(relay, user_a, f"{slow.url}/slow.jpg", queue_timeout_seconds=60)
        started = time.monotonic()
        runner.wake()
        wait_for(lambda: job(relay.engine, job_id).status is JobStatus.failed, timeout_s=10)
        took = time.monotonic() - started
        connections = slow.connections
    failed = job(relay.engine, job_id)
    assert failed.error_code == "input_fetch_timeout"
    assert failed.error_message == (
        f"The input URL did not deliver the image within {DEADLINE_S:g} s. Tried 2 times."
    )
    assert connections == 2  # fetch_tries
    assert 2 * DEADLINE_S <= took < 2 * DEADLINE_S + 2.0, took
    assert failed.flow_run_id is None
    [row] = outbox_of(relay.engine, job_id)
    assert (row.outcome, row.attempts) == ("done", 1)


def test_the_queue_deadline_expires_a_job_whose_fetch_keeps_failing(
    relay: Relay, runner: RelayRunner, user_a: crud.NewUser
) -> None:
    """Connection refused, tried again and again (fetch_tries is high): the queue deadline
    still ends the job, as ``expired``; a tarpit fetch stops at the queue deadline too."""
    # The runner's relay: settings and backoffs are read on every pass.
    relay.settings = relay.settings.model_copy(
        update={"fetch_tries": 10, "fetch_deadline_seconds": 30.0}
    )
    relay.timings = replace(FAST, dispatch_backoff_base_s=0.3, dispatch_backoff_cap_s=1.0)
    refused = url_job(
        relay, user_a, f"http://127.0.0.1:{free_port()}/x.jpg", queue_timeout_seconds=2
    )
    with tarpit(interval_s=1.0) as slow:
        held = url_job(relay, user_a, f"{slow.url}/held.jpg", queue_timeout_seconds=2)
        runner.wake()
        for job_id in (refused, held):

            def expired(j: uuid.UUID = job_id) -> bool:
                return job(relay.engine, j).status is JobStatus.expired

            wait_for(expired, 5)
        open_after(slow, 0, timeout_s=2)
    for job_id in (refused, held):
        ended = job(relay.engine, job_id)
        assert ended.error_code == "queue_timeout" and ended.flow_run_id is None
    [row] = outbox_of(relay.engine, refused)
    assert row.outcome == "obsolete" and 1 <= row.attempts < 10  # tried, then expired


def test_cancelling_a_job_cuts_its_fetch(
    relay: Relay, runner: RelayRunner, user_a: crud.NewUser
) -> None:
    relay.settings = relay.settings.model_copy(update={"fetch_deadline_seconds": 30.0})
    with tarpit(interval_s=1.0) as slow:
        job_id = url_job(relay, user_a, f"{slow.url}/c.jpg")
        runner.wake()
        open_after(slow, 1)
        with Session(relay.engine, expire_on_commit=False) as session:
            cancelled = crud.cancel_job(session, owner=user_a.user, job_id=job_id)
        assert cancelled.status is JobStatus.cancelled
        assert wait_for(lambda: slow.open == 0, timeout_s=3) < 1.0  # cut, not left to run
        wait_for(lambda: runner.fetches.in_flight() == 0, timeout_s=2)
    ended = job(relay.engine, job_id)
    assert ended.status is JobStatus.cancelled and ended.source_key is None
    [row] = outbox_of(relay.engine, job_id)
    assert row.outcome == "obsolete" and row.attempts == 0


def test_stopping_the_relay_cuts_fetches_and_hands_their_rows_back(
    relay: Relay, user_a: crud.NewUser
) -> None:
    relay.settings = relay.settings.model_copy(update={"fetch_deadline_seconds": 30.0})
    with tarpit(interval_s=1.0) as slow:
        job_id = url_job(relay, user_a, f"{slow.url}/s.jpg")
        lane = FetchLane(2)
        assert lane.run_once(relay) == 1
        open_after(slow, 1)
        started = time.monotonic()
        lane.close()
        assert time.monotonic() - started < 1.0
    [row] = outbox_of(relay.engine, job_id)
    assert row.done_at is None and row.lease_owner is None and row.attempts == 0
    assert job(relay.engine, job_id).status is JobStatus.queued


def test_dispatch_never_takes_a_job_whose_input_is_not_fetched(
    relay: Relay, user_a: crud.NewUser
) -> None:
    with tarpit(interval_s=1.0) as slow:
        job_id = url_job(relay, user_a, f"{slow.url}/d.jpg")
        started = time.monotonic()
        assert dispatch.run_once(relay) == 0
        assert time.monotonic() - started < 0.5 and slow.connections == 0
    assert job(relay.engine, job_id).flow_run_id is None


def test_one_pass_finishes_every_fetch_it_started(relay: Relay, engine: Engine) -> None:
    """``reconcile``'s pass waits for its fetches: none is cut because the pass is ending
    (a fetch thread that had not yet started its deadline when the pass closed the lane
    used to be cut, its job left queued)."""
    photo = source_jpeg()
    owners = [make_user(engine, relay.settings, quota=10) for _ in range(4)]
    with receiver() as good:
        good.files["/photo.jpg"] = (200, {"content-type": "image/jpeg"}, photo)
        jobs = [url_job(relay, owner, f"{good.url}/photo.jpg") for owner in owners]
        assert fetch_lane.run_once(relay) == 4
    stored = [job(relay.engine, j) for j in jobs]
    assert all(s.source_key is not None for s in stored), [s.source_key for s in stored]
    assert dispatch.run_once(relay) == 4


LARGE = (6000, 4000)  # 24 MP from a flat PNG of ≈ 30 KB: within the 40 MP per-image limit
TARGET_PIXELS = 512 * 512  # the harness's stored target (faceflow.testing.jobs.target_jpeg)


def serve_large(server: Receiver) -> str:
    """The URL of a flat PNG of ``LARGE`` dimensions on ``server``."""
    server.files["/large.png"] = (200, {"content-type": "image/png"}, flat_png(*LARGE))
    return f"{server.url}/large.png"


def test_a_fetched_input_counts_in_the_jobs_pixels_at_its_own_size(
    relay: Relay, user_a: crud.NewUser
) -> None:
    """Submit counts an input URL at the per-image limit (40 MP); once the lane has fetched
    it, ``input_pixels`` holds its own size, read from its header, and the batch planner
    sees that: two such jobs (24.3 MP each) share a run under a 50 MP batch budget, which
    the count at submit (40.3 MP each) kept apart."""
    limits = relay.settings.image_limits
    with receiver() as server:
        url = serve_large(server)
        jobs = [url_job(relay, user_a, url) for _ in range(2)]
        submitted = {job(relay.engine, j).input_pixels for j in jobs}
        assert fetch_lane.run_once(relay) == 2
    assert submitted == {limits.max_pixels + TARGET_PIXELS}
    fetched = [job(relay.engine, j) for j in jobs]
    assert all(f.status is JobStatus.queued and f.source_key for f in fetched)
    assert {f.input_pixels for f in fetched} == {LARGE[0] * LARGE[1] + TARGET_PIXELS}
    planned = [(Outbox(kind="dispatch", job_id=f.id), runs.plan_of(f, 1)) for f in fetched]
    budget = limits.model_copy(update={"max_batch_pixels": 50_000_000})
    assert [len(chunk.plans) for chunk in batches.group(planned, 8, budget)] == [2]


def test_fetched_images_past_the_job_budget_fail_the_job_with_job_too_large(
    relay: Relay, user_a: crud.NewUser
) -> None:
    """Under the limits it was admitted with, a job's fetched images cannot pass its budget
    (a URL counted at the per-image limit; a larger image is ``image_too_large``); the relay
    checks them against the limits it holds now: a job queued before the budget was lowered
    to 20 MP fails on its 24.3 MP with submit's permanent ``job_too_large``, fetched once,
    never dispatched."""
    with receiver() as server:
        job_id = url_job(relay, user_a, serve_large(server))
        limits = relay.settings.image_limits.model_copy(update={"max_job_pixels": 20_000_000})
        relay.settings = relay.settings.model_copy(update={"image_limits": limits})
        assert fetch_lane.run_once(relay) == 1
        assert fetch_lane.run_once(relay) == 0  # nothing left to fetch, no retry
        gets = [r.path for r in server.requests]
    failed = job(relay.engine, job_id)
    assert (failed.status, failed.error_code) == (JobStatus.failed, "job_too_large")
    assert failed.error_message == (
        "The job's images decode to 24.3 megapixels together, over the budget of 20.0 per job."
    )
    assert failed.flow_run_id is None and failed.source_key is None
    assert gets == ["/large.png"]
    [row] = outbox_of(relay.engine, job_id)
    assert row.outcome == "done" and row.attempts == 0


def test_a_target_url_that_serves_a_video_is_spooled_probed_and_sent_to_fuse_video(
    relay: Relay,
    settings: Settings,
    user_a: crud.NewUser,
    videos: Videos,
    prefect_server: PrefectServer,
) -> None:
    """A target URL serving an MP4 (over loopback): streamed to a temporary file and hashed,
    probed, stored by content as an upload is; the job becomes a video job (the video
    deadline, chosen at submit from the URL's .mp4) and its run is created on the
    fuse-video deployment. A truncated video fails invalid_video, one over the byte limit
    video_too_large, as at upload; no temporary file is left."""
    from fastapi.testclient import TestClient

    from faceflow.testing.jobs import auth, data_uri
    from faceflow.testing.relay import stand_in_flow
    from flows.params import VIDEO_DEPLOYMENT_NAME, VIDEO_FLOW_NAME, input_key
    from tasks.options import VideoLimits
    from webapi.main import create_app

    stand_in_flow(VIDEO_FLOW_NAME).to_deployment(name=VIDEO_DEPLOYMENT_NAME).apply()
    data = videos.silent.read_bytes()
    spools = set(Path(tempfile.gettempdir()).glob("faceflow-fetch-*"))
    with receiver() as server, TestClient(create_app(settings)) as client:
        server.files["/clip.mp4"] = (200, {"content-type": "video/mp4"}, data)
        server.files["/cut.mp4"] = (200, {"content-type": "video/mp4"}, data[: len(data) // 2])

        def post(path: str) -> uuid.UUID:
            body = {"source": data_uri(source_jpeg()), "target": f"{server.url}{path}"}
            response = client.post("/v1/jobs", json=body, headers=auth(user_a))
            assert response.status_code == 202, response.text
            return uuid.UUID(response.json()["id"])

        good, cut = post("/clip.mp4"), post("/cut.mp4")
        assert fetch_lane.run_once(relay) == 2
        server.files["/big.mp4"] = server.files["/clip.mp4"]
        big = post("/big.mp4")
        limits = {"video_limits": VideoLimits(max_bytes=5000)}
        assert fetch_lane.run_once(replace(relay, settings=settings.model_copy(update=limits))) == 1
    fetched = job(relay.engine, good)
    assert fetched.media == "video" and fetched.status is JobStatus.queued
    assert fetched.target_key == input_key(hashlib.sha256(data).hexdigest(), "mp4")
    assert relay.store.get(fetched.target_key) == data
    assert fetched.video_input is not None and fetched.video_input["frame_count"] == 30
    deadline_s = (fetched.deadline_at - fetched.created_at).total_seconds()
    assert deadline_s == settings.default_video_deadline_seconds
    assert (job(relay.engine, cut).status, job(relay.engine, cut).error_code) == (
        JobStatus.failed,
        "invalid_video",
    )
    assert job(relay.engine, big).error_code == "video_too_large"
    assert set(Path(tempfile.gettempdir()).glob("faceflow-fetch-*")) == spools

    assert dispatch.run_once(relay) == 1
    [run] = prefect_server.rest.runs_of_job(good)
    assert run["deployment_id"] == relay.prefect.deployment_id(
        VIDEO_FLOW_NAME, VIDEO_DEPLOYMENT_NAME
    )
