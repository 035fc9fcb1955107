"""The steps of a video job attempt as Prefect tasks, shared by the ``fuse-video``
coordinator (``flows/video.py``: join, report, store) and its parts
(``flows/video_parts.py``: probe, one frame range's analysis, the plan, one chunk's
render). Each step is
``tasks.video``'s, the one its in-process ``fuse_video`` runs, under
``flows.deadline.StageGuard`` with the job's one deadline (``VIDEO_STAGES``).

Videos never pass through memory whole: the input is copied from the storage block to a
temporary directory (``blocks.storage.fetch_to``), chunks and the result go back file by
file (``put_from``). A rendered chunk is stored under ``video-chunks/<chunk_name>`` (a name
made from the video, chunk, face plan, sources and options): a chunk found there is not
rendered again, so a re-dispatched attempt renders only the missing chunks. The analysis
of a frame range is stored the same way, under ``video-analysis/<range_name>`` (``.npz``).
"""

from __future__ import annotations

import hashlib
import hmac
import io
import os
import pickle
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, cast

from prefect import task
from prefect.cache_policies import NO_CACHE

from blocks.settings import StagePolicy
from blocks.storage import ByteStore, fetch_to, is_stored, put_from, read_from, write_to
from flows.binding import worker_keys
from flows.deadline import Deadline, StageGuard
from flows.params import VideoResultRef, video_analysis_key, video_chunk_key
from tasks import video_analysis
from tasks.errors import InvalidInput, RunBindingInvalid, TransientError
from tasks.options import FusionOptions
from tasks.pipeline import PipelineContext
from tasks.provenance import Ingredient, input_ingredients
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
    join_segments,
    plan_video,
    probe_and_moderate,
    render_chunk,
)
from tasks.video_io import VideoInfo
from tasks.video_plan import Chunk
from tasks.watermark import MIN_PIXELS, Payload


@dataclass(frozen=True, slots=True)
class Budget:
    """Time budget, expected cost and retries of one video step."""

    budget_s: float
    expected_s: float
    retries: int


VIDEO_STAGES: dict[str, Budget] = {
    "probe": Budget(budget_s=120.0, expected_s=1.0, retries=2),
    "analyse": Budget(budget_s=1800.0, expected_s=10.0, retries=1),
    "render_chunk": Budget(budget_s=600.0, expected_s=5.0, retries=2),  # per chunk
    "join": Budget(budget_s=300.0, expected_s=2.0, retries=2),
    "report": Budget(budget_s=300.0, expected_s=2.0, retries=1),
    "store": Budget(budget_s=300.0, expected_s=1.0, retries=2),
}
"""Defaults of the video steps (seconds). A chunk of ~10 s renders in ~5-60 s on CPU."""

RETRY_DELAY_S = 1.0
WORKDIR_PREFIX = "fuse-video-"
"""Temporary directories of attempts: ``fuse-video-<pid>-…`` (swept once their process is
gone: a cancelled or overdue run's process is killed before it can remove its own)."""

_TASK = {"persist_result": False, "cache_policy": NO_CACHE}


class FrameCounter(Protocol):
    """What counts a part's rendered frames (``flows.video_parts.PartFrames``)."""

    def frame_rendered(self) -> None:
        """One more frame rendered."""


@dataclass
class VideoJob:
    """One attempt's state between its steps (in this process)."""

    store: ByteStore
    workdir: Path
    video: Path
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
            self.progress.frame_rendered()


@task(name="probe", task_run_name="probe", **_TASK)  # type: ignore[call-overload]
def probe_task(job: VideoJob, target_key: str) -> Probed:
    """Copy the video from storage, probe it, moderate sampled frames, then check the
    sources (``check_sources``: the first face model runs after moderation)."""
    fetch_to(job.store, target_key, job.video)
    job.digest = file_digest(job.video)
    probed = probe_and_moderate(job.sources, job.video, job.ctx, references=job.references)
    probed.found = check_sources(probed, job.options, job.ctx)  # no face: fails here
    return probed


@task(name="analyse", task_run_name="analyse", **_TASK)  # type: ignore[call-overload]
def analyse_task(job: VideoJob, start: int, stop: int) -> bool:
    """Analyse frames ``[start, stop)`` and store the result under its content key, unless
    an earlier run stored it; whether it analysed."""
    assert job.probed is not None
    key = job.analysis_key(start, stop)
    if is_stored(job.store, key):
        return False
    found = analyse_range(job.video, job.probed, start, stop, job.options, job.ctx)
    write_to(job.store, key, video_analysis.encode(found))
    return True


@task(name="plan", task_run_name="plan", **_TASK)  # type: ignore[call-overload]
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


@task(name="render_chunk", task_run_name="render_chunk", **_TASK)  # type: ignore[call-overload]
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


@task(name="collect", task_run_name="collect", **_TASK)  # type: ignore[call-overload]
def collect_task(job: VideoJob) -> list[Path]:
    """Every chunk's stored segment, local and in order, with the report's samples read
    from those that hold any (the coordinator renders nothing: its parts stored them)."""
    assert job.planned is not None and job.samples is not None
    segments = []
    for chunk in job.planned.chunks:
        key = job.chunk_key(chunk)
        segment = job.workdir / "chunks" / key.rsplit("/", 1)[-1]
        segment.parent.mkdir(parents=True, exist_ok=True)
        if not is_stored(job.store, key):  # deleted since its part stored it: another try
            raise TransientError("A rendered chunk went missing.", detail=key)
        fetch_to(job.store, key, segment)
        job.samples.read_from(segment, chunk)
        segments.append(segment)
    return segments


