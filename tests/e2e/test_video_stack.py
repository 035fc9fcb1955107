"""Video jobs end to end on the local stack (``faceflow up``: Prefect with auth, the warm
worker, the webapi and its relay), over real HTTP: a video uploaded as a multipart file
runs as a ``fuse-video`` run and comes back as an MP4 with the input's frames, timestamps
and audio, downloadable by ranges."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, ClassVar

import httpx
import pytest
from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

from blocks.settings import FusionSettings
from faceflow.testing.wait import poll, poll_value
from flows.params import chunks_manifest_key, video_parts_tag
from tasks.video_io import frame_timestamps, probe_video
from tests import samples
from tests.e2e.harness import (
    BIN,
    StackClient,
    create_user,
    local_stack,
    pid_of,
    pids_with_home,
    prefect_auth,
    watch,
)
from tests.videos import Videos

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
CHUNK_S = 0.5
FINAL_TYPES = ("COMPLETED", "FAILED", "CANCELLED", "CRASHED")
LIVE_TYPES = ("SCHEDULED", "PENDING", "RUNNING")


@dataclass
class VideoStack(StackClient):
    home: Path
    api: str
    api_key: str
    prefect: httpx.Client
    env: dict[str, str]
    client_timeout_s: ClassVar[float] = 60


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VideoStack]:
    with local_stack(tmp_path_factory.mktemp("video-stack") / "home") as running:
        with temporary_settings(
            {
                PREFECT_API_URL: running.prefect_api,
                PREFECT_API_AUTH_STRING: prefect_auth(running.home),
            }
        ):  # chunks of half a second: a 2 s clip renders in several, to kill, resume, cancel
            FusionSettings(video_chunk_s=CHUNK_S).save("default", overwrite=True)
        yield VideoStack(
            home=running.home,
            api=running.api,
            api_key=create_user(running.env, "video")["api key"],
            prefect=running.prefect,
            env=running.env,
        )


def _download(client: httpx.Client, url: str, path: Path, piece: int = 64 * 1024) -> int:
    """Fetch a result by ``Range`` pieces (as a seeking player does); how many requests."""
    first = client.get(url, headers={"Range": f"bytes=0-{piece - 1}"})
    assert first.status_code == 206, first.text
    size = int(first.headers["content-range"].rsplit("/", 1)[1])
    chunks, requests = [first.content], 1
    while sum(map(len, chunks)) < size:
        start = sum(map(len, chunks))
        part = client.get(url, headers={"Range": f"bytes={start}-{start + piece - 1}"})
        assert part.status_code == 206 and part.headers["content-range"].startswith(
            f"bytes {start}-"
        )
        chunks.append(part.content)
        requests += 1
    path.write_bytes(b"".join(chunks))
    assert len(path.read_bytes()) == size
    return requests


def test_a_video_job_runs_to_an_mp4_with_the_inputs_frames_timestamps_and_audio(
    stack: VideoStack, videos: Videos, tmp_path: Path
) -> None:
    clip = videos.short
    with stack.client() as client:
        response = client.post(
            "/v1/jobs",
            files=[
                ("source", ("face.jpg", samples.grace_hopper_jpeg_bytes(), "image/jpeg")),
                ("target", ("clip.mp4", clip.read_bytes(), "video/mp4")),
            ],
        )
        assert response.status_code == 202, response.text
        submitted = response.json()
        assert submitted["media"] == "video" and submitted["video"]["frame_count"] == 30
        job, seen = watch(client, submitted["id"], timeout=900)
        assert job["status"] == "succeeded", job
        assert "running" in seen, seen
        assert job["result"]["content_type"] == "video/mp4"
        report = job["video_report"]
        assert report["frames"] == 30 and report["chunks"] >= 1
        assert report["cuts"] == [5]  # the story's first hard cut
        done = job["progress"]
        assert done["frames_analysed"] == done["frames_done"] == done["frames_total"] == 30
        out = tmp_path / "result.mp4"
        assert _download(client, job["result"]["url"], out) > 1

    given, result = probe_video(clip), probe_video(out)
    assert result.container == "mp4" and result.video_codec == "h264"
    assert result.frame_count == given.frame_count == 30
    assert (result.width, result.height) == (given.width, given.height)
    assert frame_timestamps(out) == frame_timestamps(clip)  # same clock, frame for frame
    assert result.audio is not None and given.audio is not None
    assert abs(result.audio.duration_s - given.audio.duration_s) < 0.05
    assert abs(result.duration_s - given.duration_s) <= 1 / given.fps

    runs = stack.prefect.post(
        "/flow_runs/filter", json={"flow_runs": {"name": {"any_": [job["id"]]}}}
    ).json()
    assert [r["state_type"] for r in runs] == ["COMPLETED"]
    deployment = stack.prefect.get(f"/deployments/{runs[0]['deployment_id']}").json()
    assert deployment["name"] == "fuse-video" and deployment["work_queue_name"] == "video"


def test_the_cli_submits_a_video_waits_with_progress_and_saves_the_mp4(
    stack: VideoStack, videos: Videos, tmp_path: Path
) -> None:
    face, out = tmp_path / "face.jpg", tmp_path / "out.mp4"
    face.write_bytes(samples.grace_hopper_jpeg_bytes())
    env = {**os.environ, "FACEFLOW_API_URL": stack.api, "FACEFLOW_API_KEY": stack.api_key}
    done = subprocess.run(
        [str(BIN / "faceflow"), "submit", str(face), str(videos.short), "--wait", "-o", str(out)],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"wrote {out}" in done.stdout
    assert probe_video(out).frame_count == 30


def _submit(client: httpx.Client, clip: Path, source: bytes | None = None, **params: object) -> str:
    """Submit ``clip`` with ``source`` (default grace_hopper). Chunks are stored by content
    (video, plan, sources, options): a test that must render its own uses its own source."""
    response = client.post(
        "/v1/jobs",
        files=[
            ("source", ("face.jpg", source or samples.grace_hopper_jpeg_bytes(), "image/jpeg")),
            ("target", (clip.name, clip.read_bytes(), "video/mp4")),
        ],
        data={"params": json.dumps(params)},
    )
    assert response.status_code == 202, response.text
    return str(response.json()["id"])


def _until(
    client: httpx.Client, job_id: str, ready: Callable[[dict[str, Any]], bool], timeout: float
) -> dict[str, Any]:
    """Poll the job until ``ready(job)``; fails if it ends first or ``timeout`` passes."""

    def found() -> dict[str, Any] | None:
        job = client.get(f"/v1/jobs/{job_id}").json()
        if ready(job):
            return job
        assert job["status"] not in ("succeeded", "failed", "expired", "cancelled"), job
        return None

    job = poll_value(found, timeout, step_s=0.1)
    if job is not None:
        return job
    raise AssertionError(f"job {job_id} not ready in {timeout} s")


def _chunks_done(job: dict[str, Any]) -> int:
    return int((job.get("progress") or {}).get("chunks_done") or 0)


def _partials(stack: VideoStack, job_id: str) -> list[Path]:
    """The chunk lists of the job's attempts and the chunks they name, still stored."""
    storage = stack.home / "storage"
    lists = sorted((storage / "results" / job_id).glob("attempt-*.chunks.json"))
    chunks = [storage / key for path in lists for key in json.loads(path.read_text())]
    return [path for path in [*lists, *chunks] if path.exists()]


