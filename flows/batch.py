"""The ``fuse-batch`` flow: several job attempts in one flow run, each with its own outcome.

The relay's dispatch puts the due jobs that can share a run (same lane, detector and
fuser) into one ``fuse-batch`` run when more than one is waiting (``FuseBatchParams``);
a job alone still gets its own ``fuse-faces`` run. The stages are those of ``fuse-faces``,
one task run per stage for the whole batch, MTCNN on every job's images in batched calls:

    load → moderate_inputs → detect → align → fuse → postprocess → quality →
    moderate_result → store

(the moderation stages are left out when the settings' moderation policy turns them off,
enhance when no job of the batch chose an enhancer). One thread beside the stages computes
each job's identity reference for the quality stage while align → postprocess run, and
each result's moderation while the quality stage runs; the stage that needs it waits for
it, under its own timeout, so a job's errors still come in the order of the stages.

Every job keeps what a single run gives it:

- **its own deadline**: before each stage a job whose time left is below the stage's
  expected cost leaves the batch with ``deadline_exceeded``; each stage's timeout is
  ``min(budget * jobs, latest deadline - now)`` (the warm worker kills the run past its
  ``deadline_at``, the latest of the jobs', plus grace);
- **its own outcome**: a job that fails (no face, bad image, ...) leaves the batch at once
  and its ``JobFailure`` is written to storage (``flows.params.result_error_key``; the
  relay reads it), its batch-mates go on; a successful job gets its image and ``ResultRef``
  sidecar as in ``fuse-faces``, so a crash re-dispatches only the jobs with neither;
- **its own fencing**: results live under the job's attempt, and the relay only reads the
  attempt whose run the job currently holds;
- **cancellation**: the relay writes a stop marker (``stop_marker_key``) for a job that
  ended while its run carries other jobs; the flow skips such jobs before detection and
  before storing (a job that finished anyway has its result discarded by the relay).

The run itself ends ``Completed`` with ``{job id: outcome}``; it fails only for what no job
could survive (settings or storage block unusable), with the ``[code] message`` of the
error as ``fuse-faces`` does, after writing that failure for every job without an outcome.
A job whose parameters are not bound to it (``flows.binding``) is refused before the run
loads anything (``run_binding_invalid``); its batch-mates go on.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import datetime
from functools import partial
from typing import Any

from prefect import flow, get_run_logger
from prefect.states import State

from blocks.settings import STAGES, FusionSettings, StageName, StagePolicy, load_settings
from blocks.storage import ByteStore, exists, load_storage, write_to
from flows import faults
from flows.batch_view import BatchView, JobRow
from flows.deadline import Deadline, StageGuard
from flows.fuse import JOB_FLOW_OPTIONS, failed, pipeline_context, retry_cost_s
from flows.outcome import admit_bound, record_unsettled
from flows.params import (
    BATCH_FLOW_NAME,
    DEFAULT_SETTINGS_BLOCK,
    DEFAULT_STORAGE_BLOCK,
    JobAttempt,
    JobFailure,
    ResultRef,
    result_error_key,
    result_key,
    stop_marker_key,
)
from flows.storage_tasks import load_batch_task, store_batch_task
from tasks import pipeline
from tasks.batch import Each
from tasks.errors import DeadlineExceeded, FaceFlowError
from tasks.gpu import gpu_stats
from tasks.options import FusionOptions
from tasks.pipeline import (
    Aligned,
    Beside,
    Detections,
    Fused,
    PipelineContext,
    flagged_summaries,
    stage_workers,
)
from tasks.prefect_tasks import (
    EncodedImage,
    Reference,
    Verdicts,
    align_batch_task,
    detect_batch_task,
    enhance_batch_task,
    fuse_batch_task,
    moderate_inputs_batch_task,
    moderate_result_batch_task,
    postprocess_batch_task,
    quality_batch_task,
)
from tasks.report import QualityReport
from tasks.types import RGBImage

STOPPED = "stopped"
CHECK_STOPS_BEFORE: frozenset[StageName] = frozenset({"detect", "store"})
"""Stages before which the flow looks for stop markers: the start of the work that costs
(detection onwards) and the result's write."""


@dataclass
class _Job:
    """One job of the batch as it moves through the stages."""

    spec: JobAttempt
    options: FusionOptions
    deadline: Deadline
    row: JobRow
    failure: JobFailure | None = None
    source: RGBImage | None = None
    target: RGBImage | None = None
    detections: Detections | None = None
    aligned: Aligned | None = None
    fused: Fused | None = None
    encoded: EncodedImage | None = None
    quality: QualityReport | None = None
    moderation: list[str] = field(default_factory=list)  # what report-only moderation flagged
    reference: Reference | None = None  # started after detect
    moderated: Verdicts | None = None  # started after postprocess

    @property
    def live(self) -> bool:
        """Whether the job is still in the batch."""
        return self.row.outcome == "pending"


