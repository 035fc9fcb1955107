"""The fuse-video flow in-process under a real (test-harness) Prefect server: the story clip
(90 frames, 480x360, three scenes) with grace_hopper as the source, in 2-s chunks."""

from __future__ import annotations

import hashlib
import io
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import c2pa
import numpy as np
import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

from blocks.storage import fetch_to, load_storage
from flows.artifacts import artifact_key
from flows.binding import signed_parameters, worker_keys
from flows.params import (
    DEFAULT_STORAGE_BLOCK,
    FuseFacesParams,
    JobFailure,
    VideoResultRef,
    result_error_key,
    result_key,
    result_meta_key,
)
from flows.video import fuse_video_flow
from tasks import watermark
from tasks.provenance import DIGITAL_SOURCE_TYPE, dev_root_path, inspect_file, read_manifest
from tasks.video_io import frame_timestamps, probe_video, read_frames
from tests import samples
from tests.orchestration.conftest import Home
from tests.orchestration.helpers import job_params, task_runs
from tests.videos import Videos

CHUNKS = 3  # the story clip in 2-s chunks, moved to its cuts (tests/test_video_job.py)
MIN_TASK_RUNS = CHUNKS + 5  # probe, analyse, the chunks, join, report, store
FINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


@dataclass
class Run:
    """A completed fuse-video run: its parameters, returned ref and task runs by name."""

    params: dict[str, Any]
    ref: VideoResultRef
    task_runs: dict[str, Any]
    flow_run_id: Any = None
    chunks: set[str] = field(default_factory=set)  # chunk files it added to the storage


def run_video(params: dict[str, Any]) -> Run:
    state = fuse_video_flow(**params, chunk_s=2.0, return_state=True)
    assert state.is_completed(), state.message
    ref = VideoResultRef.model_validate(state.result())
    run_id = state.state_details.flow_run_id
    return Run(params, ref, settled_task_runs(run_id), run_id)


def settled_task_runs(flow_run_id: Any, timeout_s: float = 30.0) -> dict[str, Any]:
    """The run's task runs once the server has recorded every one in a final state (task
    runs are recorded from events, a moment after the flow returns; on a loaded machine
    more than a moment)."""
    end = time.monotonic() + timeout_s
    runs = task_runs(flow_run_id)
    while time.monotonic() < end:
        if len(runs) >= MIN_TASK_RUNS and all(
            r.state_type is not None and r.state_type.value in FINAL for r in runs.values()
        ):
            break
        time.sleep(0.5)
        runs = task_runs(flow_run_id)
    return runs


def render_runs(run: Run) -> list[str]:
    return sorted(name for name in run.task_runs if name.startswith("render-chunk-"))


@pytest.fixture(scope="module")
def first(prefect_harness: Home, videos: Videos) -> Run:
    params = job_params(
        prefect_harness.put_input(samples.grace_hopper_jpeg_bytes()),
        prefect_harness.put_input(videos.story.read_bytes(), "mp4"),
        seconds=900.0,
    )
    FuseFacesParams.model_validate(params)  # the photo flow's contract, a video target
    before = set(chunk_files(prefect_harness))  # the session's storage is shared
    run = run_video(params)
    run.chunks = set(chunk_files(prefect_harness)) - before
    return run


def chunk_files(home: Home) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in (home.storage / "video-chunks").glob("*.mp4")}