def _listed_chunks(stack: VideoStack, job_id: str, timeout: float = 600) -> list[str]:
    """The storage keys of the chunks the job's first attempt lists once it has planned,
    before it renders any; waits for the list."""
    listed = stack.home / "storage" / chunks_manifest_key(job_id, 1)
    # written whole (blocks.storage.write_to), or not yet
    keys = poll_value(
        lambda: [str(key) for key in json.loads(listed.read_text())],
        timeout,
        step_s=0.005,
        ignore=(FileNotFoundError,),
    )
    assert keys is not None, "the attempt never listed its chunks"
    return keys


@contextmanager
def _child_paused(stack: VideoStack) -> Iterator[None]:
    """Hold the worker's child with SIGSTOP, so a fast machine cannot finish the video
    before what the test does next takes effect; a child killed meanwhile is fine."""
    child = pid_of(stack.home, b"faceflow.worker.child")
    os.kill(child, signal.SIGSTOP)
    try:
        yield
    finally:
        with suppress(ProcessLookupError):
            os.kill(child, signal.SIGCONT)


def _retention(stack: VideoStack) -> None:
    subprocess.run([str(BIN / "faceflow"), "retention", "run"], env=stack.env, check=True,
                   capture_output=True, timeout=120)  # fmt: skip


def test_a_worker_killed_mid_video_renders_only_the_missing_chunks_again(
    stack: VideoStack, videos: Videos
) -> None:
    storage = stack.home / "storage"
    with stack.client() as client:
        job_id = _submit(client, videos.short, samples.astronaut_jpeg_bytes())
        # Watched in storage, not through the API, whose progress lags by a sync pass in
        # which CI's machine rendered the whole clip: once the first chunk is stored the
        # GPU worker's child (running a render part) is stopped, the stored chunks
        # counted, and it is killed. Its part crashes; the coordinator runs it again.
        listed = _listed_chunks(stack, job_id)
        total = len(listed)
        child = pid_of(stack.home, b"faceflow.worker.child")
        while not any((storage / key).exists() for key in listed):
            time.sleep(0.005)
        os.kill(child, signal.SIGSTOP)
        done = {key: (storage / key).stat().st_mtime_ns for key in listed
                if (storage / key).exists()}  # fmt: skip
        os.kill(child, signal.SIGKILL)
        assert 1 <= len(done) < total, (len(done), total)
        job, _ = watch(client, job_id, timeout=900)
    assert job["status"] == "succeeded" and job["attempts"] == 1, job
    report = job["video_report"]
    assert report["chunks"] == total and report["frames"] == 30
    # the chunks stored before the kill were not rendered again (a part killed after it
    # stored its chunk finds it stored when it runs again); the rest were, once
    assert {key: (storage / key).stat().st_mtime_ns for key in done} == done
    assert total - len(done) <= report["chunks_rendered"] <= total
    print(f"\nkill after {len(done)}/{total} chunks: {total - len(done)} rendered after it")


