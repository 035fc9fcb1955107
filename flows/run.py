"""The flows' driver of the pipeline: job attempts through ``tasks.stages.PIPELINE``, each
stage inline or as a Prefect task run (``FusionSettings.stage_task_runs``), each job with
its own deadline, outcome and fencing.

``fuse-faces`` runs one job with it, ``fuse-batch`` several; both get, per job:

- **its own deadline**: before each stage a job whose time left is below the stage's
  expected cost leaves with ``deadline_exceeded``; each stage's timeout is
  ``min(budget * jobs, latest deadline - now)`` on every attempt, and its retries stop for
  permanent errors or when the time left is below the expected cost (``StageGuard``);
- **its own outcome**: a job that fails leaves at once and its ``JobFailure`` is written to
  storage (``flows.params.result_error_key``; the relay reads it), the others go on; a
  successful job gets its image and ``ResultRef`` sidecar, so a crash re-dispatches only
  the jobs with neither;
- **its own fencing**: results live under the job's attempt;
- **cancellation**: before the stages marked ``stop_point`` the driver looks for the
  relay's stop marker of each job (``stop_marker_key``) and drops the stopped ones.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Protocol

from prefect import get_run_logger

from blocks.settings import FusionSettings, StagePolicy, load_settings
from blocks.storage import ByteStore, exists, load_storage, location_of, read_from, write_to
from flows import faults
from flows.attempt import result_marker
from flows.deadline import Deadline, StageGuard
from flows.outcome import write_failure
from flows.params import (
    DEFAULT_SIGNING_BLOCK,
    JobAttempt,
    JobFailure,
    ResultRef,
    result_key,
    result_meta_key,
    stop_marker_key,
)
from tasks import stages
from tasks.batch import Each, EveryJobFailed
from tasks.errors import DeadlineExceeded, FaceFlowError, drop_frames
from tasks.gpu import GpuStats, gpu_stats
from tasks.pipeline import PipelineContext
from tasks.prefect_tasks import stage_call, stage_task
from tasks.stages import (
    QUALITY_RETRY_STAGES,
    InputBytes,
    Stage,
    Work,
    run_stages,
)

STOPPED = "stopped"
PENDING = "pending"


def pipeline_context(settings: FusionSettings, signing_block: str | None = None) -> PipelineContext:
    """Where the pipeline runs, from the operator settings (imports torch); with marking
    required, results are marked with the credentials of ``signing_block``
    (``MarkingFailed`` when it cannot be loaded: no job starts that could not end marked)."""
    ctx = PipelineContext.for_this_machine(
        device=None if settings.device == "auto" else settings.device,
        model_dir=settings.model_dir or None,
        pins=settings.model_pins,
        limits=settings.image_limits,
        moderation=settings.moderation,
        cpu_threads=settings.batch_cpu_threads,
        model_threads=settings.model_threads,
    )
    marker = result_marker(settings, signing_block)
    return ctx if marker is None else replace(ctx, marker=marker)


def retry_cost_s(settings: FusionSettings) -> float:
    """Seconds a quality-floor retry must find left: the expected costs of what it runs
    again (fuse, postprocess, quality) and of the store after."""
    return sum(settings.policy(s).expected_s for s in QUALITY_RETRY_STAGES)


def _time_for_retry(deadline: Deadline, cost_s: float) -> bool:
    return deadline.left() >= cost_s


@dataclass
class Job:
    """One job attempt of a run: its parameters, deadline, work and outcome."""

    spec: JobAttempt
    deadline: Deadline
    work: Work
    io: StoredJob
    outcome: str = PENDING
    stage: str = "queued"
    failure: JobFailure | None = None

    @property
    def ref(self) -> ResultRef | None:
        """The stored result's ``ResultRef`` (None until stored)."""
        return self.io.ref


class View(Protocol):
    """What an operator sees of a run in the Prefect UI (``flows.artifacts``)."""

    def start(self) -> None: ...

    def stage_started(self, stage: str, live: int) -> None: ...

    def stage_finished(self, stage: str, ms: float, attempts: int, ok: bool) -> None: ...

    def stage_skipped(self, stage: str) -> None: ...

    def finish(self, jobs: list[Job], *, device: str, gpu: GpuStats) -> None: ...


@dataclass
class StoredJob:
    """A job's inputs and result in the storage block (``JobIO``)."""

    store: ByteStore
    spec: JobAttempt
    device: str
    ref: ResultRef | None = None

    def read(self) -> InputBytes:
        """The job's input bytes from storage."""
        spec = self.spec
        return InputBytes(
            read_from(self.store, spec.source_key),
            read_from(self.store, spec.target_key),
            tuple(read_from(self.store, key) for key in spec.extra_source_keys),
            tuple(read_from(self.store, key) for key in spec.reference_keys),
        )

    def write(self, work: Work) -> str:
        """The result image, then its ``ResultRef`` sidecar (last, so its presence means
        the image is complete); the image's URI."""
        assert work.image is not None and work.fused is not None and work.encoded is not None
        ref = ResultRef(
            key=result_key(self.spec.job_id, self.spec.attempt, work.options.output_format),
            content_type=work.options.content_type,
            width=int(work.image.shape[1]),
            height=int(work.image.shape[0]),
            faces_replaced=len(work.fused.crops),
            device=self.device,
            timings_ms=dict(work.timings_ms),
            quality=work.report,
            moderation=list(work.flags),
            marks=list(work.marks),
        )
        if work.flags:
            get_run_logger().warning(
                "Job %s: moderation (report only) flagged %s",
                self.spec.job_id,
                "; ".join(work.flags),
            )
        write_to(self.store, ref.key, work.encoded)
        write_to(
            self.store,
            result_meta_key(self.spec.job_id, self.spec.attempt),
            ref.model_dump_json().encode(),
        )
        self.ref = ref
        return location_of(self.store, ref.key)


