"""Video targets at submit, against real SQLite and PostgreSQL and real videos (PyAV):
streamed multipart uploads probed and stored, data: URIs, refusals before anything queues,
idempotency over the video's bytes, and result downloads with Range (206)."""

from __future__ import annotations

import hashlib
import json
import socket
import tempfile
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient
from sqlalchemy.engine import Engine
from sqlmodel import Session, col

from faceflow.testing.jobs import (
    auth,
    data_uri,
    finished_job,
    jobs_of,
    make_user,
    new_job,
    outbox_of,
    source_jpeg,
    succeed,
    target_jpeg,
)
from flows.params import FuseFacesParams, input_key
from tests.videos import Videos
from tests.webapi.conftest import make_settings
from webapi import capacity
from webapi.config import Settings
from webapi.crud import NewUser
from webapi.main import create_app
from webapi.models import Job, utcnow
from webapi.ranges import byte_range
from webapi.storage import LocalObjectStore


def _store(settings: Settings) -> LocalObjectStore:
    return LocalObjectStore(Path(settings.storage_url.removeprefix("file://")))


def _stored_files(settings: Settings) -> set[Path]:
    root = _store(settings).basepath
    return {p for p in root.rglob("*") if p.is_file()} if root.exists() else set()


def _left_nothing(engine: Engine, user: NewUser, settings: Settings, before: set[Path]) -> bool:
    """No job of ``user``, and no video stored since ``before`` (the source photo may stay:
    stored by content, shared)."""
    new_videos = [p for p in _stored_files(settings) - before if p.suffix == ".mp4"]
    return jobs_of(engine, user.user.id) == [] and not new_videos


def _post_video(
    client: TestClient | httpx.Client,
    headers: dict[str, str],
    video: bytes,
    *,
    name: str = "clip.mp4",
    params: dict[str, Any] | None = None,
    extra: dict[str, str] | None = None,
) -> Any:
    files = [
        ("source", ("face.jpg", source_jpeg(), "image/jpeg")),
        ("target", (name, video, "video/mp4")),
    ]
    data = {"params": json.dumps(params)} if params is not None else None
    return client.post("/v1/jobs", files=files, data=data, headers={**headers, **(extra or {})})


def _error(response: Any) -> str:
    return str(response.json()["error"]["code"])


def test_a_multipart_video_is_probed_stored_and_queued_for_fuse_video(
    client: TestClient, engine: Engine, settings: Settings, videos: Videos
) -> None:
    user = make_user(engine, settings)
    data = videos.story.read_bytes()
    response = _post_video(client, auth(user), data, params={"deadline_seconds": 900})
    assert response.status_code == 202, response.text
    job = response.json()
    assert job["media"] == "video" and job["status"] == "queued"
    probe = job["video"]
    assert probe["container"] == "mp4" and probe["video_codec"] == "h264"
    assert (probe["width"], probe["height"], probe["frame_count"]) == (480, 360, 90)
    assert probe["audio"] is True and probe["size_bytes"] == len(data)
    assert abs(probe["duration_s"] - 6.0) < 0.01 and abs(probe["fps"] - 15.0) < 0.01

    [stored] = jobs_of(engine, user.user.id)
    key = input_key(hashlib.sha256(data).hexdigest(), "mp4")
    assert stored.media == "video" and stored.target_key == key
    assert _store(settings).get(key) == data  # the bytes as sent, by content hash
    assert (stored.deadline_at - stored.created_at).total_seconds() == 900
    assert stored.input_pixels is not None and stored.input_pixels >= 480 * 360
    [row] = outbox_of(engine, stored.id)
    assert row.kind == "dispatch"