@dataclass
class _Batch:
    """The jobs, storage, settings and view of one batch run."""

    jobs: list[_Job]
    store: ByteStore
    storage_block: str
    settings: FusionSettings
    ctx: PipelineContext
    view: BatchView
    pool: ThreadPoolExecutor | None = None  # work beside the stages (stage_workers)
    timings_ms: dict[str, float] = field(default_factory=dict)

    def live(self) -> list[_Job]:
        """The jobs still in the batch."""
        return [job for job in self.jobs if job.live]

    def fail(self, job: _Job, error: FaceFlowError, stage: str) -> None:
        """End ``job`` with ``error`` and write its ``JobFailure`` now (so a crash later in
        the run does not re-dispatch it)."""
        job.row.outcome, job.row.stage = error.code, stage
        job.failure = JobFailure(
            code=error.code,
            message=error.public_message,
            retryable=not error.permanent,
            stage=stage,
        )
        get_run_logger().warning(
            "Job %s attempt %d failed at %s: %s", job.spec.job_id, job.spec.attempt, stage, error
        )
        try:
            key = result_error_key(job.spec.job_id, job.spec.attempt)
            write_to(self.store, key, job.failure.model_dump_json().encode())
        except FaceFlowError as exc:  # the relay then finds no outcome: result_missing
            get_run_logger().error("Job %s: outcome not stored: %s", job.spec.job_id, exc)

    def admit(self, stage: StageName, policy: StagePolicy) -> list[_Job]:
        """The jobs that go into ``stage``: not stopped by the relay, with time left."""
        live = self.live()
        if stage in CHECK_STOPS_BEFORE:
            for job in live:
                if exists(self.store, stop_marker_key(job.spec.job_id, job.spec.attempt)):
                    job.row.outcome = STOPPED
                    get_run_logger().info("Job %s stopped by the relay", job.spec.job_id)
        for job in self.live():
            left = job.deadline.left()
            if left < policy.expected_s:
                detail = f"{max(left, 0.0):.2f} s left, {stage} needs about {policy.expected_s:g} s"
                self.fail(job, DeadlineExceeded(detail=detail), stage)
        return self.live()

    @contextmanager
    def stage(self, stage: StageName, jobs: list[_Job]) -> Iterator[StageGuard]:
        """Guard and time one stage for ``jobs``: timeout ``min(budget * jobs, latest
        deadline - now)``; a stage that fails as a whole fails every job in it."""
        policy = self.settings.policy(stage)
        deadline = Deadline.of(max(job.spec.deadline_at for job in jobs))
        guard = StageGuard(deadline, replace(policy, budget_s=policy.budget_s * len(jobs)))
        self.view.stage_started(stage, len(jobs))
        for job in jobs:
            job.row.stage = stage
        start = time.perf_counter()
        try:
            faults.inject(stage)  # no-op unless FACEFLOW_ENABLE_FAULTS=true (reliability suite)
            yield guard
        except FaceFlowError as error:
            for job in jobs:
                self.fail(job, error, stage)
        finally:
            self.timings_ms[stage] = (time.perf_counter() - start) * 1000.0

    def settle(self, jobs: list[_Job], outcomes: Sequence[Each[Any]], stage: str) -> list[Any]:
        """Record each job's time in ``stage`` and fail the jobs whose outcome is an error;
        the values of the jobs that passed, in order (``None`` for the failed ones)."""
        values: list[Any] = []
        for job, outcome in zip(jobs, outcomes, strict=True):
            job.row.timings_ms[stage] = outcome.ms
            if outcome.error is not None:
                self.fail(job, outcome.error, stage)
            values.append(outcome.value)
        return values


@flow(name=BATCH_FLOW_NAME, **JOB_FLOW_OPTIONS)
def fuse_batch(
    jobs: list[JobAttempt],
    deadline_at: datetime,
    storage_block: str = DEFAULT_STORAGE_BLOCK,
    settings_block: str = DEFAULT_SETTINGS_BLOCK,
) -> dict[str, str] | State[Any]:
    """Fuse every job of the batch; returns ``{job id: outcome}`` (``succeeded``, an error
    code, or ``stopped``). Fails only when no job could be attempted."""
    logger = get_run_logger()
    logger.info(
        "Batch of %d jobs: %s", len(jobs), ", ".join(f"{j.job_id}#{j.attempt}" for j in jobs)
    )
    bound, refused = admit_bound(jobs, storage_block=storage_block, settings_block=settings_block)
    if not bound:
        return refused
    try:
        return {
            **refused,
            **_run(bound, storage_block=storage_block, settings_block=settings_block),
        }
    except Exception as exc:
        record_unsettled(bound, storage_block, exc)
        return failed(exc, f"Batch of {len(jobs)} jobs")


