"""A ``fuse-video`` coordinator (in this process, as on the control pool) fanning its parts
out to two warm GPU workers on a real Prefect server: the story clip (90 frames, three
scenes) with grace_hopper as the source, in 2-s chunks (three)."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import suppress
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prefect.settings import PREFECT_API_URL, temporary_settings

from faceflow.testing.wait import poll
from flows import faults
from flows.artifacts import artifact_key
from flows.params import (
    VIDEO_ANALYSE_DEPLOYMENT,
    VIDEO_PART_FLOW_NAME,
    VIDEO_RENDER_DEPLOYMENT,
    JobFailure,
    JobProgress,
    VideoResultRef,
    analysis_part,
    chunk_part,
    part_progress_key,
    progress_key,
    result_error_key,
    result_key,
    result_meta_key,
    video_parts_tag,
    video_report_key,
)
from flows.video import fuse_video_flow
from flows.video_store import ReportRecord
from tasks import watermark
from tasks.provenance import dev_root_path, inspect_file, read_manifest
from tasks.video_io import frame_timestamps, probe_video, read_frames
from tests import samples
from tests.orchestration.helpers import job_params
from tests.videos import Videos
from tests.worker.conftest import Api, WarmWorker, start_warm_worker
from webapi.prefect_api import PrefectAPI

CHUNKS = 3  # the story clip in 2-s chunks, moved to its cuts (tests/test_video_job.py)
RANGES = 3  # its analysis in ranges of about 2 s (tests/test_video_analysis.py)
PART_ENTRYPOINT = "flows/video_parts.py:fuse_video_part"


@pytest.fixture(scope="module")
def fault_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The workers' fault plan (``flows.faults``), empty until a test writes one."""
    plan = tmp_path_factory.mktemp("video-faults") / "faults.json"
    plan.write_text("{}")
    return plan


@pytest.fixture(scope="module")
def workers(
    prefect_api: Api, tmp_path_factory: pytest.TempPathFactory, fault_plan: Path
) -> Iterator[list[WarmWorker]]:
    """Two warm workers (one child each) on one pool holding the two part deployments,
    fault injection on (inert while the plan is empty)."""
    tmp = tmp_path_factory.mktemp("video-parts")
    pool = f"video-{uuid.uuid4().hex[:6]}"
    env = {
        "FACEFLOW_WORKER_ACQUIRE_TIMEOUT_S": "30",
        faults.ENABLE_VAR: "true",
        faults.FILE_VAR: str(fault_plan),
    }
    started = [start_warm_worker(prefect_api, tmp / "a", pool, env, name="gpu-a")]
    try:
        started.append(
            start_warm_worker(prefect_api, tmp / "b", pool, env, name="gpu-b", create_pool=False)
        )
        for name in (VIDEO_ANALYSE_DEPLOYMENT, VIDEO_RENDER_DEPLOYMENT):
            prefect_api.deploy(VIDEO_PART_FLOW_NAME, PART_ENTRYPOINT, pool, name=name)
        yield started
    finally:
        for worker in started:
            worker.service.stop(grace=15)


def child_pids(workers: list[WarmWorker]) -> list[int]:
    return [int(w.wait_idle()["children"][0]["pid"]) for w in workers]


def coordinate(prefect_api: Api, params: dict[str, Any]) -> Any:
    """Run the coordinator here against the test server; its final state."""
    with temporary_settings({PREFECT_API_URL: prefect_api.url}):
        return fuse_video_flow(**params, chunk_s=2.0, return_state=True)


def parts_of(prefect_api: Api, job_id: str) -> list[dict[str, Any]]:
    body = {"flow_runs": {"tags": {"all_": [video_parts_tag(job_id, 1)]}}, "limit": 50}
    return list(prefect_api.call("POST", "/flow_runs/filter", body))


def new_job(
    prefect_api: Api, videos: Videos, source: bytes, seconds: float = 900
) -> dict[str, Any]:
    home = prefect_api.home
    return job_params(
        home.put_input(source), home.put_input(videos.story.read_bytes(), "mp4"), seconds=seconds
    )


