"""A video attempt's progress record (flows.video_progress): what it counts, how often it
is written to storage, and the description the Prefect UI and the relay read."""

from __future__ import annotations

from pathlib import Path

from prefect.filesystems import LocalFileSystem

from flows.params import JobProgress, chunk_part, part_progress_key, progress_key
from flows.video_parts import PartFrames
from flows.video_progress import STEPS, PartsProgress, VideoProgress


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


def _stored(store: LocalFileSystem, job: str = "job-1", attempt: int = 2) -> JobProgress:
    return JobProgress.model_validate_json(store.read_path(progress_key(job, attempt)))


def test_progress_counts_frames_chunks_speed_and_eta(tmp_path: Path) -> None:
    store, clock, shown = LocalFileSystem(basepath=str(tmp_path)), Clock(), Shown()
    progress = VideoProgress(store, "job-1", 2, clock=clock, artifact=shown)  # type: ignore[arg-type]
    progress.start("probe")
    assert _stored(store).stage == "probe" and _stored(store).frames_total == 0
    progress.start("analyse")
    progress.planned(frames=90, chunks=3)
    progress.start("render_chunk")
    progress.chunk_done(30, rendered=False)  # found stored by an earlier attempt
    assert (_stored(store).frames_done, _stored(store).chunks_done) == (30, 1)
    assert _stored(store).fps is None and _stored(store).eta_seconds is None
    for _ in range(30):  # rendered at 10 frames per second
        clock.now += 0.1
        progress.frame_rendered()
    progress.chunk_done(30, rendered=True)
    record = _stored(store)
    assert (record.frames_done, record.chunks_done, record.chunks_total) == (60, 2, 3)
    # 30 frames in 2.9 s (the clock starts at the first frame): ≈ 10.3 fps, 30 frames left
    assert record.fps is not None and abs(record.fps - 30 / 2.9) < 0.01
    assert record.eta_seconds is not None and abs(record.eta_seconds - 30 / (30 / 2.9)) < 0.1
    value, text = shown.shown[-1]
    assert abs(value - 100 * 60 / 90) < 1e-6
    assert text.startswith(f"Stage 3/{len(STEPS)}: render_chunk (attempt 2). 60/90 frames")
    progress.close()
    assert shown.closed is not None and "60/90 frames, 2/3 chunks" in shown.closed[1]


def test_frames_are_written_at_most_once_per_interval(tmp_path: Path) -> None:
    store, clock = LocalFileSystem(basepath=str(tmp_path)), Clock()
    progress = VideoProgress(store, "job-1", 2, clock=clock, min_interval_s=1.0)
    progress.planned(frames=300, chunks=2)
    writes = progress.writes
    for _ in range(100):  # 100 frames over 5 s
        clock.now += 0.05
        progress.frame_rendered()
    assert 4 <= progress.writes - writes <= 6  # one per second, not one per frame
    assert _stored(store).frames_done >= 100 - 20  # behind by at most one interval


def test_a_store_that_fails_never_fails_the_job(tmp_path: Path) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    progress = VideoProgress(LocalFileSystem(basepath=str(blocked)), "job-1", 1)
    progress.planned(frames=10, chunks=1)
    progress.frame_rendered()
    assert progress.writes == 0 and progress.frames_done == 1


def test_the_coordinator_adds_its_running_parts_frames_once(tmp_path: Path) -> None:
    """Render parts write their frame counts (``PartFrames``); the coordinator's record
    adds those of parts still running, and a stored chunk's frames only once."""
    store, clock = LocalFileSystem(basepath=str(tmp_path)), Clock()
    progress = VideoProgress(store, "job-1", 2, clock=clock)
    progress.planned(frames=60, chunks=2)
    progress.rendering()
    frames = {chunk_part(0): 30, chunk_part(1): 30}
    running = PartsProgress(progress, "job-1", 2, frames)
    running.tick({chunk_part(0), chunk_part(1)})  # nothing written yet
    assert _stored(store).frames_done == 0
    counters = {}
    for part, n in ((chunk_part(0), 12), (chunk_part(1), 30)):
        key = part_progress_key("job-1", 2, part)
        counters[part] = PartFrames(store, key, clock=clock)  # type: ignore[arg-type]
        for _ in range(n):
            counters[part].frame_rendered()
    clock.now += 2.0  # 42 frames in 2 s
    running.tick({chunk_part(0), chunk_part(1)})
    record = _stored(store)
    # the parts' first frames are written at once, later ones a second after (not yet)
    assert record.frames_done == 2 and record.chunks_done == 0 and record.fps == 1.0
    counters[chunk_part(1)].write({"pose_mismatch": 2})  # the part stored its chunk
    running.done(chunk_part(1), rendered=True)
    assert running.failures == {"pose_mismatch": 2}  # for the report's frame_failures
    record = _stored(store)
    assert (record.frames_done, record.chunks_done) == (31, 1)  # 30 stored + 1 seen of chunk 0
    running.done(chunk_part(0), rendered=True)
    assert (_stored(store).frames_done, _stored(store).chunks_done) == (60, 2)