def _run(specs: list[JobAttempt], *, storage_block: str, settings_block: str) -> dict[str, str]:
    settings = load_settings(settings_block)
    rows = [JobRow(spec.job_id, spec.attempt) for spec in specs]
    batch = _Batch(
        jobs=[
            _Job(spec, settings.apply_defaults(spec.options), Deadline.of(spec.deadline_at), row)
            for spec, row in zip(specs, rows, strict=True)
        ],
        store=load_storage(storage_block),
        storage_block=storage_block,
        settings=settings,
        ctx=pipeline_context(settings),
        view=BatchView(rows, STAGES),
    )
    batch.view.start()
    try:
        # One thread beside the stages: each job's identity reference during align →
        # postprocess, its result's moderation during quality (as fuse-faces does).
        with stage_workers(threads=1) as batch.pool:
            for stage in STAGES:
                if not _wanted(batch, stage):
                    continue
                jobs = batch.admit(stage, settings.policy(stage))
                if not jobs:
                    break
                with batch.stage(stage, jobs) as guard:
                    STAGE_STEPS[stage](batch, jobs, guard)
    finally:
        batch.view.finish(device=batch.ctx.device, gpu=gpu_stats())
    get_run_logger().info("Batch stage timings (ms): %s", _rounded(batch.timings_ms))
    return {job.spec.job_id: job.row.outcome for job in batch.jobs}


def _rounded(timings: dict[str, float]) -> dict[str, float]:
    return {stage: round(ms, 1) for stage, ms in timings.items()}


# --------------------------------------------------------------------------- stages


def _load(batch: _Batch, jobs: list[_Job], guard: StageGuard) -> None:
    keys = [(job.spec.source_key, job.spec.target_key) for job in jobs]
    pairs = guard.run(load_batch_task, batch.storage_block, keys, batch.ctx)
    for job, pair in zip(jobs, batch.settle(jobs, pairs, "load"), strict=True):
        if pair is not None:
            job.source, job.target = pair


def _wanted(batch: _Batch, stage: StageName) -> bool:
    """Whether ``stage`` runs at all (the settings may turn moderation off, the jobs may
    choose no enhancer)."""
    if stage == "enhance":
        return any(job.options.enhancer != "none" for job in batch.live())
    if stage == "moderate_inputs":
        return batch.ctx.moderation.checks_inputs
    if stage == "moderate_result":
        return batch.ctx.moderation.checks_result
    return True


def _moderate_inputs(batch: _Batch, jobs: list[_Job], guard: StageGuard) -> None:
    inputs = [{"source": _img(job.source), "target": _img(job.target)} for job in jobs]
    verdicts = guard.run(moderate_inputs_batch_task, inputs, batch.ctx)
    for job, value in zip(jobs, batch.settle(jobs, verdicts, "moderate_inputs"), strict=True):
        if value is not None:
            job.moderation += flagged_summaries(value)


def _moderate_result(batch: _Batch, jobs: list[_Job], guard: StageGuard) -> None:
    inputs = [(_req(job.encoded).image, job.moderated) for job in jobs]
    verdicts = guard.run(moderate_result_batch_task, inputs, batch.ctx)
    for job, value in zip(jobs, batch.settle(jobs, verdicts, "moderate_result"), strict=True):
        job.moderated = None
        if value is not None:
            job.moderation += flagged_summaries(value)


def _detect(batch: _Batch, jobs: list[_Job], guard: StageGuard) -> None:
    inputs = [(_img(job.source), _img(job.target), job.options) for job in jobs]
    found = guard.run(detect_batch_task, inputs, batch.ctx)
    for job, detections in zip(jobs, batch.settle(jobs, found, "detect"), strict=True):
        job.detections = detections
        if detections is not None and batch.pool is not None:
            job.reference = Beside(
                batch.pool,
                pipeline.reference_stage,
                _img(job.source),
                _img(job.target),
                detections,
                job.options,
                batch.ctx,
            )


