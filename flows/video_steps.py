"""The GPU steps of a video job attempt as Prefect tasks, run by its ``fuse-video-part``
runs (``flows/video_parts.py``): probe, one frame range's analysis, the plan, one chunk's
render, the report. Each step is ``tasks.video``'s, the one its in-process ``fuse_video``
runs, under ``flows.deadline.StageGuard`` with the job's one deadline
(``flows.video_store.VIDEO_STAGES``). The coordinator's own steps (collect, join, store)
and what passes between the runs are ``flows.video_store``'s: it imports no model.

Videos never pass through memory whole: a range, plan or render part reads the input in
place (``VideoJob.read_input``: a link in the run's temporary directory to a local storage
block's file, no byte copied, or ranged reads of an S3 object, only the blocks FFmpeg asks
for); the probe reads it whole, from that link or a copy (``read_locally``), as the report
reads the chunks; chunks and the result go back file by file (``put_from``). A rendered
chunk is stored under ``video-chunks/<chunk_name>`` (a name made from the video, chunk,
face plan, sources and options): a chunk found there is not rendered again, so a
re-dispatched attempt renders only the missing chunks. The analysis of a frame range is
stored the same way, under ``video-analysis/<range_name>`` (``.npz``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from prefect import task

from blocks.ranged import RangedSource
from blocks.storage import (
    ByteStore,
    is_stored,
    put_from,
    read_from,
    read_in_place,
    read_locally,
    write_to,
)
from flows.params import video_analysis_key, video_chunk_key
from flows.video_store import TASK_OPTIONS, ReportRecord
from tasks import video_analysis
from tasks.errors import TransientError
from tasks.options import FusionOptions
from tasks.pipeline import PipelineContext
from tasks.video import (
    FrameRunner,
    Planned,
    Probed,
    Samples,
    analyse_range,
    check_sources,
    chunk_name,
    file_digest,
    frame_ranges,
    plan_video,
    probe_and_moderate,
    render_chunk,
)
from tasks.video_io import VideoSource
from tasks.video_plan import Chunk
from tasks.watermark import Payload


class FrameCounter(Protocol):
    """What counts a part's analysed or rendered frames (``flows.video_parts.PartFrames``)."""

    def add(self, frames: int = 1) -> None:
        """``frames`` more frames analysed or rendered."""


@dataclass
class VideoJob:
    """One attempt's state between its steps (in this process)."""

    store: ByteStore
    workdir: Path
    video: VideoSource
    """The input video: a local file (``read_locally``) or read in place (``read_input``)."""
    sources: list[bytes]
    options: FusionOptions
    ctx: PipelineContext
    chunk_s: float
    references: list[bytes] = field(default_factory=list)
    probed: Probed | None = None
    planned: Planned | None = None
    samples: Samples | None = None
    digest: str = ""
    progress: FrameCounter | None = None
    payload: Payload | None = None
    """The watermark every frame carries (the job's, when the context marks)."""

    def read_input(self, key: str) -> None:
        """Let the steps read the input video under ``key`` where it is stored
        (``read_in_place``: a link to a local file, ranged reads of an S3 object)."""
        self.video = read_in_place(self.store, key, self.workdir / "input")

    def input_reads(self) -> str | None:
        """What the ranged reads of an input read in place fetched (``None`` for a local
        file): the figure that shows a part read its range of the upload, not all of it."""
        video = self.video
        if not isinstance(video, RangedSource):
            return None
        share = video.fetched_bytes / video.size if video.size else 0.0
        return (
            f"read {video.fetched_bytes} of the input's {video.size} bytes ({share:.1%}) "
            f"in {video.requests} ranged requests"
        )

    def chunk_key(self, chunk: Chunk) -> str:
        """Where ``chunk``'s segment is stored (named by content: any attempt reuses it)."""
        assert self.planned is not None
        plan = self.planned.plan
        name = chunk_name(self.digest, chunk, plan, self.sources, self.options, self.payload)
        return video_chunk_key(name)

    def analysis_key(self, start: int, stop: int) -> str:
        """Where the analysis of frames ``[start, stop)`` is stored (named by content)."""
        d, ctx = self.options.detector, self.ctx
        name = video_analysis.range_name(self.digest, start, stop, d, ctx.detect_max_side, ctx.pins)
        return video_analysis_key(name)

    def ranges(self) -> list[tuple[int, int]]:
        """The frame ranges of the video's analysis (one part each)."""
        assert self.probed is not None
        return frame_ranges(self.probed, self.chunk_s)

    def keep(self, index: int, image: Any) -> None:
        """A rendered frame: the report's samples (if kept here) see it, the progress
        counts it."""
        if self.samples is not None:
            self.samples.keep(index, image)
        if self.progress is not None:
            self.progress.add()

    def analysed(self, frames: int) -> None:
        """``frames`` more frames analysed: the progress counts them."""
        if self.progress is not None:
            self.progress.add(frames)


