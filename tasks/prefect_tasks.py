"""The pipeline stages as Prefect tasks: thin wrappers over ``tasks.pipeline``.

Images travel between tasks in-process: results are never persisted
(``persist_result=False``) nor cached (``NO_CACHE``), so no pixel ever becomes a Prefect
result. Timeouts and retries are set per call by ``flows.deadline.StageGuard``; these
definitions carry none. Each task resolves its stage function at call time, so one
implementation serves the flow, the CLI and the benchmark.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks import pipeline
from tasks.batch import Each, each, shared
from tasks.moderation import ModerationVerdict
from tasks.options import FusionOptions
from tasks.pipeline import Aligned, Beside, Detections, Fused, PipelineContext
from tasks.quality import IdentityReference
from tasks.report import QualityReport
from tasks.types import RGBImage

Verdicts = Beside[tuple[ModerationVerdict, ...]]
"""A result's moderation, started beside the quality stage."""
Reference = Beside[IdentityReference]
"""A job's identity reference for the quality stage, started beside align → postprocess."""


@dataclass(frozen=True, slots=True)
class EncodedImage:
    """The encoded result image, its size and its pixels (for the result's checks)."""

    data: bytes
    width: int
    height: int
    image: RGBImage | None = None  # the decoded pixels, for the quality stage


@task(
    name="moderate_inputs",
    task_run_name="moderate_inputs",
    persist_result=False,
    cache_policy=NO_CACHE,
)
def moderate_inputs_task(
    images: Mapping[str, RGBImage], ctx: PipelineContext
) -> tuple[ModerationVerdict, ...]:
    """NSFW check of the inputs on the CPU (``ContentBlocked`` when enforced and flagged),
    ``ctx.model_threads`` images at once."""
    return pipeline.moderate_inputs_stage(images, ctx, calls=ctx.model_threads)


@task(
    name="moderate_result",
    task_run_name="moderate_result",
    persist_result=False,
    cache_policy=NO_CACHE,
)
def moderate_result_task(
    image: RGBImage, ctx: PipelineContext, ahead: Verdicts | None = None
) -> tuple[ModerationVerdict, ...]:
    """NSFW check of the result image (``ContentBlocked`` when enforced and flagged);
    ``ahead``: the check started beside the quality stage (used if it checked ``image``)."""
    if ahead is not None:
        return ahead.take(image, ctx)
    return pipeline.moderate_result_stage(image, ctx)


@task(name="detect", task_run_name="detect", persist_result=False, cache_policy=NO_CACHE)
def detect_task(
    source: RGBImage,
    target: RGBImage,
    options: FusionOptions,
    ctx: PipelineContext,
    extra_sources: list[RGBImage] | None = None,
    references: list[RGBImage] | None = None,
) -> Detections:
    """The source face and the target faces to replace (``NoFaceFound`` when missing);
    with a per-face mapping, each target face's own source."""
    return pipeline.detect_stage(
        source,
        target,
        options,
        ctx,
        extra_sources=extra_sources or (),
        references=references or (),
    )


@task(name="align", task_run_name="align", persist_result=False, cache_policy=NO_CACHE)
def align_task(
    source: RGBImage,
    target: RGBImage,
    detections: Detections,
    options: FusionOptions,
    ctx: PipelineContext,
) -> Aligned:
    """Warp the faces to the fuser's template."""
    return pipeline.align_stage(source, target, detections, options, ctx)


@task(name="fuse", task_run_name="fuse", persist_result=False, cache_policy=NO_CACHE)
def fuse_task(aligned: Aligned, options: FusionOptions, ctx: PipelineContext) -> Fused:
    """One fused crop per target face."""
    return pipeline.fuse_stage(aligned, options, ctx)


@task(name="enhance", task_run_name="enhance", persist_result=False, cache_policy=NO_CACHE)
def enhance_task(
    target: RGBImage, fused: Fused, options: FusionOptions, ctx: PipelineContext
) -> Fused:
    """Restore the fused faces with the chosen enhancer."""
    return pipeline.enhance_stage(target, fused, options, ctx)


@task(name="postprocess", task_run_name="postprocess", persist_result=False, cache_policy=NO_CACHE)
def postprocess_task(
    target: RGBImage, fused: Fused, options: FusionOptions, ctx: PipelineContext
) -> EncodedImage:
    """Blend the fused faces into the target and encode the result."""
    image = pipeline.postprocess_stage(target, fused, options, ctx)
    data = pipeline.encode_stage(image, options)
    return EncodedImage(
        data=data, width=int(image.shape[1]), height=int(image.shape[0]), image=image
    )


@dataclass(frozen=True, slots=True)
class CheckedImage:
    """The result that passed the quality stage, encoded, with its crops and report."""

    encoded: EncodedImage
    fused: Fused
    options: FusionOptions
    report: QualityReport


def check_result(
    source: RGBImage,
    target: RGBImage,
    aligned: Aligned,
    detections: Detections,
    fused: Fused,
    encoded: EncodedImage,
    options: FusionOptions,
    ctx: PipelineContext,
    may_retry: Callable[[], bool],
    reference: Reference | None = None,
) -> CheckedImage:
    """``pipeline.checked_stage`` on an encoded result (re-encoded if the retry won);
    ``reference``: the job's ``reference_stage``, started beside align → postprocess."""
    assert encoded.image is not None, "postprocess keeps the pixels for the quality stage"
    checked = pipeline.checked_stage(
        source, target, aligned, detections, fused, encoded.image, options, ctx,
        may_retry=may_retry, reference=reference.take() if reference is not None else None,
    )  # fmt: skip
    if checked.image is not encoded.image:
        encoded = EncodedImage(
            data=pipeline.encode_stage(checked.image, checked.options),
            width=encoded.width,
            height=encoded.height,
            image=checked.image,
        )
    return CheckedImage(encoded, checked.fused, checked.options, checked.report)