def _align(batch: _Batch, jobs: list[_Job], guard: StageGuard) -> None:
    inputs = [
        (_img(job.source), _img(job.target), _req(job.detections), job.options) for job in jobs
    ]
    aligned = guard.run(align_batch_task, inputs, batch.ctx)
    for job, value in zip(jobs, batch.settle(jobs, aligned, "align"), strict=True):
        job.aligned = value


def _fuse(batch: _Batch, jobs: list[_Job], guard: StageGuard) -> None:
    fused = guard.run(
        fuse_batch_task, [(_req(job.aligned), job.options) for job in jobs], batch.ctx
    )
    for job, value in zip(jobs, batch.settle(jobs, fused, "fuse"), strict=True):
        job.fused = value


def _enhance(batch: _Batch, jobs: list[_Job], guard: StageGuard) -> None:
    # Only the jobs that asked for an enhancer: the others get no "enhance" timing (their
    # result was not enhanced, and their timings say what ran for them).
    wanting = [job for job in jobs if job.options.enhancer != "none"]
    inputs = [(_img(job.target), _req(job.fused), job.options) for job in wanting]
    enhanced = guard.run(enhance_batch_task, inputs, batch.ctx)
    for job, value in zip(wanting, batch.settle(wanting, enhanced, "enhance"), strict=True):
        job.fused = value


def _postprocess(batch: _Batch, jobs: list[_Job], guard: StageGuard) -> None:
    inputs = [(_img(job.target), _req(job.fused), job.options) for job in jobs]
    encoded = guard.run(postprocess_batch_task, inputs, batch.ctx)
    for job, value in zip(jobs, batch.settle(jobs, encoded, "postprocess"), strict=True):
        job.encoded = value
        if value is not None and batch.pool is not None and _wanted(batch, "moderate_result"):
            job.moderated = Beside(
                batch.pool, pipeline.moderate_result_stage, value.image, batch.ctx
            )


def _quality(batch: _Batch, jobs: list[_Job], guard: StageGuard) -> None:
    cost = retry_cost_s(batch.settings)
    inputs = [
        (
            _img(job.source),
            _img(job.target),
            _req(job.aligned),
            _req(job.detections),
            _req(job.fused),
            _req(job.encoded),
            job.options,
            partial(_time_for_retry, job.deadline, cost),
            job.reference,
        )
        for job in jobs
    ]
    checked = guard.run(quality_batch_task, inputs, batch.ctx)
    for job, value in zip(jobs, batch.settle(jobs, checked, "quality"), strict=True):
        if value is not None:
            job.encoded, job.fused, job.options = value.encoded, value.fused, value.options
            job.quality = value.report
        job.source = job.target = None  # the pixels are no longer needed
        job.aligned = job.reference = None


def _time_for_retry(deadline: Deadline, cost_s: float) -> bool:
    return deadline.left() >= cost_s


def _store(batch: _Batch, jobs: list[_Job], guard: StageGuard) -> None:
    results = []
    for job in jobs:
        encoded, fused = _req(job.encoded), _req(job.fused)
        if job.moderation:
            get_run_logger().warning(
                "Job %s: moderation (report only) flagged %s",
                job.spec.job_id,
                "; ".join(job.moderation),
            )
        ref = ResultRef(
            key=result_key(job.spec.job_id, job.spec.attempt, job.options.output_format),
            content_type=job.options.content_type,
            width=encoded.width,
            height=encoded.height,
            faces_replaced=len(fused.crops),
            device=batch.ctx.device,
            timings_ms=dict(job.row.timings_ms),
            quality=job.quality,
            moderation=job.moderation,
        )
        job.row.result_key = ref.key
        results.append((job.spec.job_id, job.spec.attempt, ref, encoded.data))
    uris = guard.run(store_batch_task, batch.storage_block, results, batch.ctx.cpu_threads)
    for job, uri in zip(jobs, batch.settle(jobs, uris, "store"), strict=True):
        if uri is not None:
            job.row.outcome, job.row.result_uri = "succeeded", uri
        job.encoded = None


STAGE_STEPS: dict[StageName, Callable[[_Batch, list[_Job], StageGuard], None]] = {
    "load": _load,
    "moderate_inputs": _moderate_inputs,
    "detect": _detect,
    "align": _align,
    "fuse": _fuse,
    "enhance": _enhance,
    "postprocess": _postprocess,
    "quality": _quality,
    "moderate_result": _moderate_result,
    "store": _store,
}


def _img(image: RGBImage | None) -> RGBImage:
    assert image is not None, "a live job has its images"
    return image


def _req(value: Any) -> Any:
    assert value is not None, "a live job has the previous stage's output"
    return value
