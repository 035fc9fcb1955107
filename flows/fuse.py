"""The ``fuse-faces`` flow: one job attempt, load → moderate_inputs → detect → align → fuse →
enhance → postprocess → moderate_result → store.

Parameters mirror ``flows.params.FuseFacesParams``. Inputs come from, and the result
goes to, the storage block named by ``storage_block``; the flow returns the small
``ResultRef`` dict (never image bytes). The moderation stages run on the CPU and are
skipped when the settings' moderation policy turns them off, enhance when the job chose no
enhancer. Every stage is a sync task
called directly on the main thread under ``flows.deadline.StageGuard``: its timeout is
``min(stage budget, deadline_at - now)`` on every attempt and retries stop for permanent
errors or when the time left is below the stage's expected cost. A run started after its
deadline fails at once, before loading settings or models. Failures end the run in a
``Failed`` state whose message is the typed error, ``"[code] message"``, which the
webapi's relay parses.

Two pieces of work start early on a worker thread (``tasks.pipeline.stage_workers``), as
``fuse_images`` runs them: the quality stage's identity reference beside align →
postprocess, the result's moderation beside the quality stage. The stage that needs each
waits for it inside its own task, under its own timeout, so errors still come out in the
order of the stages; stage timings are wall times, so the quality and moderate_result
stages show only the part that did not overlap.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import UUID

from prefect import flow, get_run_logger
from prefect.client.orchestration import get_client
from prefect.runtime import flow_run
from prefect.states import Failed, State

from blocks.settings import STAGES, FusionSettings, StageName, load_settings
from flows import faults
from flows.artifacts import OperatorView, wait_for_operator_view
from flows.deadline import Deadline, StageGuard, alarm_timeouts_available
from flows.params import (
    DEFAULT_SETTINGS_BLOCK,
    DEFAULT_STORAGE_BLOCK,
    FLOW_NAME,
    ResultRef,
    result_key,
    run_tags,
)
from flows.storage_tasks import load_task, store_task
from tasks import pipeline
from tasks.errors import DeadlineExceeded, FaceFlowError
from tasks.gpu import gpu_stats
from tasks.options import FusionOptions
from tasks.pipeline import Beside, PipelineContext, flagged_summaries, stage_workers
from tasks.prefect_tasks import (
    align_task,
    detect_task,
    enhance_task,
    fuse_task,
    moderate_inputs_task,
    moderate_result_task,
    postprocess_task,
    quality_task,
)
from tasks.report import QualityReport


def pipeline_context(settings: FusionSettings) -> PipelineContext:
    """Where the pipeline runs, from the operator settings (imports torch)."""
    return PipelineContext.for_this_machine(
        device=None if settings.device == "auto" else settings.device,
        model_dir=settings.model_dir or None,
        pins=settings.model_pins,
        limits=settings.image_limits,
        moderation=settings.moderation,
        cpu_threads=settings.batch_cpu_threads,
        model_threads=settings.model_threads,
    )


def retry_cost_s(settings: FusionSettings) -> float:
    """Seconds a quality-floor retry must find left: fuse, postprocess and quality again,
    and the store after (expected costs)."""
    return sum(settings.policy(s).expected_s for s in ("fuse", "postprocess", "quality", "store"))


@dataclass
class _Run:
    """One attempt's deadline, settings, timings and operator view."""

    deadline: Deadline
    settings: FusionSettings
    view: OperatorView
    timings_ms: dict[str, float]

    @contextmanager
    def stage(self, name: StageName) -> Iterator[StageGuard]:
        """Guard, time and report one stage."""
        guard = StageGuard(self.deadline, self.settings.policy(name))
        self.view.stage_started(name)
        get_run_logger().info("Stage %s: %.2f s left to the deadline", name, self.deadline.left())
        start = time.perf_counter()
        ok = False
        try:
            faults.inject(name)  # no-op unless FACEFLOW_ENABLE_FAULTS=true (reliability suite)
            yield guard
            ok = True
        finally:
            ms = (time.perf_counter() - start) * 1000.0
            self.timings_ms[name] = ms
            self.view.stage_finished(name, ms, guard.failures + (1 if ok else 0), ok)

    def skip(self, name: StageName) -> None:
        """Record a stage the settings turned off."""
        self.view.stage_skipped(name)