def test_a_video_job_takes_the_video_deadline_by_default_and_may_ask_for_longer(
    client: TestClient, engine: Engine, settings: Settings, videos: Videos
) -> None:
    user = make_user(engine, settings)
    data = videos.silent.read_bytes()
    assert _post_video(client, auth(user), data).json()["media"] == "video"
    [job] = jobs_of(engine, user.user.id)
    deadline_s = (job.deadline_at - job.created_at).total_seconds()
    assert deadline_s == settings.default_video_deadline_seconds
    longer = {"deadline_seconds": settings.max_deadline_seconds + 60}
    assert _post_video(client, auth(user), data, params=longer).status_code == 202
    too_long = {"deadline_seconds": settings.max_video_deadline_seconds + 1}
    response = _post_video(client, auth(user), data, params=too_long)
    assert response.status_code == 422 and "deadline_seconds" in response.text


def test_a_small_video_may_come_as_a_data_uri(
    client: TestClient, engine: Engine, user: NewUser, videos: Videos
) -> None:
    body = {
        "source": data_uri(source_jpeg()),
        "target": data_uri(videos.silent.read_bytes(), "video/mp4"),
    }
    response = client.post("/v1/jobs", json=body, headers=auth(user))
    assert response.status_code == 202, response.text
    assert response.json()["media"] == "video"
    assert response.json()["video"]["audio"] is False


@pytest.mark.parametrize(
    ("limits", "status", "code"),
    [
        ({"max_duration_s": 2.0}, 422, "video_too_long"),
        ({"max_side": 320}, 422, "video_resolution_too_high"),
        ({"max_fps": 10.0}, 422, "video_frame_rate_too_high"),
        ({"max_bytes": 50_000}, 413, "video_too_large"),
    ],
)
def test_an_over_limit_video_is_refused_before_it_queues(
    database_url: str,
    engine: Engine,
    tmp_path: Path,
    videos: Videos,
    limits: dict[str, float],
    status: int,
    code: str,
) -> None:
    settings = make_settings(database_url, tmp_path, video_limits=limits)
    user = make_user(engine, settings)
    with TestClient(create_app(settings)) as client:
        before = _stored_files(settings)
        response = _post_video(client, auth(user), videos.story.read_bytes())
        assert response.status_code == status, response.text
        assert _error(response) == code
        assert _left_nothing(engine, user, settings, before)