@dataclass
class FlowRunner:
    """Runs each stage under the jobs' deadlines, as its Prefect task or inline
    (``tasks.stages.Runner``)."""

    jobs: list[Job]
    store: ByteStore
    settings: FusionSettings
    ctx: PipelineContext
    view: View
    task_runs: bool = True
    """Each stage as a Prefect task run (``StageGuard.run``), else inline (``.call``)."""
    timings_ms: dict[str, float] = field(default_factory=dict)

    def _job(self, work: Work) -> Job:
        return next(job for job in self.jobs if job.work is work)

    def admit(self, stage: Stage, works: list[Work]) -> list[Work]:
        """The jobs not stopped by the relay and with time left for ``stage``."""
        policy = self.settings.policy(stage.name)
        admitted = []
        for work in works:
            job = self._job(work)
            if stage.stop_point and exists(
                self.store, stop_marker_key(job.spec.job_id, job.spec.attempt)
            ):
                job.outcome = STOPPED
                work.error = FaceFlowError(detail="stopped by the relay")
                get_run_logger().info("Job %s stopped by the relay", job.spec.job_id)
                continue
            left = job.deadline.left()
            if left < policy.expected_s:
                detail = (
                    f"{max(left, 0.0):.2f} s left, {stage.name} needs about "
                    f"{policy.expected_s:g} s to start"
                )
                work.error = DeadlineExceeded(detail=detail)
                self.failed(work, work.error, stage)
                continue
            admitted.append(work)
        return admitted

    def run(self, stage: Stage, works: list[Work]) -> list[Each[None]]:
        """``stage``'s task for ``works``, timeout ``min(budget * jobs, latest deadline -
        now)``; a stage that fails as a whole fails every job in it."""
        guard = self._guard(self.settings.policy(stage.name), works)
        self.view.stage_started(stage.name, len(works))
        logger = get_run_logger()
        if self.task_runs:
            logger.info(
                "Stage %s (%d job(s)): %.2f s left to the deadline",
                stage.name,
                len(works),
                guard.deadline.left(),
            )
        for work in works:
            self._job(work).stage = stage.name
        start = time.perf_counter()
        ok = False
        try:
            faults.inject(stage.name)  # no-op unless FACEFLOW_ENABLE_FAULTS=true
            if self.task_runs:
                outcomes = guard.run(stage_task(stage), works, self.ctx)
            else:
                outcomes = guard.call(stage_call(stage), works, self.ctx, logger=logger)
            ok = True
            return outcomes
        except EveryJobFailed as failure:  # each job's own error; its frames hold the jobs
            return drop_frames(failure).outcomes
        except FaceFlowError as error:
            ms = (time.perf_counter() - start) * 1000.0 / len(works)
            return [Each(None, error, ms)] * len(works)
        finally:
            ms = (time.perf_counter() - start) * 1000.0
            self.timings_ms[stage.name] = ms
            self.view.stage_finished(stage.name, ms, guard.attempts, ok)

    def _guard(self, policy: StagePolicy, works: list[Work]) -> StageGuard:
        deadline = Deadline.of(max(self._job(w).spec.deadline_at for w in works))
        return StageGuard(deadline, replace(policy, budget_s=policy.budget_s * len(works)))

    def skip(self, stage: Stage) -> None:
        """Record a stage that concerns none of the live jobs."""
        self.view.stage_skipped(stage.name)

    def failed(self, work: Work, error: FaceFlowError, stage: Stage) -> None:
        """End the job with ``error`` and write its ``JobFailure`` now (so a crash later in
        the run does not re-dispatch it)."""
        job = self._job(work)
        job.outcome, job.stage = error.code, stage.name
        job.failure = write_failure(
            self.store, job.spec.job_id, job.spec.attempt, error, stage.name
        )


def run_jobs(
    specs: list[JobAttempt],
    *,
    storage_block: str,
    settings_block: str,
    view: Callable[[Sequence[str]], View],
    signing_block: str = DEFAULT_SIGNING_BLOCK,
    batch: bool = False,
) -> list[Job]:
    """Every stage for ``specs`` (one job, or a batch when ``batch``); the jobs with their
    outcomes. Each stage is a Prefect task run or runs inline, as the settings'
    ``stage_task_runs`` says for a run of this kind.

    ``view(stages)`` builds the run's operator view. Raises only for what no job could
    survive (the settings, storage or, with marking required, signing block unusable)."""
    settings = load_settings(settings_block)
    store = load_storage(storage_block)
    ctx = pipeline_context(settings, signing_block)
    cost = retry_cost_s(settings)
    jobs = []
    for spec in specs:
        deadline = Deadline.of(spec.deadline_at)
        io = StoredJob(store, spec, ctx.device)
        work = Work(
            io,
            settings.apply_defaults(spec.options),
            job_id=spec.job_id,
            may_retry=partial(_time_for_retry, deadline, cost),
        )
        jobs.append(Job(spec, deadline, work, io))
    runner = FlowRunner(
        jobs,
        store,
        settings,
        ctx,
        view([s.name for s in stages.PIPELINE]),
        task_runs=settings.stage_task_runs_for(batch=batch),
    )
    runner.view.start()
    try:
        run_stages([job.work for job in jobs], ctx, runner)
        for job in jobs:
            if job.work.error is None and job.work.location is not None:
                job.outcome = "succeeded"
    finally:
        runner.view.finish(jobs, device=ctx.device, gpu=gpu_stats())
    get_run_logger().info(
        "Stage timings (ms): %s", {s: round(ms, 1) for s, ms in runner.timings_ms.items()}
    )
    return jobs
