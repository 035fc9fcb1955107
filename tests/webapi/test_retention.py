"""Retention (``webapi.retention``) on SQLite and PostgreSQL, local storage and a moto S3
server: inputs go when the job ends, results after their retention (then 410), rows after
theirs; shared inputs and jobs that have not ended are never touched."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import uuid
from datetime import timedelta
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.engine import Engine
from sqlmodel import Session

from faceflow.testing.jobs import (
    auth,
    image_bytes,
    jobs_of,
    make_user,
    move,
    new_job,
    source_jpeg,
    succeed,
    target_jpeg,
)
from flows.params import (
    analysis_manifest_key,
    analysis_part,
    chunk_part,
    chunks_manifest_key,
    part_progress_key,
    progress_key,
    result_error_key,
    result_key,
    result_meta_key,
    video_plan_key,
    video_report_key,
)
from tasks.partials import is_partial_name
from tests.webapi.conftest import make_settings
from webapi import crud
from webapi.config import Settings
from webapi.errors import InputsPurged
from webapi.inputs import InputRef, store_image
from webapi.main import create_app
from webapi.models import Job, JobCreate, JobStatus, utcnow
from webapi.retention import PARTIAL_MAX_AGE_S, result_keys, run_pass
from webapi.storage import LocalObjectStore, ObjectStore, open_store

REPO = Path(__file__).resolve().parents[2]

HOUR = 3600


@pytest.fixture(params=["local", "s3"])
def storage_url(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, str | None]:
    """Where inputs and results live: a local directory or a prefix in a moto bucket."""
    if request.param == "local":
        return (tmp_path / "storage").as_uri(), None
    endpoint: str = request.getfixturevalue("s3_endpoint")
    return f"s3://faceflow/{uuid.uuid4().hex}", endpoint


@pytest.fixture
def settings(database_url: str, tmp_path: Path, storage_url: tuple[str, str | None]) -> Settings:
    url, endpoint = storage_url
    return make_settings(
        database_url,
        tmp_path,
        storage_url=url,
        s3_endpoint_url=endpoint,
        result_retention_seconds=HOUR,
        job_retention_seconds=2 * HOUR,
    )


@pytest.fixture
def store(settings: Settings) -> ObjectStore:
    return open_store(settings.storage_url, s3_endpoint_url=settings.s3_endpoint_url)


def _stored(store: ObjectStore, data: bytes, name: str, settings: Settings) -> InputRef:
    return store_image(data, name=name, limits=settings.image_limits, store=store)


def _sample_inputs(store: ObjectStore, settings: Settings) -> tuple[InputRef, InputRef]:
    """The sample source and target photos, stored as a submit stores them."""
    source = _stored(store, source_jpeg(), "source", settings)
    return source, _stored(store, target_jpeg(), "target", settings)


def _finish_with_result(engine: Engine, store: ObjectStore, job: Job) -> str:
    key = result_key(str(job.id), 1, "png")
    store.put(key, image_bytes(64, 48))
    store.put(result_meta_key(str(job.id), 1), b"{}")
    succeed(engine, job.id, result_key=key)
    return key


def _get(engine: Engine, job_id: uuid.UUID) -> Job | None:
    with Session(engine, expire_on_commit=False) as session:
        return session.get(Job, job_id)


def test_inputs_results_and_rows_expire_in_turn_and_nothing_else(
    engine: Engine, settings: Settings, store: ObjectStore, user: crud.NewUser
) -> None:
    shared, own = _sample_inputs(store, settings)
    other = _stored(store, image_bytes(200, 160, "PNG"), "target", settings)
    done = new_job(engine, settings, user, source=shared, target=own)
    waiting = new_job(
        engine, settings, user, source=shared, target=other
    )  # never ends in this test
    result = _finish_with_result(engine, store, done)
    ended = _get(engine, done.id)
    assert ended is not None and ended.finished_at is not None
    assert ended.inputs_purge_at == ended.finished_at
    assert ended.result_purge_at == ended.finished_at + timedelta(seconds=HOUR)

    # At the end: the job's own input goes; the input shared with a queued job stays.
    report = run_pass(engine, store, settings)
    assert (report.input_jobs, report.input_objects, report.inputs_shared) == (1, 1, 1)
    assert not store.exists(own.key or "") and store.exists(shared.key or "")
    assert store.exists(other.key or "") and store.exists(result)
    assert report.result_jobs == 0 and report.rows_deleted == 0

    app = create_app(settings)
    with TestClient(app) as client:
        assert client.get(f"/v1/jobs/{done.id}/result", headers=auth(user)).status_code == 200
        body = client.get(f"/v1/jobs/{done.id}", headers=auth(user)).json()
        assert body["result_expires_at"] is not None and body["result_expired"] is False

        # After the result's retention: every attempt file goes, and the result is 410.
        later = utcnow() + timedelta(seconds=HOUR + 1)
        report = run_pass(engine, store, settings, now=later)
        assert (report.result_jobs, report.results_expired) == (1, 1)
        assert not store.exists(result) and not store.exists(result_meta_key(str(done.id), 1))
        response = client.get(f"/v1/jobs/{done.id}/result", headers=auth(user))
        assert response.status_code == 410
        assert response.json()["error"]["code"] == "result_expired"
        body = client.get(f"/v1/jobs/{done.id}", headers=auth(user)).json()
        assert body["status"] == "succeeded" and body["result"] is None
        assert body["result_expired"] is True

    # After the audit time the row goes; the queued job and its inputs are untouched.
    much_later = utcnow() + timedelta(seconds=2 * HOUR + 1)
    report = run_pass(engine, store, settings, now=much_later)
    assert report.rows_deleted == 1 and _get(engine, done.id) is None
    still = _get(engine, waiting.id)
    assert still is not None and still.status is JobStatus.queued
    assert still.inputs_purge_at is None and still.inputs_purged_at is None
    assert store.exists(shared.key or "") and store.exists(other.key or "")
    assert run_pass(engine, store, settings, now=much_later + timedelta(days=365)).rows_deleted == 0


def test_the_owner_s_retention_times_override_the_settings(
    engine: Engine, settings: Settings, store: ObjectStore
) -> None:
    keeper = make_user(engine, settings, input_retention_s=600, result_retention_s=60)
    source, target = _sample_inputs(store, settings)
    job = new_job(engine, settings, keeper, source=source, target=target)
    assert (job.input_retention_s, job.result_retention_s) == (600, 60)
    _finish_with_result(engine, store, job)
    ended = _get(engine, job.id)
    assert ended is not None and ended.finished_at is not None
    assert ended.inputs_purge_at == ended.finished_at + timedelta(seconds=600)
    report = run_pass(engine, store, settings, now=ended.finished_at + timedelta(seconds=61))
    assert (report.input_jobs, report.result_jobs) == (0, 1)  # inputs are not due yet
    assert store.exists(job.source_key or "")


def test_a_failed_job_loses_its_inputs_and_attempt_files_but_is_not_result_expired(
    engine: Engine, settings: Settings, store: ObjectStore, user: crud.NewUser
) -> None:
    source, target = _sample_inputs(store, settings)
    job = new_job(engine, settings, user, source=source, target=target)
    sidecar = result_meta_key(str(job.id), 1)
    store.put(sidecar, b"{}")  # a first attempt wrote its sidecar, then the job failed
    move(engine, job.id, JobStatus.failed, JobStatus.queued, error_code="x", error_message="y")
    report = run_pass(engine, store, settings, now=utcnow() + timedelta(seconds=HOUR + 1))
    assert (report.input_objects, report.result_jobs, report.results_expired) == (2, 1, 0)
    assert not store.exists(sidecar)
    ended = _get(engine, job.id)
    assert ended is not None and ended.result_expired_at is None
    assert ended.inputs_purged_at is not None


def test_a_submit_reusing_an_input_deleted_meanwhile_is_told_to_store_it_again(
    engine: Engine, settings: Settings, store: ObjectStore, user: crud.NewUser
) -> None:
    source, target = _sample_inputs(store, settings)
    old = new_job(engine, settings, user, source=source, target=target)
    move(engine, old.id, JobStatus.cancelled, JobStatus.queued)
    # A new submit found both inputs stored (its check ran before the pass)...
    late = crud.Submission(user.user, JobCreate.model_validate({}), source, target)
    assert run_pass(engine, store, settings).input_objects == 2  # ...then they were deleted
    with Session(engine, expire_on_commit=False) as session:
        (admission,) = crud.submit_jobs(session, submissions=[late], settings=settings, store=store)
    assert isinstance(admission.error, InputsPurged) and admission.job is None
    # Stored again (the route does this), it is admitted.
    again = crud.Submission(
        user.user, JobCreate.model_validate({}), *_sample_inputs(store, settings)
    )
    assert store.exists(source.key or "")
    with Session(engine, expire_on_commit=False) as session:
        (admission,) = crud.submit_jobs(
            session, submissions=[again], settings=settings, store=store
        )
    assert admission.error is None and admission.created


def test_result_keys_cover_every_attempt_and_format() -> None:
    job_id = uuid.uuid4()
    keys = result_keys(job_id, 2)
    assert result_key(str(job_id), 2, "webp") in keys and result_meta_key(str(job_id), 1) in keys
    assert result_key(str(job_id), 2, "mp4") in keys  # a video's result
    assert result_error_key(str(job_id), 1) in keys and progress_key(str(job_id), 2) in keys
    assert video_plan_key(str(job_id), 2) in keys  # a video attempt's face plan
    assert len(keys) == 2 * (4 + 4)


def test_a_retention_pass_over_many_jobs_touches_only_what_is_due(
    engine: Engine, settings: Settings, store: ObjectStore
) -> None:
    """60 ended jobs with results and inputs of their own, 10 not yet due, 5 queued."""
    user = make_user(engine, settings, quota=1000)
    due: list[uuid.UUID] = []
    fresh: list[uuid.UUID] = []
    queued: list[uuid.UUID] = []
    for index in range(75):
        source = _stored(store, image_bytes(120, 100 + index, "PNG"), "source", settings)
        target = _stored(store, image_bytes(100 + index, 120, "PNG"), "target", settings)
        job = new_job(engine, settings, user, source=source, target=target)
        if index < 70:
            _finish_with_result(engine, store, job)
        (due if index < 60 else fresh if index < 70 else queued).append(job.id)
    with Session(engine) as session:  # the due ones ended two hours ago
        for job_id in due:
            stored = session.get(Job, job_id)
            assert stored is not None and stored.finished_at is not None
            stored.result_purge_at = stored.finished_at - timedelta(seconds=1)
            session.add(stored)
        session.commit()
    report = run_pass(engine, store, settings.model_copy(update={"retention_batch": 16}))
    assert report.result_jobs == 60 and report.input_jobs == 70
    for job in jobs_of(engine, user.user.id):
        if job.id in due:
            assert job.result_expired_at is not None and not store.exists(job.result_key or "")
        elif job.id in fresh:
            assert job.result_expired_at is None and store.exists(job.result_key or "")
        else:
            assert job.status is JobStatus.queued
            assert store.exists(job.source_key or "") and store.exists(job.target_key or "")


def test_a_mapping_job_s_other_sources_and_references_expire_unless_still_used(
    engine: Engine, settings: Settings, store: ObjectStore, user: crud.NewUser
) -> None:
    source, target = _sample_inputs(store, settings)
    second = _stored(store, image_bytes(150, 140, "PNG"), "sources[1]", settings)
    reference = _stored(store, image_bytes(140, 150, "PNG"), "references[0]", settings)
    mapped = new_job(
        engine,
        settings,
        user,
        source=source,
        target=target,
        extra_sources=[second],
        references=[reference],
    )
    # A queued job whose mapping uses the same reference (in the JSON column only).
    other = new_job(
        engine,
        settings,
        user,
        source=_stored(store, image_bytes(130, 130, "PNG"), "source", settings),
        target=_stored(store, image_bytes(131, 131, "PNG"), "target", settings),
        references=[reference],
    )
    assert mapped.extra_inputs and other.extra_inputs
    move(engine, mapped.id, JobStatus.cancelled, JobStatus.queued)
    report = run_pass(engine, store, settings)
    assert (report.input_objects, report.inputs_shared) == (3, 1)
    assert not store.exists(second.key or "") and store.exists(reference.key or "")
    # A late submit that found the mapping's second source stored is told to store it again.
    late = crud.Submission(
        user.user,
        JobCreate.model_validate({}),
        _stored(store, image_bytes(132, 132, "PNG"), "source", settings),
        _stored(store, image_bytes(133, 133, "PNG"), "target", settings),
        extra_sources=(second,),
    )
    with Session(engine, expire_on_commit=False) as session:
        (admission,) = crud.submit_jobs(session, submissions=[late], settings=settings, store=store)
    assert isinstance(admission.error, InputsPurged)


def test_a_video_jobs_rendered_chunks_go_with_its_inputs(
    engine: Engine, settings: Settings, store: ObjectStore, user: crud.NewUser
) -> None:
    """A cancelled video job's attempts listed their chunks and analysed ranges: the first
    pass after its end deletes them, the lists and the parts' records; another job's chunk
    stays."""
    job = new_job(engine, settings, user)
    mine = [f"video-chunks/{uuid.uuid4().hex}-{i}.mp4" for i in range(3)]
    other = f"video-chunks/{uuid.uuid4().hex}-other.mp4"
    analysed = [f"video-analysis/analysis-{i * 8:06d}-{i * 8 + 8:06d}-{uuid.uuid4().hex}.npz"
                for i in range(2)]  # fmt: skip
    counted = [part_progress_key(str(job.id), 2, analysis_part(i * 8, i * 8 + 8)) for i in range(2)]
    for key in [*mine, other, *analysed, *counted]:
        store.put(key, b"segment")
    store.put(chunks_manifest_key(str(job.id), 1), json.dumps(mine[:2]).encode())
    store.put(chunks_manifest_key(str(job.id), 2), json.dumps(mine[1:]).encode())
    store.put(analysis_manifest_key(str(job.id), 2), json.dumps(analysed).encode())
    records = [part_progress_key(str(job.id), 2, chunk_part(1)), video_report_key(str(job.id), 2)]
    for key in records:  # a render part's frames, the report part's record
        store.put(key, b"{}")
    move(engine, job.id, JobStatus.queued, JobStatus.queued, flow_run_id=uuid.uuid4(), attempts=2)
    move(engine, job.id, JobStatus.cancelled, JobStatus.queued)
    report = run_pass(engine, store, settings, now=utcnow() + timedelta(seconds=1))
    assert report.input_jobs == 1
    assert not any(store.exists(key) for key in mine)
    assert not any(store.exists(key) for key in analysed)  # its analysed frame ranges
    assert not any(store.exists(key) for key in counted)  # and their parts' frame counts
    assert not any(store.exists(key) for key in records)  # its parts' records
    assert not store.exists(chunks_manifest_key(str(job.id), 1))
    assert not store.exists(analysis_manifest_key(str(job.id), 2))
    assert store.exists(other)


KILLED_WRITERS = {  # each store's own path for the key, written as its puts write
    "webapi": """