@task(name="join", task_run_name="join", **_TASK)  # type: ignore[call-overload]
def join_task(job: VideoJob, segments: list[Path]) -> VideoInfo:
    """Concatenate the segments and mux the input's audio into the result file."""
    assert job.probed is not None
    return join_segments(
        segments, job.video, job.workdir / "result.mp4", source_info=job.probed.info
    )


@task(name="report", task_run_name="report", **_TASK)  # type: ignore[call-overload]
def report_task(job: VideoJob) -> tuple[list[str], dict[int, list[float]]]:
    """Moderation of the sampled result frames and each track's identity similarities."""
    assert job.planned is not None and job.samples is not None
    return job.samples.moderate_and_check(job.planned.sources, job.ctx)


@task(name="store", task_run_name="store", **_TASK)  # type: ignore[call-overload]
def store_task(job: VideoJob, ref: VideoResultRef, meta_key: str) -> None:
    """The result file (signed with its Content Credentials when the context marks:
    ``tasks.provenance``), then its sidecar (last: its presence means the video is whole)."""
    result = job.workdir / "result.mp4"
    if job.ctx.marker is not None:
        target = Ingredient("target", ref.content_type, job.digest)
        signed = job.workdir / "result.signed.mp4"
        ingredients = input_ingredients(job.sources, target, job.references)
        job.ctx.marker.sign_file(result, signed, ref.content_type, ingredients)
        result = signed
    put_from(job.store, ref.key, result)
    write_to(job.store, meta_key, ref.model_dump_json().encode())


def video_marks(marking: bool, info: VideoInfo) -> list[str]:
    """A video result's marks: none without marking; else its manifest, and the watermark
    when its frames are large enough to carry one (``watermark.MIN_PIXELS``)."""
    if not marking:
        return []
    return ["c2pa", *(["watermark"] if info.width * info.height >= MIN_PIXELS else [])]


@dataclass(frozen=True, slots=True)
class StoredPlan:
    """What the probe part stores (``planned`` None) and the plan part then stores for the
    render parts and the coordinator."""

    digest: str
    probed: Probed
    planned: Planned | None = None


PLAN_MAGIC = b"FFPLAN1"
"""The first bytes of a stored plan: then its HMAC-SHA256 (32 bytes), then the pickle."""

#: What a stored plan may name besides FaceFlow's own classes: numpy's arrays, fractions.
_PLAN_GLOBALS = {
    ("fractions", "Fraction"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "scalar"),
    ("numpy._core.numeric", "_frombuffer"),
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy.core.numeric", "_frombuffer"),
}


class _PlanUnpickler(pickle.Unpickler):
    """Unpickles classes of ``tasks``/``flows`` and numpy arrays only: no function of
    another module can be called while a plan is read."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _PLAN_GLOBALS:
            return super().find_class(module, name)
        if module.split(".")[0] in ("tasks", "flows"):
            found = super().find_class(module, name)
            if isinstance(found, type):
                return found
        raise pickle.UnpicklingError(f"a video plan may not name {module}.{name}")


def plan_mac(key: str, body: bytes) -> bytes:
    """The HMAC-SHA256 of a stored plan's pickle ``body`` under run-signing ``key``."""
    return hmac.new(key.encode(), PLAN_MAGIC + body, hashlib.sha256).digest()


def save_plan(store: ByteStore, key: str, plan: StoredPlan) -> None:
    """Store a plan: pickled, behind an HMAC with the run-signing key (the key that binds
    runs to jobs, ``flows.binding.worker_keys``), so that only FaceFlow's flows can write
    one that another process reads."""
    body = pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL)
    keys = worker_keys()
    if not keys:
        raise RunBindingInvalid(detail="no run-signing key: a video plan cannot be stored")
    write_to(store, key, PLAN_MAGIC + plan_mac(keys[0], body) + body)


def load_plan(store: ByteStore, key: str) -> StoredPlan:
    """The plan the analysis part stored under ``key``; ``InvalidInput`` when its HMAC
    matches no accepted key (written by something else) or it names a foreign global."""
    data = read_from(store, key)
    head, rest = data[: len(PLAN_MAGIC)], data[len(PLAN_MAGIC) :]
    mac, body = rest[:32], rest[32:]
    if head != PLAN_MAGIC or not any(
        hmac.compare_digest(mac, plan_mac(k, body)) for k in worker_keys()
    ):
        raise InvalidInput(detail=f"{key} holds no video plan signed by this service")
    try:
        plan = _PlanUnpickler(io.BytesIO(body)).load()
    except pickle.UnpicklingError as exc:
        raise InvalidInput(detail=f"{key}: {exc}") from exc
    if not isinstance(plan, StoredPlan):
        raise InvalidInput(detail=f"{key} holds no video plan")
    return plan


def sweep_workdirs(root: Path | None = None) -> int:
    """Remove the temporary directories of attempts whose process is gone; how many."""
    removed = 0
    for path in (root or Path(tempfile.gettempdir())).glob(f"{WORKDIR_PREFIX}*-*"):
        pid = path.name.removeprefix(WORKDIR_PREFIX).split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)) and path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
            removed += 1
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def guarded(stage: str, deadline: Deadline) -> StageGuard:
    """The guard of video step ``stage`` under the job's deadline."""
    b = VIDEO_STAGES[stage]
    policy = StagePolicy(
        stage=cast(Any, stage),
        budget_s=b.budget_s,
        expected_s=b.expected_s,
        retries=b.retries,
        retry_delay_s=RETRY_DELAY_S,
    )
    return StageGuard(deadline, policy)