def chunk_files(prefect_api: Api) -> dict[str, int]:
    root = prefect_api.home.storage / "video-chunks"
    return {p.name: p.stat().st_mtime_ns for p in root.glob("*.mp4")}


def watch_parts(
    prefect_api: Api, job_id: str, act: Callable[[dict[str, Any]], bool]
) -> threading.Thread:
    """A thread that polls the job's parts until ``act(run)`` returns True for one."""

    def loop() -> None:
        poll(lambda: any(act(run) for run in parts_of(prefect_api, job_id)), 600)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return thread


def running_child(workers: list[WarmWorker], run: dict[str, Any]) -> int | None:
    """The pid of the worker child running flow run ``run``, if one is. Both workers'
    idle children may be handed a part and claim it on start: the one that started it is
    the child its ``Running`` message names (the other one holds the run until Prefect
    refuses its claim, and killing that one proves nothing)."""
    holding = [pid for worker in workers for pid in worker.holding(run["id"])]
    named = re.search(r"child pid (\d+)", (run.get("state") or {}).get("message") or "")
    if named is not None:
        return int(named[1]) if int(named[1]) in holding else None
    return holding[0] if len(holding) == 1 else None


def stop_while_running(
    prefect_api: Api, workers: list[WarmWorker], run: dict[str, Any]
) -> int | None:
    """SIGSTOP the child running part ``run`` if it still runs it once stopped: its pid,
    or None (the child resumed). What was read may be stale: a child that just finished
    the part would be stopped idle, so the run is read again after the stop."""
    if run["state_type"] != "RUNNING":
        return None
    pid = running_child(workers, run)
    if pid is None:
        return None
    os.kill(pid, signal.SIGSTOP)
    current = prefect_api.call("GET", f"/flow_runs/{run['id']}")
    if current["state"]["type"] != "RUNNING" or running_child(workers, current) != pid:
        os.kill(pid, signal.SIGCONT)
        return None
    return pid


def chunk_index(name: str) -> int:
    """The chunk a part run (``…-chunk-0001``) or a chunk file (``chunk-00001-….mp4``) holds."""
    return int(name.rsplit("chunk-", 1)[1].split("-")[0].split(".")[0])