def _run_process(stack: VideoStack, flow_run_id: str) -> int:
    """The pid of the stack process running Prefect flow run ``flow_run_id``."""
    marker = f"PREFECT__FLOW_RUN_ID={flow_run_id}".encode()
    for pid in pids_with_home(stack.home):
        with suppress(OSError):
            if marker in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                return pid
    raise AssertionError(f"no stack process runs flow run {flow_run_id}")


def _parts(stack: VideoStack, job_id: str, attempt: int) -> list[dict[str, Any]]:
    body = {"flow_runs": {"tags": {"all_": [video_parts_tag(job_id, attempt)]}}, "limit": 50}
    return list(stack.prefect.post("/flow_runs/filter", json=body).json())


def _wait_parts(stack: VideoStack, job_id: str, done: Callable[[str], bool], step_s: float) -> None:
    """Poll attempt 1's parts until ``done`` holds for each one's state type (60 s)."""
    settled = poll(
        lambda: all(done(r["state_type"]) for r in _parts(stack, job_id, 1)), 60, step_s=step_s
    )
    assert settled, [(r["name"], r["state_type"]) for r in _parts(stack, job_id, 1)]


def test_a_coordinator_killed_mid_video_runs_again_and_its_parts_stop(
    stack: VideoStack, videos: Videos
) -> None:
    """The control pool's process running ``fuse-video`` is SIGKILLed while a render part
    holds the GPU worker's child (paused): the relay re-dispatches the job (attempt 2) and
    cancels attempt 1's parts, so no GPU keeps rendering for the fenced attempt; attempt 2
    reuses what attempt 1 stored and the job succeeds."""
    own = samples.encode(samples.astronaut_rgb(), quality=83)  # no chunk of it is stored
    with stack.client() as client:
        job_id = _submit(client, videos.short, own)
        listed = _listed_chunks(stack, job_id)
        rendering = poll(
            lambda: any(
                "-chunk-" in r["name"] and r["state_type"] == "RUNNING"
                for r in _parts(stack, job_id, 1)
            ),
            120,
            step_s=0.02,
        )  # a render part on the GPU worker's child, held there next
        assert rendering, "no render part of attempt 1 ran"
        with _child_paused(stack):
            body = {"flow_runs": {"name": {"any_": [job_id]}}}
            (run,) = stack.prefect.post("/flow_runs/filter", json=body).json()
            run_id = str(run["id"])
            os.kill(_run_process(stack, run_id), signal.SIGKILL)
            killed = datetime.now(UTC)
            _until(client, job_id, lambda job: job["attempts"] == 2, timeout=120)
            # the relay's cancel lands while the part is held
            _wait_parts(stack, job_id, lambda state: state not in LIVE_TYPES, step_s=0.1)
        job, _ = watch(client, job_id, timeout=900)
    assert job["status"] == "succeeded" and job["attempts"] == 2, job
    assert job["video_report"]["chunks"] == len(listed)
    _wait_parts(stack, job_id, lambda state: state in FINAL_TYPES, step_s=0.2)
    first = _parts(stack, job_id, 1)
    late = [
        r["name"]
        for r in first
        if r["state_type"] == "COMPLETED" and datetime.fromisoformat(r["end_time"]) > killed
    ]
    assert late == [], f"attempt 1's parts rendered on after its coordinator died: {late}"