def _tag_flow_run(job_id: str, owner_id: str) -> None:
    """Add job and owner tags to this flow run unless it has them already.

    The relay creates every run with these tags (``flows.params.run_tags``), so a
    dispatched run costs no API call here; a run started another way (a direct call, the
    UI) is tagged through the run's own client.
    """
    run_id = flow_run.get_id()
    current = set(flow_run.get_tags())
    wanted = set(run_tags(job_id, owner_id))
    if run_id is None or wanted <= current:
        return
    try:
        with get_client(sync_client=True) as client:  # the run's own client, if it has one
            client.update_flow_run(UUID(run_id), tags=sorted(current | wanted))
    except Exception as exc:  # tags help operators; a failed update must not fail the job
        get_run_logger().warning("Could not tag flow run %s: %r", run_id, exc)


JOB_FLOW_OPTIONS: dict[str, Any] = {
    "persist_result": False,  # results are images in storage; the run returns a small ref
    "retries": 0,  # a failed attempt is re-dispatched by the relay, under the same deadline
    "validate_parameters": True,
    "log_prints": False,
    "on_completion": [wait_for_operator_view],
    "on_failure": [wait_for_operator_view],
}
"""``@flow`` options shared by the job flows (``fuse-faces`` and ``fuse-batch``)."""


def failed(exc: Exception, what: str) -> State[Any]:
    """The ``Failed`` state a job flow ends in for ``exc`` (logged): its typed error's
    ``[code] message``, or ``internal_error`` for anything unexpected."""
    logger = get_run_logger()
    if isinstance(exc, FaceFlowError):
        logger.error("%s failed: %s", what, exc)
        return Failed(message=str(exc), data=exc)
    logger.error("%s failed unexpectedly", what, exc_info=exc)
    internal = FaceFlowError(detail=type(exc).__name__)
    return Failed(message=str(internal), data=internal)


@flow(name=FLOW_NAME, flow_run_name="{job_id}", **JOB_FLOW_OPTIONS)
def fuse_faces(
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
) -> dict[str, Any] | State[Any]:
    """Fuse the source face into the target photo for one job attempt.

    Returns ``ResultRef.model_dump(mode="json")``; on failure the run ends ``Failed`` with
    the message ``"[code] message"`` of the typed error.
    """
    logger = get_run_logger()
    deadline = Deadline.of(deadline_at)
    if deadline.passed():
        late = DeadlineExceeded(detail=f"started {-deadline.left():.1f} s after the deadline")
        logger.error("%s", late)
        return Failed(message=str(late), data=late)
    if not alarm_timeouts_available():
        logger.warning(
            "Stage timeouts cannot interrupt blocking calls here (not the main thread, or "
            "another SIGALRM handler is installed): a stuck stage may overrun the deadline."
        )
    try:
        _tag_flow_run(job_id, owner_id)
        return _fuse(
            job_id=job_id,
            source_key=source_key,
            target_key=target_key,
            extra_source_keys=extra_source_keys or [],
            reference_keys=reference_keys or [],
            deadline=deadline,
            options=options or FusionOptions.model_validate({}),
            attempt=attempt,
            storage_block=storage_block,
            settings_block=settings_block,
        )
    except Exception as exc:
        return failed(exc, f"Job {job_id} attempt {attempt}")