@pytest.mark.slow  # two warm workers: ~70 s with their start (make test-slow, CI)
def test_chunks_render_on_both_workers_and_the_video_is_whole(
    prefect_api: Api,
    workers: list[WarmWorker],
    videos: Videos,
    fault_plan: Path,
) -> None:
    """The first analysis range and the first chunk hang mid-part (the fault plan) until
    the other ranges or chunks are done: those can only go to the other worker, so the
    spread does not depend on this machine's speed; then the plan lets the held part go
    on. While the range is held, the job's progress shows the other ranges' frames
    analysed."""
    pids = child_pids(workers)
    params = new_job(prefect_api, videos, samples.grace_hopper_jpeg_bytes())
    job_id = params["job_id"]
    owner = [params["owner_id"]]
    steps = [
        ("-analyse-", RANGES, analysis_part(0, 1).rsplit("-", 1)[0] + "-*"),  # from frame 0
        ("-chunk-", CHUNKS, chunk_part(0)),
    ]
    hangs = [{"stage": part, "owner_ids": owner, "seconds": 300} for _, _, part in steps]
    fault_plan.write_text(json.dumps({"hang": hangs}))
    released: set[str] = set()
    analysing: list[JobProgress] = []  # records read while the first range was held
    others_done_at: list[float] = []

    def analysis_advanced() -> bool:
        """The job's progress shows the other ranges analysed, before any render (given
        up after 30 s: the assertion below then fails)."""
        path = prefect_api.home.storage / progress_key(job_id, 1)
        with suppress(OSError, ValueError):  # not written yet, or being rewritten
            record = JobProgress.model_validate_json(path.read_bytes())
            if 0 < record.frames_analysed < record.frames_total and record.frames_done == 0:
                analysing.append(record)
                return True
        others_done_at[:] = others_done_at or [time.monotonic()]
        return time.monotonic() - others_done_at[0] > 30

    def release_each_step(run: dict[str, Any]) -> bool:
        """Let the held part of the first step not released yet go on once the step's
        other parts are done (and, for the ranges, the progress shows them)."""
        step = next(((kind, n) for kind, n, _ in steps if kind not in released), None)
        if step is None:
            return True
        kind, total = step
        runs = [r for r in parts_of(prefect_api, job_id) if kind in r["name"]]
        if len(runs) == total and sum(r["state_type"] == "COMPLETED" for r in runs) == total - 1:
            if kind == "-analyse-" and not analysis_advanced():
                return False
            released.add(kind)
            left = [h for h, (k, _, _) in zip(hangs, steps, strict=True) if k not in released]
            fault_plan.write_text(json.dumps({"hang": left}))
        return False

    before = set(chunk_files(prefect_api))
    watcher = watch_parts(prefect_api, job_id, release_each_step)
    try:
        state = coordinate(prefect_api, params)
    finally:
        fault_plan.write_text("{}")  # never leave a part hanging
    watcher.join(timeout=5)
    assert state.is_completed(), state.message
    assert released == {"-analyse-", "-chunk-"}, released
    # the progress moved while the frames were analysed, before the first was rendered
    assert analysing and analysing[0].stage == "analyse", analysing
    print(f"\nwhile the first range was held: {analysing[0]!r}")
    ref = VideoResultRef.model_validate(state.result())
    assert ref.chunks == ref.chunks_rendered == CHUNKS
    assert len(set(chunk_files(prefect_api)) - before) == CHUNKS

    parts = parts_of(prefect_api, job_id)
    renders = [r for r in parts if "-chunk-" in r["name"]]
    ranges = [r for r in parts if "-analyse-" in r["name"]]
    assert sorted(r["name"] for r in renders) == [f"{job_id}-chunk-{i:04d}" for i in range(3)]
    assert len(ranges) == RANGES and len(parts) == RANGES + CHUNKS + 3  # probe, plan, report
    assert {f"{job_id}-probe", f"{job_id}-plan", f"{job_id}-report"} <= {r["name"] for r in parts}
    assert all(r["state_type"] == "COMPLETED" for r in parts)
    by_pid = Counter(int(r["state"]["message"].rsplit(" ", 1)[1]) for r in renders)
    analysed = Counter(int(r["state"]["message"].rsplit(" ", 1)[1]) for r in ranges)
    print(f"\nper worker child: chunks {dict(by_pid)}, ranges {dict(analysed)} ({pids})")
    for spread in (by_pid, analysed):  # the held part: 1, the rest: the other worker
        assert set(spread) == set(pids) and sorted(spread.values()) == [1, 2], spread
    (report,) = [r for r in parts if r["name"] == f"{job_id}-report"]  # on a GPU worker
    assert int(report["state"]["message"].rsplit(" ", 1)[1]) in pids
    record = ReportRecord.model_validate_json(
        (prefect_api.home.storage / video_report_key(job_id, 1)).read_text()
    )
    assert set(record.flags) <= set(ref.moderation) and ref.device == record.device
    similar = [t for t in ref.tracks if t["similarity_mean"] is not None]
    assert similar and {t["track"] for t in similar} == set(record.similarities)
    for i in range(CHUNKS):  # each render part wrote its frames for the job's progress
        counted = prefect_api.home.storage / part_progress_key(job_id, 1, chunk_part(i))
        assert json.loads(counted.read_text())["frames"] > 0

    result = prefect_api.home.storage / ref.key
    assert probe_video(result).frame_count == probe_video(videos.story).frame_count == ref.frames
    assert frame_timestamps(result) == frame_timestamps(videos.story)
    assert ref.faces_replaced > 0 and ref.tracks and ref.frame_failures == {}
    sidecar = (prefect_api.home.storage / result_meta_key(job_id, 1)).read_text()
    assert VideoResultRef.model_validate_json(sidecar) == ref
    assert ref.key == result_key(job_id, 1, "mp4")
    assert_marked(prefect_api, job_id, ref, result, state.state_details.flow_run_id)