@task(name="quality", task_run_name="quality", persist_result=False, cache_policy=NO_CACHE)
def quality_task(
    source: RGBImage,
    target: RGBImage,
    aligned: Aligned,
    detections: Detections,
    fused: Fused,
    encoded: EncodedImage,
    options: FusionOptions,
    ctx: PipelineContext,
    may_retry: Callable[[], bool],
    reference: Reference | None = None,
) -> CheckedImage:
    """The result's quality report (faces re-detected, identity, pose), the quality-floor
    retry when one is due and ``may_retry()``; ``FaceLost`` if a face is missing."""
    return check_result(
        source, target, aligned, detections, fused, encoded, options, ctx, may_retry, reference
    )


# --------------------------------------------------------------------------- batches
# One task run per stage for a whole ``fuse-batch`` run; per job, an ``Each`` with its
# value or the error that ended it (``tasks.batch``): one job's failure is not the batch's.


@task(name="detect-batch", task_run_name="detect", persist_result=False, cache_policy=NO_CACHE)
def detect_batch_task(
    jobs: list[tuple[RGBImage, RGBImage, FusionOptions]], ctx: PipelineContext
) -> list[Each[Detections]]:
    """``detect_task`` of every job, the images of each detector in one batch."""
    start = time.perf_counter()
    found = pipeline.detect_stage_batch(jobs, ctx)
    return shared(found, (time.perf_counter() - start) * 1e3)


@task(name="align-batch", task_run_name="align", persist_result=False, cache_policy=NO_CACHE)
def align_batch_task(
    jobs: list[tuple[RGBImage, RGBImage, Detections, FusionOptions]], ctx: PipelineContext
) -> list[Each[Aligned]]:
    """``align_task`` of every job."""
    return each(lambda job: pipeline.align_stage(*job, ctx), jobs)


@task(name="fuse-batch", task_run_name="fuse", persist_result=False, cache_policy=NO_CACHE)
def fuse_batch_task(
    jobs: list[tuple[Aligned, FusionOptions]], ctx: PipelineContext
) -> list[Each[Fused]]:
    """``fuse_task`` of every job."""
    return each(lambda job: pipeline.fuse_stage(*job, ctx), jobs)


@task(
    name="moderate_inputs-batch",
    task_run_name="moderate_inputs",
    persist_result=False,
    cache_policy=NO_CACHE,
)
def moderate_inputs_batch_task(
    jobs: list[Mapping[str, RGBImage]], ctx: PipelineContext
) -> list[Each[tuple[ModerationVerdict, ...]]]:
    """``moderate_inputs_task`` of every job (a blocked job fails alone; ``ctx.model_threads``
    at once)."""
    return each(
        lambda images: pipeline.moderate_inputs_stage(images, ctx), jobs, threads=ctx.model_threads
    )


@task(
    name="moderate_result-batch",
    task_run_name="moderate_result",
    persist_result=False,
    cache_policy=NO_CACHE,
)
def moderate_result_batch_task(
    jobs: list[tuple[RGBImage, Verdicts | None]], ctx: PipelineContext
) -> list[Each[tuple[ModerationVerdict, ...]]]:
    """``moderate_result_task`` of every job."""
    return each(lambda job: moderate_result_task.fn(job[0], ctx, job[1]), jobs)


@task(name="enhance-batch", task_run_name="enhance", persist_result=False, cache_policy=NO_CACHE)
def enhance_batch_task(
    jobs: list[tuple[RGBImage, Fused, FusionOptions]], ctx: PipelineContext
) -> list[Each[Fused]]:
    """``enhance_task`` of every job (a job without an enhancer passes unchanged)."""
    return each(lambda job: pipeline.enhance_stage(*job, ctx), jobs)


@task(
    name="postprocess-batch",
    task_run_name="postprocess",
    persist_result=False,
    cache_policy=NO_CACHE,
)
def postprocess_batch_task(
    jobs: list[tuple[RGBImage, Fused, FusionOptions]], ctx: PipelineContext
) -> list[Each[EncodedImage]]:
    """``postprocess_task`` of every job."""
    return each(lambda job: postprocess_task.fn(*job, ctx), jobs, threads=ctx.cpu_threads)


@task(name="quality-batch", task_run_name="quality", persist_result=False, cache_policy=NO_CACHE)
def quality_batch_task(
    jobs: list[
        tuple[
            RGBImage,
            RGBImage,
            Aligned,
            Detections,
            Fused,
            EncodedImage,
            FusionOptions,
            Callable[[], bool],
            Reference | None,
        ]
    ],
    ctx: PipelineContext,
) -> list[Each[CheckedImage]]:
    """``quality_task`` of every job (``ctx.model_threads`` at once)."""
    return each(
        lambda job: check_result(*job[:7], ctx, job[7], job[8]), jobs, threads=ctx.model_threads
    )