@task(name="probe", task_run_name="probe", **TASK_OPTIONS)  # type: ignore[call-overload]
def probe_task(job: VideoJob, target_key: str) -> Probed:
    """Copy the video from storage (it is read whole: digest, every packet), probe it,
    moderate sampled frames, then check the sources (``check_sources``: the first face
    model runs after moderation)."""
    job.video = video = read_locally(job.store, target_key, job.workdir / "input")
    job.digest = file_digest(video)
    probed = probe_and_moderate(job.sources, video, job.ctx, references=job.references)
    check_sources(probed, job.options, job.ctx)  # a source without a face fails here
    return probed


@task(name="analyse", task_run_name="analyse", **TASK_OPTIONS)  # type: ignore[call-overload]
def analyse_task(job: VideoJob, start: int, stop: int) -> bool:
    """Analyse frames ``[start, stop)`` and store the result under its content key, unless
    an earlier run stored it; whether it analysed."""
    assert job.probed is not None
    key = job.analysis_key(start, stop)
    if is_stored(job.store, key):
        return False
    found = analyse_range(
        job.video, job.probed, start, stop, job.options, job.ctx, analysed=job.analysed
    )
    write_to(job.store, key, video_analysis.encode(found))
    return True


@task(name="plan", task_run_name="plan", **TASK_OPTIONS)  # type: ignore[call-overload]
def plan_task(job: VideoJob) -> Planned:
    """The chunks and face plan from every range's stored analysis."""
    assert job.probed is not None
    parts = []
    for start, stop in job.ranges():
        key = job.analysis_key(start, stop)
        if not is_stored(job.store, key):  # deleted since its part stored it: another try
            raise TransientError("An analysed frame range went missing.", detail=key)
        parts.append(video_analysis.decode(read_from(job.store, key)))
    analysis = video_analysis.merged(parts)
    return plan_video(job.video, job.probed, analysis, job.options, job.ctx, job.chunk_s)


@task(name="render_chunk", task_run_name="render_chunk", **TASK_OPTIONS)  # type: ignore[call-overload]
def render_chunk_task(job: VideoJob, chunk: Chunk, runner: FrameRunner) -> bool:
    """Render the chunk's segment and store it, unless an earlier run stored it; whether
    it was rendered. A killed render leaves nothing stored (the partial file is local)."""
    assert job.probed is not None and job.planned is not None
    key = job.chunk_key(chunk)
    if is_stored(job.store, key):
        return False
    name = key.rsplit("/", 1)[-1]
    segment = job.workdir / "chunks" / name
    segment.parent.mkdir(parents=True, exist_ok=True)
    partial = segment.with_name(f"{name}.partial")
    render_chunk(
        job.video, partial, chunk, info=job.probed.info, pts=job.probed.pts,
        plan=job.planned.plan, sources=job.planned.sources, options=job.options, ctx=job.ctx,
        runner=runner, keep=job.keep, payload=job.payload,
    )  # fmt: skip
    partial.replace(segment)
    put_from(job.store, key, segment)
    return True


@task(name="report", task_run_name="report", **TASK_OPTIONS)  # type: ignore[call-overload]
def report_task(job: VideoJob, keys: list[str]) -> ReportRecord:
    """Moderation of the sampled result frames and each track's identity similarities
    (``Samples.moderate_and_check``, as the in-process ``fuse_video``): the samples are
    read from the stored chunks (``keys``, one per planned chunk) that hold any."""
    assert job.planned is not None and job.samples is not None
    for chunk, key in zip(job.planned.chunks, keys, strict=True):
        if not job.samples.wants(chunk):
            continue
        segment = job.workdir / "chunks" / key.rsplit("/", 1)[-1]
        segment.parent.mkdir(parents=True, exist_ok=True)
        if not is_stored(job.store, key):  # deleted since its part stored it: another try
            raise TransientError("A rendered chunk went missing.", detail=key)
        read_locally(job.store, key, segment)
        job.samples.read_from(segment, chunk)
    flags, similarities = job.samples.moderate_and_check(job.planned.sources, job.ctx)
    return ReportRecord(flags=flags, similarities=similarities, device=job.ctx.device)