def assert_marked(
    prefect_api: Api, job_id: str, ref: VideoResultRef, result: Path, run: Any
) -> None:
    """The result is signed by the stack's chain, every frame rendered by the parts carries
    the job's watermark, and the coordinator's result artifact says so."""
    root = dev_root_path(prefect_api.home.path).read_text()
    manifest = read_manifest(result.read_bytes(), "video/mp4", root)
    assert manifest.valid and manifest.trusted and manifest.ours, manifest
    assert ref.marks == ["c2pa", "watermark"]
    payload = watermark.payload_for(job_id)
    bits = np.asarray(payload.bits())
    frames = [f.image for f in read_frames(result, 0, ref.frames)]
    assert len(frames) == ref.frames
    for index, frame in enumerate(frames):  # chunks from both workers: every frame marked
        scores = watermark.VIDEO.scores(frame)
        assert scores is not None and np.mean((scores > 0) == bits) >= 0.9, index
    assert inspect_file(result.read_bytes(), root).watermark == payload
    body = {"artifacts": {"flow_run_id": {"any_": [str(run)]}}, "limit": 20}
    artifacts = prefect_api.call("POST", "/artifacts/filter", body)
    (view,) = [a for a in artifacts if a["type"] == "markdown"]
    assert view["key"] == artifact_key(job_id, "result")
    assert "Marked: signed C2PA Content Credentials, invisible watermark in every frame" in str(
        view["data"]
    )


def test_a_coordinator_run_again_for_the_same_attempt_reuses_its_parts(
    prefect_api: Api, workers: list[WarmWorker], videos: Videos
) -> None:
    """The same attempt coordinated twice (its first coordinator lost after its parts
    ran): the idempotency keys give back the parts it created, they do not run again.
    (Range parts run only when no earlier job stored this video's analysis; its chunks
    carry this job's watermark, so they are rendered.)"""
    params = new_job(prefect_api, videos, samples.grace_hopper_jpeg_bytes())
    assert coordinate(prefect_api, params).is_completed()
    job_id = params["job_id"]
    first = {r["name"]: r["id"] for r in parts_of(prefect_api, job_id)}
    chunks = {f"{job_id}-chunk-{i:04d}" for i in range(CHUNKS)}
    ranges = {name for name in first if "-analyse-" in name}
    assert len(ranges) in (0, RANGES), ranges
    steps = {f"{job_id}-probe", f"{job_id}-plan", f"{job_id}-report"}
    assert set(first) == steps | chunks | ranges
    again = coordinate(prefect_api, params)
    assert again.is_completed(), again.message
    assert {r["name"]: r["id"] for r in parts_of(prefect_api, job_id)} == first


ENDED = ("COMPLETED", "CANCELLED", "CRASHED", "FAILED")


def part_started(prefect_api: Api, job_id: str, part: str) -> bool:
    """Whether ``part`` of job ``job_id``'s attempt 1 wrote its first frames' record."""
    return (prefect_api.home.storage / part_progress_key(job_id, 1, part)).exists()


def _run_holding_a_chunk(
    prefect_api: Api,
    workers: list[WarmWorker],
    videos: Videos,
    plan: Path,
    source: bytes,
    *,
    part: str,
    act: Callable[[str, int], None],
) -> tuple[Any, str, str, set[str]]:
    """Run a video job whose part ``part`` (``chunk-0001``) the fault plan hangs once its
    first frames are done (``flows.faults``), mid-chunk: the child running it is held
    (SIGSTOP, ``stop_while_running``), the plan emptied (the part's next run does not hang),
    then ``act(job_id, pid)``. The job's final state, its id, the held run's id and the
    chunk files it added. The held child is let go (SIGCONT) only once every part has
    ended, so it never writes its chunk after ``act`` (a child its worker killed is gone)."""
    child_pids(workers)
    params = new_job(prefect_api, videos, source)
    job_id = params["job_id"]
    hang = {"stage": part, "owner_ids": [params["owner_id"]], "seconds": 120}
    plan.write_text(json.dumps({"hang": [hang]}))
    held: list[tuple[str, int]] = []

    def hold(run: dict[str, Any]) -> bool:
        if run["name"] != f"{job_id}-{part}" or not part_started(prefect_api, job_id, part):
            return False
        pid = stop_while_running(prefect_api, workers, run)
        if pid is None:
            return False
        plan.write_text("{}")
        held.append((str(run["id"]), pid))
        act(job_id, pid)
        return True

    before = chunk_files(prefect_api)
    watcher = watch_parts(prefect_api, job_id, hold)
    try:
        state = coordinate(prefect_api, params)
        watcher.join(timeout=5)
        poll(
            lambda: all(r["state_type"] in ENDED for r in parts_of(prefect_api, job_id)),
            60,
            step_s=0.2,
        )
    finally:
        plan.write_text("{}")
        for _, pid in held:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    for worker in workers:
        worker.wait_idle()  # a fresh child for what comes next
    assert held, f"{part} was not caught hanging mid-chunk"
    new = set(chunk_files(prefect_api)) - set(before)
    return state, job_id, held[0][0], new


