"""A video attempt's progress record (flows.video_progress): what it counts, how often it
is written to storage, and the description the Prefect UI and the relay read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from blocks.storage import ByteStore
from flows import faults
from flows.params import (
    JobProgress,
    analysis_part,
    analysis_part_of,
    chunk_part,
    part_progress_key,
    progress_key,
)
from flows.video_parts import PartFrames
from flows.video_progress import STEPS, PartsProgress, VideoProgress
from tests.stores import local_store


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Shown:
    """What the progress artifact was asked to show (a DeferredProgress's calls)."""

    def __init__(self) -> None:
        self.shown: list[tuple[float, str]] = []
        self.closed: tuple[float, str] | None = None

    def show(self, value: float, description: str) -> None:
        self.shown.append((value, description))

    def close(self, value: float, description: str) -> None:
        self.closed = (value, description)


def _stored(store: ByteStore, job: str = "job-1", attempt: int = 2) -> JobProgress:
    return JobProgress.model_validate_json(store.read_path(progress_key(job, attempt)))


def test_progress_counts_frames_chunks_speed_and_eta(tmp_path: Path) -> None:
    store, clock, shown = local_store(tmp_path), Clock(), Shown()
    progress = VideoProgress(store, "job-1", 2, clock=clock, artifact=shown)  # type: ignore[arg-type]
    progress.start("probe")
    assert _stored(store).stage == "probe" and _stored(store).frames_total == 0
    progress.probed(90)
    progress.begin(progress.analysis)
    progress.start("analyse")
    progress.planned(frames=90, chunks=3)
    progress.found(progress.render, 30)  # chunk 0 stored by an earlier attempt
    progress.begin(progress.render)
    progress.start("render_chunk")
    assert (_stored(store).frames_done, _stored(store).chunks_done) == (30, 1)
    assert _stored(store).fps is None and _stored(store).eta_seconds is None
    clock.now += 3.0  # chunk 1 rendered by this attempt in 3 s: 10 frames per second
    progress.stored(progress.render, 30, worked=True)
    record = _stored(store)
    assert (record.frames_done, record.chunks_done, record.chunks_total) == (60, 2, 3)
    assert record.fps == 10.0 and record.eta_seconds == 3.0  # 30 frames left
    value, text = shown.shown[-1]
    assert abs(value - 100 * 60 / 90) < 1e-6
    assert text.startswith(f"Stage 3/{len(STEPS)}: render_chunk (attempt 2). 60/90 frames")
    progress.close()
    assert shown.closed is not None and "60/90 frames, 2/3 chunks" in shown.closed[1]


def test_the_analysis_advances_the_record_and_its_eta_covers_both_passes(
    tmp_path: Path,
) -> None:
    """While range parts analyse, ``frames_analysed`` moves, ``fps`` is the analysis's
    rate and the ETA counts the frames left to analyse and all the frames to render at
    that rate; once the render begins, its own rate."""
    store, clock, shown = local_store(tmp_path), Clock(), Shown()
    progress = VideoProgress(store, "job-1", 2, clock=clock, artifact=shown)  # type: ignore[arg-type]
    progress.start("probe")
    progress.probed(600)
    progress.found(progress.analysis, 200)  # a range analysed by an earlier attempt
    progress.begin(progress.analysis)
    progress.start("analyse")
    record = _stored(store)
    assert (record.frames_analysed, record.frames_done, record.frames_total) == (200, 0, 600)
    assert record.fps is None and record.eta_seconds is None  # no frame of this attempt yet
    clock.now += 10.0
    progress.running(progress.analysis, 40)  # the running parts reported 40 frames in 10 s
    record = _stored(store)
    assert (record.frames_analysed, record.fps, record.stage) == (240, 4.0, "analyse")
    assert record.eta_seconds == (360 + 600) / 4.0  # left to analyse + to render, at 4 fps
    assert shown.shown[-1][1].endswith("240/600 frames analysed, 4.0 fps, ETA 240 s.")
    assert abs(shown.shown[-1][0] - 100 * 240 / 600) < 1e-6
    clock.now += 10.0
    progress.running(progress.analysis, 0)  # the range of those 40 is stored:
    progress.stored(progress.analysis, 200, worked=True)
    assert _stored(store).frames_analysed == 400 and _stored(store).fps == 10.0
    progress.stored(progress.analysis, 200, worked=False)  # stored meanwhile by another run
    assert _stored(store).frames_analysed == 600 and _stored(store).eta_seconds == 60.0
    progress.planned(600, 2)
    progress.begin(progress.render)
    progress.start("render_chunk")
    record = _stored(store)
    assert (record.frames_analysed, record.frames_done, record.fps) == (600, 0, None)
    clock.now += 5.0
    progress.running(progress.render, 100)  # the render's own rate: 20 fps
    record = _stored(store)
    assert (record.frames_done, record.fps, record.eta_seconds) == (100, 20.0, 25.0)


def test_frames_are_written_at_most_once_per_interval(tmp_path: Path) -> None:
    store, clock = local_store(tmp_path), Clock()
    progress = VideoProgress(store, "job-1", 2, clock=clock, min_interval_s=1.0)
    progress.probed(300)
    progress.begin(progress.analysis)
    progress.start("analyse")
    writes = progress.writes
    for frames in range(1, 101):  # 100 frames over 5 s, each reported
        clock.now += 0.05
        progress.running(progress.analysis, frames)
    assert 4 <= progress.writes - writes <= 6  # one per second, not one per frame
    assert _stored(store).frames_analysed >= 100 - 20  # behind by at most one interval


def test_a_store_that_fails_never_fails_the_job(tmp_path: Path) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    progress = VideoProgress(local_store(blocked), "job-1", 1)
    progress.planned(frames=10, chunks=1)
    progress.stored(progress.render, 10, worked=True)
    assert progress.writes == 0 and progress.render.done == 10


def test_the_coordinator_adds_its_running_parts_frames_once(tmp_path: Path) -> None:
    """Range and render parts write their frame counts (``PartFrames``); the coordinator's
    record adds those of parts still running, and a stored range's or chunk's frames
    only once."""
    store, clock = local_store(tmp_path), Clock()
    progress = VideoProgress(store, "job-1", 2, clock=clock)
    progress.probed(60)
    ranges = {analysis_part(0, 32): 32, analysis_part(32, 60): 28}
    progress.begin(progress.analysis)
    progress.start("analyse")
    analysing = PartsProgress(progress, "job-1", 2, ranges, progress.analysis)
    range_counter = PartFrames(store, part_progress_key("job-1", 2, analysis_part(0, 32)))
    range_counter.add(8)  # one detector batch: written at once
    clock.now += 2.0
    analysing.tick(set(ranges))
    assert (_stored(store).frames_analysed, _stored(store).frames_done) == (8, 0)
    for part in ranges:
        analysing.done(part, worked=True)
    assert _stored(store).frames_analysed == 60

    progress.planned(frames=60, chunks=2)
    progress.begin(progress.render)
    progress.start("render_chunk")
    frames = {chunk_part(0): 30, chunk_part(1): 30}
    running = PartsProgress(progress, "job-1", 2, frames, progress.render)
    running.tick({chunk_part(0), chunk_part(1)})  # nothing written yet
    assert _stored(store).frames_done == 0
    counters = {}
    for part, n in ((chunk_part(0), 12), (chunk_part(1), 30)):
        key = part_progress_key("job-1", 2, part)
        counters[part] = PartFrames(store, key, clock=clock)
        for _ in range(n):
            counters[part].add()
    clock.now += 2.0  # 42 frames in 2 s
    running.tick({chunk_part(0), chunk_part(1)})
    record = _stored(store)
    # the parts' first frames are written at once, later ones a second after (not yet)
    assert record.frames_done == 2 and record.chunks_done == 0 and record.fps == 1.0
    counters[chunk_part(1)].write({"pose_mismatch": 2})  # the part stored its chunk
    running.done(chunk_part(1), worked=True)
    assert running.failures == {"pose_mismatch": 2}  # for the report's frame_failures
    record = _stored(store)
    assert (record.frames_done, record.chunks_done) == (31, 1)  # 30 stored + 1 seen of chunk 0
    running.done(chunk_part(0), worked=True)
    assert (_stored(store).frames_done, _stored(store).chunks_done) == (60, 2)


def test_a_range_parts_record_is_found_from_its_stored_analysis() -> None:
    """Retention finds a range part's frame count by the key of the range it analysed."""
    key = "video-analysis/analysis-000032-000060-" + "ab" * 16 + ".npz"
    assert analysis_part_of(key) == analysis_part(32, 60)
    assert analysis_part_of("video-chunks/chunk-00001-" + "ab" * 16 + ".mp4") is None


def test_a_fault_plan_hangs_a_part_once_after_its_first_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``flows.faults`` may hang a part mid-way: after its first frames' record is written
    (the test that kills a part mid-chunk waits for that record), and only once."""
    store, clock = local_store(tmp_path / "store"), Clock()
    key = part_progress_key("job-1", 1, chunk_part(1))
    seen: list[tuple[str, int | None]] = []

    def inject(stage: str) -> None:
        record = json.loads((tmp_path / "store" / key).read_text())
        seen.append((stage, record["frames"]))

    monkeypatch.setattr(faults, "inject", inject)
    counter = PartFrames(store, key, clock=clock, part=chunk_part(1))
    for _ in range(3):
        counter.add()
        clock.now += 2.0
    assert seen == [(chunk_part(1), 1)]
    PartFrames(store, key, clock=clock).add()  # a counter without a part: no fault point
    assert seen == [(chunk_part(1), 1)]