def test_a_video_is_fused_with_one_task_run_per_chunk(
    first: Run, prefect_harness: Home, videos: Videos, tmp_path: Path
) -> None:
    ref, job_id = first.ref, first.params["job_id"]
    assert ref.key == result_key(job_id, 1, "mp4") and ref.content_type == "video/mp4"
    assert ref.chunks == ref.chunks_rendered == CHUNKS
    assert render_runs(first) == [f"render-chunk-{i:04d}" for i in range(CHUNKS)]
    assert all(first.task_runs[n].state_type == "COMPLETED" for n in render_runs(first))
    assert {"probe", "analyse", "join", "report", "store"} <= set(first.task_runs)

    result = fetch_to(load_storage(DEFAULT_STORAGE_BLOCK), ref.key, tmp_path / "result.mp4")
    source = probe_video(videos.story)
    assert probe_video(result).frame_count == source.frame_count == ref.frames
    assert frame_timestamps(result) == frame_timestamps(videos.story)
    assert (ref.width, ref.height) == (source.width, source.height)
    assert ref.faces_replaced > 0 and ref.tracks and ref.frame_failures == {}
    sidecar = (prefect_harness.storage / result_meta_key(job_id, 1)).read_text()
    assert VideoResultRef.model_validate_json(sidecar) == ref
    assert len(first.chunks) == CHUNKS
    root = dev_root_path(prefect_harness.path).read_text()
    marks = read_manifest(result.read_bytes(), "video/mp4", root)  # the file, signed
    assert marks.valid and marks.trusted and marks.ours, marks
    assert ref.marks == ["c2pa", "watermark"]
    payload = watermark.payload_for(job_id)
    frames = [f.image for f in read_frames(result, 0, ref.frames)]
    assert len(frames) == ref.frames
    bits = np.asarray(payload.bits())
    for index, frame in enumerate(frames):  # every frame carries the job's payload
        scores = watermark.VIDEO.scores(frame)
        assert scores is not None and np.mean((scores > 0) == bits) >= 0.9, index
    assert inspect_file(result.read_bytes(), root).watermark == payload
    with get_client(sync_client=True) as client:  # the operator's view says so too
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(
                flow_run_id=ArtifactFilterFlowRunId(any_=[first.flow_run_id])
            )
        )
    (result_view,) = [a for a in artifacts if a.type == "markdown"]
    assert result_view.key == artifact_key(job_id, "result")
    text = str(result_view.data)
    assert ref.key in text and f"{ref.frames} frames" in text
    assert "Marked: signed C2PA Content Credentials, invisible watermark in every frame" in text
    assert marks.digital_source_type == DIGITAL_SOURCE_TYPE
    with c2pa.Reader("video/mp4", io.BytesIO(result.read_bytes())) as reader:
        manifest = reader.get_active_manifest() or {}
    hashes = {i["title"]: i["instance_id"] for i in manifest.get("ingredients", [])}
    assert hashes["target"] == "sha256:" + hashlib.sha256(videos.story.read_bytes()).hexdigest()


def test_a_second_attempt_renders_only_the_missing_chunk(
    first: Run, prefect_harness: Home, videos: Videos, tmp_path: Path
) -> None:
    before = chunk_files(prefect_harness)
    lost = sorted(first.chunks)[1]
    (prefect_harness.storage / "video-chunks" / lost).unlink()
    unsigned = {k: v for k, v in first.params.items() if k != "binding"}
    again = run_video(signed_parameters({**unsigned, "attempt": 2}, worker_keys()[0]))

    assert again.ref.chunks == CHUNKS and again.ref.chunks_rendered == 1
    assert len(render_runs(again)) == CHUNKS  # every chunk is a task run; one did work
    after = chunk_files(prefect_harness)
    assert set(after) == set(before)  # same content keys: same plan, same names
    assert {n for n in after if after[n] != before[n]} == {lost}  # only it was written
    result = fetch_to(load_storage(DEFAULT_STORAGE_BLOCK), again.ref.key, tmp_path / "r.mp4")
    assert again.ref.key.endswith("attempt-2.mp4")
    assert frame_timestamps(result) == frame_timestamps(videos.story)


def test_too_little_time_fails_deadline_exceeded_without_a_result(
    prefect_harness: Home, videos: Videos
) -> None:
    params = job_params(
        prefect_harness.put_input(samples.grace_hopper_jpeg_bytes()),
        prefect_harness.put_input(videos.story.read_bytes(), "mp4"),
        seconds=10.0,  # below what probe + analysis (expected 10 s) need
    )
    state = fuse_video_flow(**params, chunk_s=2.0, return_state=True)
    assert state.is_failed()
    assert state.message is not None and state.message.startswith("[deadline_exceeded]")
    job_id = params["job_id"]
    failure = JobFailure.model_validate(
        json.loads((prefect_harness.storage / result_error_key(job_id, 1)).read_text())
    )
    assert failure.code == "deadline_exceeded" and not failure.retryable
    assert not (prefect_harness.storage / result_key(job_id, 1, "mp4")).exists()
    assert not (prefect_harness.storage / result_meta_key(job_id, 1)).exists()