def test_a_part_killed_mid_chunk_runs_again_and_renders_only_its_chunk(
    prefect_api: Api, workers: list[WarmWorker], videos: Videos, fault_plan: Path
) -> None:
    """A part killed mid-chunk ends Crashed and is run again; every other chunk is
    rendered once."""
    state, job_id, killed, new = _run_holding_a_chunk(
        prefect_api,
        workers,
        videos,
        fault_plan,
        samples.encode(samples.astronaut_rgb(), quality=90),  # chunks not stored yet
        part=chunk_part(1),
        act=lambda _job_id, pid: os.kill(pid, signal.SIGKILL),
    )
    assert state.is_completed(), state.message
    assert prefect_api.run(killed)["state_type"] == "CRASHED"
    ref = VideoResultRef.model_validate(state.result())
    runs = Counter(r["name"] for r in parts_of(prefect_api, job_id))
    assert runs[f"{job_id}-chunk-0001"] == 2  # crashed, then run again
    assert all(n == 1 for name, n in runs.items() if not name.endswith("chunk-0001"))
    assert len(new) == CHUNKS and ref.chunks_rendered == CHUNKS  # each written once


def cancel_parts(prefect_api: Api, job_id: str) -> None:
    """Cancel attempt 1's parts of job ``job_id``, as the relay's cancel path does."""
    with PrefectAPI(prefect_api.url) as api:
        api.cancel_tagged(video_parts_tag(job_id, 1), message="Cancelled by FaceFlow")


def test_cancelling_the_parts_ends_the_attempt_cancelled_without_a_result(
    prefect_api: Api, workers: list[WarmWorker], videos: Videos, fault_plan: Path
) -> None:
    """The held part's chunk is never written, no result is, and no partial file is left
    behind."""
    state, job_id, held, new = _run_holding_a_chunk(
        prefect_api,
        workers,
        videos,
        fault_plan,
        samples.encode(samples.astronaut_rgb(), quality=80),
        part=chunk_part(1),
        act=lambda job, _pid: cancel_parts(prefect_api, job),
    )
    assert state.is_cancelled(), state
    settled = all(
        r["state_type"] in ("CANCELLED", "COMPLETED") for r in parts_of(prefect_api, job_id)
    )
    assert settled, parts_of(prefect_api, job_id)
    storage = prefect_api.home.storage
    assert not (storage / result_key(job_id, 1, "mp4")).exists()
    assert not (storage / result_meta_key(job_id, 1)).exists()
    held_chunk = chunk_index(prefect_api.run(held)["name"])
    assert held_chunk not in {chunk_index(name) for name in new}, new
    assert len(new) < CHUNKS  # stopped mid-video
    assert not list(storage.glob("video-chunks/*.partial"))


def test_too_little_time_fails_deadline_exceeded_without_a_result(
    prefect_api: Api, workers: list[WarmWorker], videos: Videos
) -> None:
    params = new_job(prefect_api, videos, samples.grace_hopper_jpeg_bytes(), seconds=10.0)
    state = coordinate(prefect_api, params)  # below what probe + analysis (10 s) need
    assert state.is_failed()
    assert state.message is not None and state.message.startswith("[deadline_exceeded]")
    job_id = params["job_id"]
    failure = JobFailure.model_validate(
        json.loads((prefect_api.home.storage / result_error_key(job_id, 1)).read_text())
    )
    assert failure.code == "deadline_exceeded" and not failure.retryable
    assert not (prefect_api.home.storage / result_key(job_id, 1, "mp4")).exists()
