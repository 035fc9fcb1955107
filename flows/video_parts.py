"""The ``fuse-video-part`` flow: one piece of a video job attempt on one GPU worker.

A ``fuse-video`` coordinator (``flows/video.py``, on the control pool) creates these runs
from two deployments on the GPU pool's ``video`` queue: ``video-analyse`` (part ``probe``:
probe, moderation of sampled input frames and the sources' check, stored under
``video_plan_key``; parts ``analyse-<start>-<stop>``: one frame range's analysis, stored
under its content key, ``VideoJob.analysis_key``; part ``plan``: chunks and face plan from
every range's analysis, stored under ``video_plan_key``) and ``video-render`` (part
``chunk-<i>``: one chunk rendered and stored under its content key,
``flows.video_steps.VideoJob.chunk_key``); then, on ``video-analyse`` again, part
``report`` (moderation of sampled result frames read back from the stored chunks, each
track's identity similarity to its source: the same models as probe and plan, none of the
render's; its ``ReportRecord`` under ``video_report_key``). The steps are
``flows.video_steps``' tasks, the same stage code as every other path; a GPU runs one
part at a time, so a video's frame ranges and chunks spread over the pool's workers.

A part checks the job's binding and deadline as the coordinator does (it carries the
job's parameters); it returns a small dict, or ends ``Failed`` with ``"[code] message"``
(the coordinator turns that back into the typed error). A range or render part whose
result is stored already returns at once: a re-run of a killed part redoes only its own.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack, suppress
from dataclasses import replace
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.states import Completed, State

from blocks.settings import load_settings
from blocks.storage import (
    ByteStore,
    is_stored,
    load_storage,
    read_from,
    write_to,
)
from flows import faults
from flows.attempt import admit, failed
from flows.deadline import Deadline
from flows.params import (
    DEFAULT_SETTINGS_BLOCK,
    DEFAULT_SIGNING_BLOCK,
    DEFAULT_STORAGE_BLOCK,
    PLAN_PART,
    PROBE_PART,
    REPORT_PART,
    VIDEO_PART_FLOW_NAME,
    JobAttempt,
    analysis_part,
    chunk_part,
    part_progress_key,
    video_plan_key,
    video_report_key,
)
from flows.run import pipeline_context
from flows.video_progress import MIN_INTERVAL_S
from flows.video_steps import (
    VideoJob,
    analyse_task,
    plan_task,
    probe_task,
    render_chunk_task,
    report_task,
)
from flows.video_store import (
    RENDERED,
    STORED,
    WORKDIR_PREFIX,
    StoredPlan,
    guarded,
    load_plan,
    save_plan,
    sweep_workdirs,
)
from tasks.errors import InvalidInput
from tasks.video import FrameRunner, Samples
from tasks.watermark import payload_for


class PartFrames:
    """The frames a range or render part has analysed or rendered, written to
    ``part_progress_key`` at most once per ``MIN_INTERVAL_S`` (a record that cannot be
    written is skipped: progress never fails the part). Once the first record is written,
    a fault plan may hang the part under its name ``part`` (``flows.faults``: inert
    unless enabled)."""

    def __init__(
        self,
        store: ByteStore,
        key: str,
        clock: Callable[[], float] = time.monotonic,
        *,
        part: str = "",
    ) -> None:
        self.store, self.key, self.clock, self.frames = store, key, clock, 0
        self.part = part
        self.written_at: float | None = None

    def add(self, frames: int = 1) -> None:
        """``frames`` more frames done; written when the interval passed."""
        self.frames += frames
        now = self.clock()
        first = self.written_at is None
        if self.written_at is None or now - self.written_at >= MIN_INTERVAL_S:
            self.written_at = now
            self.write({})
        if first and self.part:
            faults.inject(self.part)  # mid-part; no-op unless FACEFLOW_ENABLE_FAULTS=true

    def write(self, failures: dict[str, int]) -> None:
        """Write the count, and ``failures`` (frames a stage failed on, by code: once the
        chunk is stored, for the coordinator's report)."""
        record = {"frames": self.frames, "failures": failures}
        with suppress(Exception):
            write_to(self.store, self.key, json.dumps(record).encode())


@flow(
    name=VIDEO_PART_FLOW_NAME,
    persist_result=False,
    retries=0,
    validate_parameters=True,
    log_prints=False,
)
def fuse_video_part(
    job: JobAttempt,
    part: str,
    storage_block: str = DEFAULT_STORAGE_BLOCK,
    settings_block: str = DEFAULT_SETTINGS_BLOCK,
    signing_block: str = DEFAULT_SIGNING_BLOCK,
    chunk_s: float | None = None,
) -> State[Any]:
    """Run one part of the video job attempt ``job`` (its parameters as the coordinator
    got them, with their binding): ``probe``, ``analyse-<start>-<stop>`` (store the
    range's analysis), ``plan`` (store the plan), ``chunk-<i>`` (render and store chunk
    ``i``) or ``report`` (store the report's record). Ends ``Completed`` with a message
    that starts with ``RENDERED`` or ``STORED``; on failure ``Failed`` with
    ``"[code] message"``. The coordinator names the run ``<job id>-<part>``."""
    deadline = Deadline.of(job.deadline_at)
    try:
        admit(job, storage_block=storage_block, settings_block=settings_block,
              signing_block=signing_block)  # fmt: skip
        rendered = run_part(job, part, deadline, storage_block, settings_block,
                            signing_block, chunk_s)  # fmt: skip
    except Exception as exc:
        return failed(exc, f"Video job {job.job_id} attempt {job.attempt} part {part}")
    get_run_logger().info("Video job %s part %s: rendered=%s", job.job_id, part, rendered)
    said = f"{RENDERED if rendered else STORED} by pid {os.getpid()}"
    return Completed(message=said, data={"part": part})


def run_part(
    spec: JobAttempt,
    part: str,
    deadline: Deadline,
    storage_block: str,
    settings_block: str,
    signing_block: str,
    chunk_s: float | None,
) -> bool:
    """Do ``part`` of the attempt ``spec``; whether it rendered anything."""
    settings = load_settings(settings_block)
    store = load_storage(storage_block)
    ctx = pipeline_context(settings, signing_block)
    chosen = settings.apply_defaults(spec.options)
    sources = [read_from(store, k) for k in [spec.source_key, *spec.extra_source_keys]]
    plan_key = video_plan_key(spec.job_id, spec.attempt)
    sweep_workdirs()
    with (
        tempfile.TemporaryDirectory(prefix=f"{WORKDIR_PREFIX}{os.getpid()}-") as tmp,
        ExitStack() as ending,
    ):
        workdir = Path(tmp)
        chunk_len = chunk_s or settings.video_chunk_s
        job = VideoJob(store, workdir, workdir / "input", sources, chosen, ctx, chunk_len)
        ending.callback(_log_input_reads, job, part)  # failed parts too
        job.payload = payload_for(spec.job_id) if ctx.marker is not None else None
        if part == PROBE_PART:
            job.references = [read_from(store, k) for k in spec.reference_keys]
            job.probed = guarded("probe", deadline).run(probe_task, job, spec.target_key)
            spans = job.ranges()
            keys = [job.analysis_key(*span) for span in spans]
            save_plan(store, plan_key, StoredPlan(job.digest, job.probed, None, spans, keys))
            return True
        stored = load_plan(store, plan_key)
        job.digest, job.probed, job.planned = stored.digest, stored.probed, stored.planned
        ranges = {analysis_part(*span): span for span in job.ranges()}
        if part in ranges:
            if is_stored(store, job.analysis_key(*ranges[part])):  # by an earlier run
                return False
            job.read_input(spec.target_key)  # the range is read by a seek
            key = part_progress_key(spec.job_id, spec.attempt, part)
            job.progress = PartFrames(store, key, part=part)
            task = analyse_task.with_options(task_run_name=part)
            return bool(guarded("analyse", deadline).run(task, job, *ranges[part]))
        if part == PLAN_PART:
            if chosen.mapping:  # the mapping's identities read a few frames
                job.read_input(spec.target_key)
            job.planned = guarded("analyse", deadline).run(plan_task, job)
            keys = [job.chunk_key(chunk) for chunk in job.planned.chunks]
            save_plan(store, plan_key, replace(stored, planned=job.planned, chunk_keys=keys))
            return True
        if stored.planned is None:
            raise InvalidInput(detail=f"part {part!r} before the plan")
        if part == REPORT_PART:
            job.samples = Samples(stored.planned.plan, stored.probed.samples, ctx.pins)
            record = guarded("report", deadline).run(report_task, job, stored.chunk_keys)
            write_to(
                store,
                video_report_key(spec.job_id, spec.attempt),
                record.model_dump_json().encode(),
            )
            return True
        chunks = {chunk_part(c.index): c for c in stored.planned.chunks}
        if part not in chunks:
            raise InvalidInput(detail=f"no part {part!r} in the plan")
        chunk = chunks[part]
        if is_stored(store, job.chunk_key(chunk)):  # stored by an earlier run of it
            return False
        job.read_input(spec.target_key)
        counter = PartFrames(store, part_progress_key(spec.job_id, spec.attempt, part), part=part)
        job.progress = counter
        render = render_chunk_task.with_options(task_run_name=f"render-{part}")
        runner = FrameRunner(ctx)
        rendered = bool(guarded("render_chunk", deadline).run(render, job, chunk, runner))
        counter.write(dict(runner.failures))
        return rendered


def _log_input_reads(job: VideoJob, part: str) -> None:
    """Log what ``part`` fetched of an input it read in place (S3 ranged reads)."""
    reads = job.input_reads()
    if reads is not None:
        get_run_logger().info("Part %s %s", part, reads)