def _fuse(
    *,
    job_id: str,
    source_key: str,
    target_key: str,
    extra_source_keys: list[str],
    reference_keys: list[str],
    deadline: Deadline,
    options: FusionOptions,
    attempt: int,
    storage_block: str,
    settings_block: str,
) -> dict[str, Any]:
    settings = load_settings(settings_block)
    options = settings.apply_defaults(options)
    view = OperatorView(job_id, attempt, STAGES)
    view.start()
    run = _Run(deadline, settings, view, {})
    ctx = PipelineContext(device="cpu")
    faces: dict[str, int] = {}
    outcome = "failed"
    ref: ResultRef | None = None
    report: QualityReport | None = None
    uri: str | None = None
    try:
        ctx = pipeline_context(settings)
        with run.stage("load") as guard:
            keys = [source_key, target_key, *extra_source_keys, *reference_keys]
            source, target, *more = guard.run(load_task, storage_block, keys, ctx)
        extra_sources, references = more[: len(extra_source_keys)], more[len(extra_source_keys) :]
        flags: list[str] = []
        if ctx.moderation.checks_inputs:
            with run.stage("moderate_inputs") as guard:
                inputs = {
                    "source": source,
                    "target": target,
                    **{f"source {i + 1}": image for i, image in enumerate(extra_sources)},
                    **{f"reference {i}": image for i, image in enumerate(references)},
                }
                flags += flagged_summaries(guard.run(moderate_inputs_task, inputs, ctx))
        else:
            run.skip("moderate_inputs")
        with run.stage("detect") as guard:
            detections = guard.run(
                detect_task,
                source,
                target,
                options,
                ctx,
                extra_sources=extra_sources,
                references=references,
            )
        faces = {
            "source": detections.source_count,
            "target": detections.target_count,
            "replaced": len(detections.target_faces),
        }
        # Beside the stages that do not need them, on a worker thread (as fuse_images does):
        # the identity reference during align → postprocess, the result's moderation during
        # the quality stage. Each is taken in the stage that needs it, under its guard.
        with stage_workers() as pool:
            reference = Beside(
                pool, pipeline.reference_stage, source, target, detections, options, ctx
            )
            with run.stage("align") as guard:
                aligned = guard.run(align_task, source, target, detections, options, ctx)
            with run.stage("fuse") as guard:
                fused = guard.run(fuse_task, aligned, options, ctx)
            if options.enhancer != "none":
                with run.stage("enhance") as guard:
                    fused = guard.run(enhance_task, target, fused, options, ctx)
            else:
                run.skip("enhance")
            with run.stage("postprocess") as guard:
                encoded = guard.run(postprocess_task, target, fused, options, ctx)
            moderated = (
                Beside(pool, pipeline.moderate_result_stage, encoded.image, ctx)
                if ctx.moderation.checks_result
                else None
            )
            with run.stage("quality") as guard:  # FaceLost: a faceless result is never returned
                checked = guard.run(
                    quality_task,
                    source,
                    target,
                    aligned,
                    detections,
                    fused,
                    encoded,
                    options,
                    ctx,
                    may_retry=lambda: deadline.left() >= retry_cost_s(settings),
                    reference=reference,
                )
            fused, encoded, options, report = (
                checked.fused,
                checked.encoded,
                checked.options,
                checked.report,
            )
            if moderated is not None:  # a quality-floor retry that won is checked here
                with run.stage("moderate_result") as guard:
                    verdicts = guard.run(moderate_result_task, encoded.image, ctx, moderated)
                flags += flagged_summaries(verdicts)
            else:
                run.skip("moderate_result")
        if flags:
            get_run_logger().warning("Moderation (report only) flagged %s", "; ".join(flags))
        ref = ResultRef(
            key=result_key(job_id, attempt, options.output_format),
            content_type=options.content_type,
            width=encoded.width,
            height=encoded.height,
            faces_replaced=len(fused.crops),
            device=ctx.device,
            timings_ms=dict(run.timings_ms),
            quality=report,
            moderation=flags,
        )
        with run.stage("store") as guard:
            uri = guard.run(store_task, storage_block, job_id, attempt, ref, encoded.data)
        outcome = "succeeded"
    except FaceFlowError as error:
        outcome = error.code
        raise
    finally:
        view.finish(
            outcome=outcome,
            device=ctx.device,
            gpu=gpu_stats(),
            faces=faces,
            result_key=ref.key if ref is not None and outcome == "succeeded" else None,
            result_uri=uri,
            quality=report,
        )
    logging.getLogger("faceflow.flows.fuse").debug("timings %s", run.timings_ms)
    return ref.model_dump(mode="json")
