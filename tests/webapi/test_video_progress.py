"""A running video job's progress on the job store (real SQLite and PostgreSQL, a real
local object store): the relay copies the flow's progress record onto the job, the API
shows it, and a subscribed job gets at most one ``job.progress`` webhook per 5 s."""

from __future__ import annotations

import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy.engine import Engine
from sqlmodel import Session

from faceflow.testing.jobs import auth, dispatch, make_user, move, new_job, outbox_of
from flows.params import JobProgress, progress_key
from webapi.config import Settings
from webapi.inputs import InputRef
from webapi.jobstate import record_progress
from webapi.models import Job, JobStatus, utcnow
from webapi.prefect_api import PrefectAPI
from webapi.relay.context import Relay
from webapi.relay.outcomes import watched_jobs
from webapi.relay.sync import video_progress
from webapi.storage import LocalObjectStore


def _video_job(engine: Engine, settings: Settings, **create: Any) -> tuple[Job, uuid.UUID]:
    user = make_user(engine, settings)
    target = InputRef(
        name="target", digest="ab" * 32, key=f"inputs/ab/{'ab' * 32}.mp4", media="video"
    )
    job = new_job(engine, settings, user, target=target, **create)
    run = dispatch(engine, job.id)
    move(engine, job.id, JobStatus.running, JobStatus.queued, stage="analyse")
    return job, run


def _record(
    frames: int, chunks: int, stage: str = "render_chunk", analysed: int = 90
) -> JobProgress:
    return JobProgress(
        frames_analysed=analysed,
        frames_done=frames,
        frames_total=90,
        chunks_done=chunks,
        chunks_total=3,
        fps=5.0,
        eta_seconds=(90 - frames) / 5,
        stage=stage,
        updated_at=utcnow(),
    )


def test_the_relay_copies_a_video_jobs_progress_and_the_api_shows_it(
    client: TestClient, engine: Engine, settings: Settings, tmp_path: Path
) -> None:
    user = make_user(engine, settings)
    store = LocalObjectStore(Path(settings.storage_url.removeprefix("file://")))
    relay = Relay(
        engine=engine, prefect=PrefectAPI("http://127.0.0.1:9/api"), store=store, settings=settings
    )
    try:
        target = InputRef(name="target", digest="cd" * 32, key="inputs/cd/x.mp4", media="video")
        job = new_job(engine, settings, user, target=target)
        dispatch(engine, job.id)
        move(engine, job.id, JobStatus.running, JobStatus.queued, stage="analyse")
        [watched] = [w for w in watched_jobs(relay) if w.job_id == job.id]
        assert watched.media == "video"
        assert not video_progress(relay, watched)  # no record yet: nothing to copy

        key = progress_key(str(job.id), 1)
        store.put(key, _record(0, 0, "analyse", analysed=24).model_dump_json().encode())
        assert video_progress(relay, watched)  # the analysis advances before any render
        shown = client.get(f"/v1/jobs/{job.id}", headers=auth(user)).json()
        assert (shown["progress"]["frames_analysed"], shown["progress"]["stage"]) == (24, "analyse")
        [watched] = [w for w in watched_jobs(relay) if w.job_id == job.id]
        store.put(key, _record(0, 0, "analyse", analysed=48).model_dump_json().encode())
        assert video_progress(relay, watched)  # frames analysed alone is worth a write
        [watched] = [w for w in watched_jobs(relay) if w.job_id == job.id]
        store.put(key, _record(30, 1).model_dump_json().encode())
        assert video_progress(relay, watched)
        shown = client.get(f"/v1/jobs/{job.id}", headers=auth(user)).json()
        assert shown["media"] == "video"
        progress = shown["progress"]
        assert (progress["frames_done"], progress["frames_total"]) == (30, 90)
        assert (progress["chunks_done"], progress["eta_seconds"]) == (1, 12.0)
        assert "notified_at" not in progress

        [watched] = [w for w in watched_jobs(relay) if w.job_id == job.id]
        assert not video_progress(relay, watched)  # the same progress: no write
        store.put(key, _record(45, 1).model_dump_json().encode())
        assert video_progress(relay, watched)
    finally:
        relay.close()


def test_job_progress_webhooks_are_opt_in_and_at_most_one_per_five_seconds(
    engine: Engine, settings: Settings
) -> None:
    job, run = _video_job(
        engine,
        settings,
        callback_url="https://hooks.example.test/faceflow",
        callback_events=["job.progress", "job.succeeded"],
    )
    start = utcnow()

    def write(frames: int, after_s: float) -> bool:
        with Session(engine) as session:
            return record_progress(
                session,
                job_id=job.id,
                flow_run_id=run,
                progress=_record(frames, 0).model_dump(mode="json"),
                now=start + timedelta(seconds=after_s),
            )

    def progress_hooks() -> list[dict[str, Any]]:  # JSON bodies
        rows = [r for r in outbox_of(engine, job.id) if r.kind == "webhook"]
        return [r.payload["body"] for r in rows if r.payload["event"] == "job.progress"]

    with Session(engine) as session:  # the analysis's progress is sent as it advances
        analysing = _record(0, 0, "analyse", analysed=16).model_dump(mode="json")
        assert record_progress(
            session, job_id=job.id, flow_run_id=run, progress=analysing, now=start
        )
    first = progress_hooks()[0]["data"]["progress"]
    assert (first["frames_analysed"], first["frames_done"], first["stage"]) == (16, 0, "analyse")
    start += timedelta(seconds=5)
    assert write(10, 0.0) and len(progress_hooks()) == 2
    assert write(20, 2.0) and len(progress_hooks()) == 2  # within 5 s: stored, not sent
    assert write(30, 4.9) and len(progress_hooks()) == 2
    assert write(40, 5.1) and len(progress_hooks()) == 3
    bodies = progress_hooks()
    assert [b["data"]["progress"]["frames_done"] for b in bodies] == [0, 10, 40]
    assert all("notified_at" not in b["data"]["progress"] for b in bodies)
    # a stale run never writes
    with Session(engine) as session:
        assert not record_progress(
            session, job_id=job.id, flow_run_id=uuid.uuid4(), progress=_record(60, 0).model_dump()
        )


def test_without_the_event_no_progress_webhook_is_queued(
    engine: Engine, settings: Settings
) -> None:
    job, run = _video_job(
        engine, settings, callback_url="https://hooks.example.test/faceflow"
    )  # default events: the terminal ones
    with Session(engine) as session:
        assert record_progress(
            session, job_id=job.id, flow_run_id=run, progress=_record(10, 0).model_dump(mode="json")
        )
    assert [r for r in outbox_of(engine, job.id) if r.kind == "webhook"] == []


def test_the_openapi_document_describes_both_passes_of_a_videos_progress(
    client: TestClient,
) -> None:
    schema = client.get("/openapi.json").json()["components"]["schemas"]["JobProgress"]
    fields = schema["properties"]
    assert {"frames_analysed", "frames_done", "frames_total", "eta_seconds"} <= set(fields)
    assert "analysis" in fields["frames_analysed"]["description"]
    assert "analysis" in fields["eta_seconds"]["description"]
    assert "render" in fields["eta_seconds"]["description"]