import os, signal, sys
from tasks.partials import replacing
from webapi.storage import LocalObjectStore
with replacing(LocalObjectStore(sys.argv[1])._path(sys.argv[2])) as tmp:
    tmp.write_bytes(b"half an upload")
    os.kill(os.getpid(), signal.SIGKILL)
""",
    "flows": """
import os, signal, sys
from prefect.filesystems import LocalFileSystem
from tasks.partials import replacing
with replacing(LocalFileSystem(basepath=sys.argv[1])._resolve_path(sys.argv[2])) as tmp:
    tmp.write_bytes(b"half a chunk")
    os.kill(os.getpid(), signal.SIGKILL)
""",
}


def test_a_killed_writers_temporary_files_go_after_an_hour(
    engine: Engine, database_url: str, tmp_path: Path
) -> None:
    """A writer killed between its write and its rename (the webapi storing an upload, a
    flow storing a chunk) leaves a temporary file in local storage: a pass deletes those
    older than an hour, and nothing else."""
    settings = make_settings(database_url, tmp_path, storage_url=(tmp_path / "s").as_uri())
    store = open_store(settings.storage_url)
    assert isinstance(store, LocalObjectStore)
    store.put("results/kept.png", b"result")
    for writer, script in KILLED_WRITERS.items():
        key = f"video-chunks/{writer}.mp4"
        done = subprocess.run([sys.executable, "-c", script, str(store.basepath), key], cwd=REPO)
        assert done.returncode == -signal.SIGKILL
        assert not store.exists(key)
    left = sorted(p for p in store.basepath.rglob("*") if p.is_file() and p.name != "kept.png")
    assert len(left) == 2 and all(is_partial_name(p.name) for p in left), left
    assert run_pass(engine, store, settings).partials_deleted == 0  # may still be writing
    later = utcnow() + timedelta(seconds=PARTIAL_MAX_AGE_S + 60)
    assert run_pass(engine, store, settings, now=later).partials_deleted == 2
    assert not any(p.exists() for p in left)
    assert store.get("results/kept.png") == b"result"
