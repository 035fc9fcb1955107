"""The ``fuse-video`` flow (v1, in one process): one video job attempt as Prefect tasks.

probe + moderation of sampled input frames → analysis + plan → one ``render-chunk-<i>``
task run per chunk → join (audio muxed) → moderation of sampled result frames + report →
store. With marking on, every rendered frame carries the job's watermark
(``tasks.watermark.VIDEO``) and the result its signed Content Credentials. Each step is a
task under ``flows.deadline.StageGuard`` with the job's one deadline (``VIDEO_STAGES``:
budgets per step, a chunk's budget per chunk). The steps are
``tasks.video``'s, the ones its in-process ``fuse_video`` runs.

Videos never pass through memory whole: the input is copied from the storage block to a
temporary directory (``blocks.storage.fetch_to``), chunks and the result go back file by
file (``put_from``). A rendered chunk is stored under ``video-chunks/<chunk_name>`` (a name
made from the video, chunk, face plan, sources and options): a chunk found there is not
rendered again, so a re-dispatched attempt renders only the missing chunks.

Contract as ``fuse-faces``: the result under ``result_key(job, attempt, "mp4")`` and its
``VideoResultRef`` sidecar last; the run returns the ref dict, or on failure writes the
``JobFailure`` record and ends ``Failed`` with ``"[code] message"``.

Not yet: chunks as child flow runs over the GPU pool, progress, cancel (issue 27).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar, cast

from prefect import Task, flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.states import State

from blocks.settings import StagePolicy, load_settings
from blocks.storage import (
    ByteStore,
    fetch_to,
    is_stored,
    load_storage,
    put_from,
    read_from,
    write_to,
)
from flows.artifacts import publish_video_result
from flows.deadline import Deadline, StageGuard
from flows.fuse import failed, start_attempt
from flows.outcome import record_failure
from flows.params import (
    DEFAULT_SETTINGS_BLOCK,
    DEFAULT_SIGNING_BLOCK,
    DEFAULT_STORAGE_BLOCK,
    VIDEO_FLOW_NAME,
    JobAttempt,
    VideoResultRef,
    chunks_manifest_key,
    result_key,
    result_meta_key,
    video_chunk_key,
)
from flows.run import pipeline_context
from flows.video_progress import VideoProgress
from tasks.options import FusionOptions
from tasks.pipeline import PipelineContext
from tasks.provenance import Ingredient, input_ingredients
from tasks.video import (
    FrameRunner,
    Planned,
    Probed,
    Samples,
    analyse_and_plan,
    chunk_name,
    file_digest,
    join_segments,
    probe_and_moderate,
    render_chunk,
    track_reports,
)
from tasks.video_io import VideoInfo
from tasks.video_plan import Chunk
from tasks.watermark import MIN_PIXELS, Payload, payload_for

R = TypeVar("R")


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
    progress: VideoProgress | None = None
    payload: Payload | None = None
    """The watermark every frame carries (the job's, when the context marks)."""

    def chunk_key(self, chunk: Chunk) -> str:
        """Where ``chunk``'s segment is stored (named by content: any attempt reuses it)."""
        assert self.planned is not None
        plan = self.planned.plan
        name = chunk_name(self.digest, chunk, plan, self.sources, self.options, self.payload)
        return video_chunk_key(name)

    def keep(self, index: int, image: Any) -> None:
        """A rendered frame: the report's samples see it, the progress counts it."""
        assert self.samples is not None
        self.samples.keep(index, image)
        if self.progress is not None:
            self.progress.frame_rendered()


@task(name="probe", task_run_name="probe", **_TASK)  # type: ignore[call-overload]
def probe_task(job: VideoJob, target_key: str) -> Probed:
    """Copy the video from storage, probe it and moderate sampled frames."""
    fetch_to(job.store, target_key, job.video)
    job.digest = file_digest(job.video)
    return probe_and_moderate(job.sources, job.video, job.ctx, references=job.references)


@task(name="analyse", task_run_name="analyse", **_TASK)  # type: ignore[call-overload]
def analyse_task(job: VideoJob) -> Planned:
    """Analyse every frame and plan the chunks and faces."""
    assert job.probed is not None
    return analyse_and_plan(job.video, job.probed, job.options, job.ctx, job.chunk_s)


@task(name="render_chunk", task_run_name="render_chunk", **_TASK)  # type: ignore[call-overload]
def render_chunk_task(job: VideoJob, chunk: Chunk, runner: FrameRunner) -> tuple[Path, bool]:
    """The chunk's segment, local: from storage when an earlier attempt stored it (only
    its samples are read), else rendered and stored. Whether it was rendered."""
    assert job.probed is not None and job.planned is not None and job.samples is not None
    plan = job.planned.plan
    key = job.chunk_key(chunk)
    name = key.rsplit("/", 1)[-1]
    segment = job.workdir / "chunks" / name
    segment.parent.mkdir(parents=True, exist_ok=True)
    if is_stored(job.store, key):
        fetch_to(job.store, key, segment)
        job.samples.read_from(segment, chunk)
        return segment, False
    partial = segment.with_name(f"{name}.partial")
    render_chunk(
        job.video, partial, chunk, info=job.probed.info, pts=job.probed.pts, plan=plan,
        sources=job.planned.sources, options=job.options, ctx=job.ctx, runner=runner,
        keep=job.keep, payload=job.payload,
    )  # fmt: skip
    partial.replace(segment)
    put_from(job.store, key, segment)
    return segment, True


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


@flow(
    name=VIDEO_FLOW_NAME,
    flow_run_name="{job_id}",
    persist_result=False,
    retries=0,
    validate_parameters=True,
    log_prints=False,
)
def fuse_video_flow(
    job_id: str,
    owner_id: str,
    source_key: str,
    target_key: str,
    deadline_at: datetime,
    options: FusionOptions | None = None,
    attempt: int = 1,
    extra_source_keys: list[str] | None = None,
    reference_keys: list[str] | None = None,
    storage_block: str = DEFAULT_STORAGE_BLOCK,
    settings_block: str = DEFAULT_SETTINGS_BLOCK,
    chunk_s: float | None = None,
    binding: str | None = None,
    signing_block: str = DEFAULT_SIGNING_BLOCK,
) -> dict[str, Any] | State[Any]:
    """Fuse the source face into every frame of the target video for one job attempt
    (a per-face mapping: each source onto its person, ``extra_source_keys`` and
    ``reference_keys`` as for ``fuse-faces``).

    Returns ``VideoResultRef.model_dump(mode="json")``; on failure the run ends ``Failed``
    with ``"[code] message"`` and the attempt's ``JobFailure`` is in storage. Parameters
    not bound to the job (``binding``, ``flows.binding``) fail it with
    ``run_binding_invalid`` before anything is read."""
    spec = JobAttempt.of_run(locals())
    stage = "load"
    store: ByteStore | None = None
    progress: VideoProgress | None = None
    deadline = Deadline.of(deadline_at)
    try:
        start_attempt(
            spec,
            storage_block=storage_block,
            settings_block=settings_block,
            signing_block=signing_block,
        )
        settings = load_settings(settings_block)
        store = load_storage(storage_block)
        progress = VideoProgress.of_run(store, job_id, attempt)
        ctx = pipeline_context(settings, signing_block)
        chosen = settings.apply_defaults(options or FusionOptions.model_validate({}))
        sources = [read_from(store, k) for k in [source_key, *(extra_source_keys or [])]]
        sweep_workdirs()
        with tempfile.TemporaryDirectory(prefix=f"{WORKDIR_PREFIX}{os.getpid()}-") as tmp:
            workdir = Path(tmp)
            chunk_len = chunk_s or settings.video_chunk_s
            job = VideoJob(store, workdir, workdir / "input", sources, chosen, ctx, chunk_len)
            job.references = [read_from(store, k) for k in reference_keys or []]
            job.payload = payload_for(job_id) if ctx.marker is not None else None
            job.progress = progress

            def step(name: str, fn: Task[..., R], *args: Any) -> R:
                nonlocal stage
                if name != stage:
                    progress.start(name)
                stage = name
                return guarded(name, deadline).run(fn, *args)

            job.probed = step("probe", probe_task, job, target_key)
            job.planned = step("analyse", analyse_task, job)
            progress.planned(job.probed.info.frame_count, len(job.planned.chunks))
            manifest = [job.chunk_key(chunk) for chunk in job.planned.chunks]
            write_to(store, chunks_manifest_key(job_id, attempt), json.dumps(manifest).encode())
            job.samples = Samples(job.planned.plan, job.probed.samples, ctx.pins)
            runner = FrameRunner(ctx)
            segments, rendered = [], 0
            for chunk in job.planned.chunks:
                render = render_chunk_task.with_options(
                    task_run_name=f"render-chunk-{chunk.index:04d}"
                )
                segment, did = step("render_chunk", render, job, chunk, runner)
                progress.chunk_done(chunk.frames, rendered=did)
                segments.append(segment)
                rendered += int(did)
            info = step("join", join_task, job, segments)
            flags, similarities = step("report", report_task, job)
            plan = job.planned.plan
            ref = VideoResultRef(
                key=result_key(job_id, attempt, "mp4"),
                content_type="video/mp4",
                width=info.width,
                height=info.height,
                faces_replaced=sum(len(swaps) for swaps in plan.frames),
                device=ctx.device,
                moderation=job.probed.flags + flags,
                frames=info.frame_count,
                duration_s=float(info.duration_s),
                chunks=len(job.planned.chunks),
                chunks_rendered=rendered,
                cuts=job.planned.cuts,
                switches=plan.switches,
                tracks=[asdict(t) for t in track_reports(plan, similarities)],
                frame_failures=dict(runner.failures),
                marks=video_marks(ctx.marker is not None, info),
            )
            step("store", store_task, job, ref, result_meta_key(job_id, attempt))
            facts = [
                f"{ref.frames} frames, {ref.width}x{ref.height}, {ref.duration_s:.1f} s",
                f"{ref.chunks} chunk(s), {ref.chunks_rendered} rendered in this attempt",
                f"{ref.faces_replaced} faces replaced, {len(ref.tracks)} track(s)",
            ]
            publish_video_result(job_id, attempt, ref.key, ref.marks, facts)
    except Exception as exc:
        record_failure(store if store is not None else storage_block, job_id, attempt, exc, stage)
        return failed(exc, f"Video job {job_id} attempt {attempt}")
    finally:
        if progress is not None:
            progress.close()
    get_run_logger().info(
        "Video job %s: %d chunk(s), %d rendered", job_id, ref.chunks, ref.chunks_rendered
    )
    return ref.model_dump(mode="json")
