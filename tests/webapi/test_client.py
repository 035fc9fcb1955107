"""The Python clients (``faceflow.client``) against the real app over loopback: the async
client submits, reads, cancels and maps errors as the sync one does."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from sqlalchemy.engine import Engine

from faceflow.client import AsyncFaceFlowClient, FaceFlowAPIError, FaceFlowClient, progress_line
from faceflow.testing.jobs import make_user, succeed
from tests import samples
from tests.videos import Videos
from webapi.config import Settings
from webapi.storage import LocalObjectStore


def test_the_async_client_does_what_the_sync_one_does(
    live_url: str, engine: Engine, settings: Settings
) -> None:
    user = make_user(engine, settings, quota=5)
    source, target = samples.astronaut_jpeg_bytes(), samples.grace_hopper_jpeg_bytes()

    async def use() -> tuple[dict[str, object], dict[str, object], int]:
        async with AsyncFaceFlowClient(live_url, user.api_key) as client:
            job = await client.submit(source, target, idempotency_key="async-1")
            again = await client.submit(source, target, idempotency_key="async-1")
            assert again["id"] == job["id"]
            read = await client.status(str(job["id"]))
            cancelled = await client.cancel(str(job["id"]))
            with pytest.raises(FaceFlowAPIError) as missing:
                await client.status("00000000-0000-0000-0000-000000000000")
            return read, cancelled, missing.value.status

    read, cancelled, status = asyncio.run(use())
    assert read["status"] == "queued" and status == 404
    assert cancelled["status"] in ("cancel_requested", "cancelled")
    with FaceFlowClient(live_url, user.api_key) as sync_client:
        assert sync_client.status(str(read["id"]))["status"] == cancelled["status"]


def test_the_clients_stream_a_video_file_and_download_a_result(
    live_url: str, engine: Engine, settings: Settings, videos: Videos, tmp_path: Path
) -> None:
    user = make_user(engine, settings, quota=5)
    face = tmp_path / "face.jpg"
    face.write_bytes(samples.grace_hopper_jpeg_bytes())
    with FaceFlowClient(live_url, user.api_key) as client:
        job = client.submit(face, videos.silent)
        assert job["media"] == "video" and job["video"]["frame_count"] == 30
        result = videos.story.read_bytes()
        store = LocalObjectStore(Path(settings.storage_url.removeprefix("file://")))
        key = f"results/{job['id']}/attempt-1.mp4"
        store.put(key, result, content_type="video/mp4")
        succeed(engine, str(job["id"]), result_key=key, content_type="video/mp4")
        out = tmp_path / "out.mp4"
        assert client.download(str(job["id"]), out) == len(result)
        assert out.read_bytes() == result
        with pytest.raises(FaceFlowAPIError) as missing:
            client.download("00000000-0000-0000-0000-000000000000", out)
        assert missing.value.status == 404

    async def use() -> dict[str, object]:
        async with AsyncFaceFlowClient(live_url, user.api_key) as client:
            return await client.submit(face, videos.webm)

    assert asyncio.run(use())["video"]["container"] == "webm"  # type: ignore[index]


def test_the_progress_line_shows_a_videos_pass_frames_speed_and_eta() -> None:
    photo = {"id": "j", "status": "running", "stage": "detect"}
    assert progress_line(photo) == ("job j: running (detect)", None, 0)
    video = {
        "id": "v",
        "status": "running",
        "stage": "render_chunk",
        "progress": {
            "frames_done": 45,
            "frames_total": 90,
            "chunks_done": 1,
            "chunks_total": 3,
            "fps": 4.25,
            "eta_seconds": 10.6,
        },
    }
    text, total, done = progress_line(video)
    assert (total, done) == (90, 45)
    assert text == "job v: running, rendering 45/90 frames, 1/3 chunks, 4.2 fps, ETA 11 s"
    analysing = {
        "id": "v",
        "status": "running",
        "stage": "analyse",
        "progress": {
            "frames_analysed": 24,
            "frames_done": 0,
            "frames_total": 90,
            "chunks_done": 0,
            "chunks_total": 0,
            "fps": 3.0,
            "eta_seconds": 52.0,
            "stage": "analyse",
        },
    }
    text, total, done = progress_line(analysing)
    assert (total, done) == (90, 24)  # the bar follows the analysis, then the render
    assert text == "job v: running, analysing 24/90 frames, 3.0 fps, ETA 52 s"
    joining = {**video, "stage": "join", "progress": {**video["progress"], "stage": "join"}}  # type: ignore[dict-item]
    assert (
        progress_line(joining)[0]
        == "job v: running (join) 45/90 frames, 1/3 chunks, 4.2 fps, ETA 11 s"
    )