@pytest.mark.parametrize("cut", ["half", "header"])
def test_a_truncated_or_corrupt_video_is_refused_and_leaves_nothing(
    client: TestClient, engine: Engine, settings: Settings, videos: Videos, cut: str
) -> None:
    user = make_user(engine, settings)
    data = videos.story.read_bytes()
    # half: +faststart keeps the index whole, half of the frames are missing;
    # header: a valid ftyp box and then garbage
    broken = data[: len(data) // 2] if cut == "half" else data[:32] + bytes(range(256)) * 64
    before = _stored_files(settings)
    response = _post_video(client, auth(user), broken)
    assert response.status_code == 422, response.text
    assert _error(response) == "invalid_video"
    assert _left_nothing(engine, user, settings, before)


def test_a_mapped_video_is_accepted_and_its_mapping_reaches_the_fuse_video_run(
    client: TestClient, engine: Engine, settings: Settings, videos: Videos
) -> None:
    """Two sources, a reference and a mapping (a key-frame face number and a reference)
    with a video target: accepted, every image stored, and the relay's fuse-video run
    parameters carry the mapping and the images' keys, which the flow takes."""
    import inspect

    from flows.video import fuse_video_flow  # the pipeline: only this test needs it
    from webapi.prefect_api import sent_parameters
    from webapi.relay.runner import build_relay
    from webapi.relay.runs import bound_attempt, plan_of

    user = make_user(engine, settings)
    entries = [{"source": 0, "target": 0}, {"source": 1, "reference": 0}]
    files = [
        ("source", ("a.jpg", source_jpeg(), "image/jpeg")),
        ("source", ("b.jpg", target_jpeg(), "image/jpeg")),
        ("target", ("pair.mp4", videos.pair.read_bytes(), "video/mp4")),
        ("reference", ("r.jpg", source_jpeg(), "image/jpeg")),
    ]
    params = {"options": {"mapping": entries}}
    response = client.post(
        "/v1/jobs", files=files, data={"params": json.dumps(params)}, headers=auth(user)
    )
    assert response.status_code == 202, response.text
    assert response.json()["media"] == "video"
    assert response.json()["options"]["mapping"] == [
        {"source": 0, "target": 0, "reference": None},
        {"source": 1, "target": None, "reference": 0},
    ]
    [job] = jobs_of(engine, user.user.id)
    assert job.extra_inputs is not None
    [second], [reference] = job.extra_inputs["sources"], job.extra_inputs["references"]
    assert _store(settings).get(reference) == source_jpeg()

    relay = build_relay(settings, engine=engine, store=_store(settings))
    try:
        plan = plan_of(job, 1)
        assert plan.media == "video" and plan.alone
        sent = sent_parameters(bound_attempt(relay, plan, FuseFacesParams))
    finally:
        relay.close()
    assert sent["extra_source_keys"] == [second] and sent["reference_keys"] == [reference]
    assert sent["options"] == {"mapping": entries}
    inspect.signature(fuse_video_flow.fn).bind(**sent)  # the flow takes every parameter


def test_a_video_mapping_that_does_not_fit_is_refused_with_invalid_mapping(
    client: TestClient, engine: Engine, settings: Settings, videos: Videos
) -> None:
    user = make_user(engine, settings)
    video = ("target", ("pair.mp4", videos.pair.read_bytes(), "video/mp4"))
    two = [("source", (f"{n}.jpg", source_jpeg(), "image/jpeg")) for n in "ab"]
    reference = ("reference", ("r.jpg", source_jpeg(), "image/jpeg"))
    bad = [
        (two, []),  # several sources, no mapping
        (two, [{"source": 0, "target": 0}, {"source": 1, "target": 0}]),  # one face twice
        (two, [{"source": 0, "target": 0}, {"source": 2, "target": 1}]),  # no source 2
        ([*two, reference], [{"source": 0, "target": 0}, {"source": 1, "target": 1}]),
        (two, [{"source": 0, "reference": 0}]),  # no reference given
    ]
    for parts, entries in bad:
        response = client.post(
            "/v1/jobs",
            files=[*parts, video],
            data={"params": json.dumps({"options": {"mapping": entries}})},
            headers=auth(user),
        )
        assert response.status_code == 422, (entries, response.text)
        assert _error(response) == "invalid_mapping", response.text
    assert jobs_of(engine, user.user.id) == []


def test_a_video_source_is_refused(
    client: TestClient, engine: Engine, user: NewUser, videos: Videos
) -> None:
    files = [
        ("source", ("a.mp4", videos.silent.read_bytes(), "video/mp4")),
        ("target", ("clip.mp4", videos.silent.read_bytes(), "video/mp4")),
    ]
    response = client.post("/v1/jobs", files=files, headers=auth(user))
    assert response.status_code in (413, 415, 422), response.text
    assert jobs_of(engine, user.user.id) == []


def test_the_idempotency_digest_covers_the_video_bytes(
    client: TestClient, engine: Engine, user: NewUser, videos: Videos
) -> None:
    key = {"Idempotency-Key": f"video-{uuid.uuid4()}"}
    first = _post_video(client, auth(user), videos.silent.read_bytes(), extra=key)
    again = _post_video(client, auth(user), videos.silent.read_bytes(), extra=key)
    assert (first.status_code, again.status_code) == (202, 200)
    assert first.json()["id"] == again.json()["id"]
    other = _post_video(client, auth(user), videos.story.read_bytes(), extra=key)
    assert other.status_code == 409, other.text


# --------------------------------------------------------------------------- result


def test_a_video_result_is_streamed_and_answers_range_requests(
    client: TestClient, engine: Engine, settings: Settings, videos: Videos
) -> None:
    user = make_user(engine, settings)
    job_id = _post_video(client, auth(user), videos.silent.read_bytes()).json()["id"]
    result = videos.story.read_bytes()
    key = f"results/{job_id}/attempt-1.mp4"
    _store(settings).put(key, result, content_type="video/mp4")
    succeed(engine, job_id, result_key=key, content_type="video/mp4", size=(480, 360))
    url = f"/v1/jobs/{job_id}/result"

    whole = client.get(url, headers=auth(user))
    assert whole.status_code == 200 and whole.content == result
    assert whole.headers["accept-ranges"] == "bytes"
    assert whole.headers["content-type"] == "video/mp4"
    assert int(whole.headers["content-length"]) == len(result)

    part = client.get(url, headers={**auth(user), "Range": "bytes=100-2099"})
    assert part.status_code == 206 and part.content == result[100:2100]
    assert part.headers["content-range"] == f"bytes 100-2099/{len(result)}"
    tail = client.get(url, headers={**auth(user), "Range": "bytes=-500"})
    assert tail.status_code == 206 and tail.content == result[-500:]
    rest = client.get(url, headers={**auth(user), "Range": f"bytes={len(result) - 10}-"})
    assert rest.status_code == 206 and rest.content == result[-10:]
    beyond = client.get(url, headers={**auth(user), "Range": f"bytes={len(result)}-"})
    assert beyond.status_code == 416
    assert beyond.headers["content-range"] == f"bytes */{len(result)}"
    several = client.get(url, headers={**auth(user), "Range": "bytes=0-1,5-9"})
    assert several.status_code == 200 and several.content == result  # ignored, whole


@pytest.mark.parametrize(
    ("header", "size", "expected"),
    [
        (None, 10, None),
        ("bytes=0-0", 10, (0, 0)),
        ("bytes=2-", 10, (2, 9)),
        ("bytes=2-100", 10, (2, 9)),
        ("bytes=-3", 10, (7, 9)),
        ("bytes=-30", 10, (0, 9)),
        ("BYTES = 1 - 2", 10, (1, 2)),
        ("items=0-1", 10, None),
        ("bytes=0-1,4-5", 10, None),
        ("bytes=-", 10, None),
    ],
)
def test_byte_ranges(header: str | None, size: int, expected: tuple[int, int] | None) -> None:
    assert byte_range(header, size) == expected


@pytest.mark.parametrize(
    ("header", "size"), [("bytes=10-", 10), ("bytes=5-4", 10), ("bytes=-0", 10), ("bytes=-1", 0)]
)
def test_unsatisfiable_ranges(header: str, size: int) -> None:
    from webapi.errors import RangeNotSatisfiable

    with pytest.raises(RangeNotSatisfiable):
        byte_range(header, size)


def test_an_upload_cut_off_midway_loses_nothing_and_leaves_no_files(
    live_url: str, engine: Engine, settings: Settings, videos: Videos
) -> None:
    """A client that disconnects halfway through a video upload: no job, no stored video,
    no temporary file; the next upload of the same video is accepted."""
    user = make_user(engine, settings)
    boundary = "faceflowboundary"
    video = videos.story.read_bytes()
    head = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="source"; filename="a.jpg"\r\n'
        f"Content-Type: image/jpeg\r\n\r\n"
    ).encode() + source_jpeg()
    head += (
        f'\r\n--{boundary}\r\nContent-Disposition: form-data; name="target"; '
        f'filename="clip.mp4"\r\nContent-Type: video/mp4\r\n\r\n'
    ).encode()
    tail = f"\r\n--{boundary}--\r\n".encode()
    before_tmp = set(Path(tempfile.gettempdir()).glob("faceflow-upload-*"))
    before = _stored_files(settings)
    host, port = live_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(
            (
                f"POST /v1/jobs HTTP/1.1\r\nHost: {host}\r\n"
                f"Authorization: Bearer {user.api_key}\r\n"
                f"Content-Type: multipart/form-data; boundary={boundary}\r\n"
                f"Content-Length: {len(head) + len(video) + len(tail)}\r\n\r\n"
            ).encode()
            + head
            + video[: len(video) // 2]
        )
        time.sleep(0.5)  # the server has read what was sent
    time.sleep(1.0)
    assert _left_nothing(engine, user, settings, before)
    assert set(Path(tempfile.gettempdir()).glob("faceflow-upload-*")) == before_tmp
    with httpx.Client(base_url=live_url, timeout=60) as client:
        response = _post_video(client, auth(user), video)
    assert response.status_code == 202, response.text


def _as_video(engine: Engine, job_id: uuid.UUID, **values: Any) -> None:
    """Make the job a video job of the given probe, progress, report and times (rows as
    the relay leaves them), without running one."""
    with Session(engine) as session:
        session.execute(sa.update(Job).where(col(Job.id) == job_id).values(media="video", **values))
        session.commit()
    capacity.reset_service_time_cache()


def test_a_finished_video_is_not_a_photo_job_in_the_service_time(
    database_url: str, tmp_path: Path, engine: Engine
) -> None:
    """A 10-minute video job's latency must not become what each photo job is taken to
    cost: the photo estimate reads photo jobs only, the per-frame one video jobs only."""
    settings = make_settings(database_url, tmp_path, worker_slots=4)
    user = make_user(engine, settings)
    t0 = utcnow() - timedelta(hours=1)
    for i in range(3):
        created = t0 + timedelta(seconds=10 * i)
        finished_job(engine, settings, user, created=created, started=created,
                     finished=created + timedelta(seconds=2))  # fmt: skip
    video = finished_job(engine, settings, user, created=t0, started=t0 + timedelta(seconds=40),
                         finished=t0 + timedelta(seconds=640))  # fmt: skip
    _as_video(engine, video, video_input={"frame_count": 3000, "fps": 25.0},
              video_report={"frames": 3000, "chunks": 12})  # fmt: skip
    with Session(engine) as session:
        assert capacity.service_seconds(session, settings=settings) == pytest.approx(2.0)
        # 600 s over 3000 frames on up to 4 workers (12 chunks): 0.8 worker-seconds a frame
        assert capacity.frame_estimate(session, settings=settings) == pytest.approx(0.8)


def test_admission_counts_a_video_by_its_frames_and_never_refuses_photos_for_it(
    database_url: str, tmp_path: Path, engine: Engine, videos: Videos
) -> None:
    """Two queued 3000-frame videos at 0.1 s a frame are 600 s of work: a third video is
    refused (503, it would not start within its 300 s queue timeout) while photo jobs, on
    queues of their own, are admitted (before, each video counted as one photo job)."""
    settings = make_settings(database_url, tmp_path, default_frame_seconds=0.1,
                             default_queue_timeout_seconds=300)  # fmt: skip
    user = make_user(engine, settings, quota=50)
    for _ in range(2):
        job = new_job(engine, settings, user)
        _as_video(engine, job.id, video_input={"frame_count": 3000, "fps": 25.0})
    with TestClient(create_app(settings)) as client:
        with Session(engine) as session:
            load = capacity.backlog(session, settings=settings)
        assert load.video is not None and load.video.frames_queued == 6000
        assert load.queued == 0 and load.video_wait_s() == pytest.approx(600.0)
        params = {"queue_timeout_seconds": 300}
        refused = _post_video(client, auth(user), videos.silent.read_bytes(), params=params)
        assert refused.status_code == 503 and _error(refused) == "overloaded", refused.text
        assert "Retry-After" in refused.headers
        photo = client.post("/v1/jobs", files=[
            ("source", ("s.jpg", source_jpeg(), "image/jpeg")),
            ("target", ("t.jpg", target_jpeg(), "image/jpeg")),
        ], headers=auth(user))  # fmt: skip
        assert photo.status_code == 202, photo.text
        # once the videos are under way, the photo's wait is half a chunk per busy worker
        for job in jobs_of(engine, user.user.id)[:2]:
            _as_video(engine, job.id, status="running", progress={"frames_done": 2900})
        with Session(engine) as session:
            load = capacity.backlog(session, settings=settings)
        assert load.video is not None and load.video.frames_left == 200
        # one slot, so one worker renders: on average half of the 100 frames its video has
        # left (less than a 250-frame chunk) at 0.1 s, then the photo queued before
        assert load.wait_s("normal") == pytest.approx(100 / 2 * 0.1 + 1 * load.service_s)