def test_cancel_mid_video_stops_the_worker_and_leaves_no_partials(
    stack: VideoStack, videos: Videos
) -> None:
    own = samples.encode(samples.astronaut_rgb(), quality=85)  # no chunk of it is stored
    with stack.client() as client:
        job_id = _submit(client, videos.short, own)
        # The attempt lists its chunks once planned, before rendering: seen in storage at
        # once (the API's progress lags by a sync pass, in which CI's machine rendered the
        # rest of the clip), the child is paused there, mid-video on a machine of any speed.
        _listed_chunks(stack, job_id)
        with _child_paused(stack):
            asked = time.monotonic()
            assert client.post(f"/v1/jobs/{job_id}/cancel").status_code in (200, 202)
            job = _until(client, job_id, lambda job: job["status"] == "cancelled", timeout=60)
            took = time.monotonic() - asked
    assert job["result"] is None
    runs = stack.prefect.post(
        "/flow_runs/filter", json={"flow_runs": {"name": {"any_": [job_id]}}}
    ).json()
    assert [r["state_type"] for r in runs] == ["CANCELLED"]
    assert _partials(stack, job_id), "the attempt listed its chunks"
    _retention(stack)
    assert _partials(stack, job_id) == []
    print(f"\ncancel to cancelled: {took:.2f} s")


def test_a_deadline_passing_mid_video_ends_the_job_and_its_partials(
    stack: VideoStack, videos: Videos
) -> None:
    """The worker's child is paused mid-video until the deadline has passed, so the
    deadline falls mid-video on a machine of any speed (a fast one finished the story
    inside the 30 s). On a loaded one the deadline may pass before the first frame: the
    job must end the same way."""
    deadline_s = 30
    with stack.client() as client:
        job_id = _submit(client, videos.story, deadline_seconds=deadline_s)
        job = client.get(f"/v1/jobs/{job_id}").json()
        deadline_at = datetime.fromisoformat(job["deadline_at"])
        while job["status"] not in ("succeeded", "failed", "expired", "cancelled"):
            progress = job.get("progress") or {}
            if progress.get("frames_done") and _chunks_done(job) < progress["chunks_total"] - 1:
                with _child_paused(stack):
                    time.sleep(max(0.0, (deadline_at - datetime.now(UTC)).total_seconds() + 2))
                break
            assert datetime.now(UTC) < deadline_at + timedelta(seconds=60), job
            time.sleep(0.1)
            job = client.get(f"/v1/jobs/{job_id}").json()
        job, _ = watch(client, job_id, timeout=300)
    assert job["status"] == "failed" and job["error"]["code"] == "deadline_exceeded", job
    _retention(stack)
    assert _partials(stack, job_id) == []
