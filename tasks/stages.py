"""The pipeline, defined once: an ordered table of stages and the per-job ``Work`` they move.

Every way FaceFlow runs the pipeline is a driver of ``PIPELINE``: ``fuse_images`` (this
module: one job in-process, for the CLI, benches and tests), and the ``fuse-faces`` and
``fuse-batch`` flows (``flows.run``: one job, or several, as Prefect tasks under the job's
deadline). A stage's ``step`` takes the jobs still live and returns one outcome per job
(``tasks.batch.Each``): a job that fails leaves, its batch-mates go on. Budgets, expected
costs and retries are the table's defaults, which the settings block may override
(``blocks.settings.FusionSettings``).

Work that a stage's output lets start early runs on a side thread (``Side``, started when
the stage ends, taken by a later stage: ``tasks.pipeline.Beside``), so errors still come
out in the order of the stages. Adding a stage is one ``Stage`` entry here, its name in
``tasks.stage_names.StageName`` and one step function (docs/architecture.md shows how).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from tasks import pipeline
from tasks.batch import Each, each, shared
from tasks.errors import FaceFlowError, OverBatchBudget, as_job_error, drop_frames
from tasks.images import probe_image
from tasks.options import FusionOptions
from tasks.pipeline import Aligned, Beside, Detections, Fused, PipelineContext, stage_workers
from tasks.provenance import Ingredient, input_ingredients
from tasks.report import QualityReport
from tasks.stage_names import STAGE_NAMES, StageName
from tasks.types import FusionResult, RGBImage

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class InputBytes:
    """A job's input images as bytes: the source, the target, more sources and the
    references a per-face mapping names."""

    source: bytes
    target: bytes
    extra_sources: tuple[bytes, ...] = ()
    references: tuple[bytes, ...] = ()


class JobIO(Protocol):
    """Where a job's inputs come from and its result goes: memory (``fuse_images``) or
    the storage block (the flows)."""

    def read(self) -> InputBytes:
        """The job's input bytes."""
        ...

    def write(self, work: Work) -> str | None:
        """Store the job's finished result; its location (None: kept in memory)."""
        ...


@dataclass
class Work:
    """One job as it moves through the stages: what each stage produced for it, its
    per-stage times and, once it left the pipeline, its error."""

    io: JobIO
    options: FusionOptions
    job_id: str = ""
    """The job's id: the payload of its result's watermark."""
    may_retry: Callable[[], bool] = lambda: True
    """Whether a quality-floor retry still fits (the flows ask the job's deadline)."""
    source: RGBImage | None = None
    target: RGBImage | None = None
    extra_sources: list[RGBImage] = field(default_factory=list)
    references: list[RGBImage] = field(default_factory=list)
    detections: Detections | None = None
    aligned: Aligned | None = None
    fused: Fused | None = None
    image: RGBImage | None = None  # the blended result
    encoded: bytes | None = None
    report: QualityReport | None = None
    flags: list[str] = field(default_factory=list)  # what report-only moderation flagged
    side: dict[str, Beside[Any]] = field(default_factory=dict)
    timings_ms: dict[str, float] = field(default_factory=dict)
    error: FaceFlowError | None = None
    location: str | None = None  # where ``store`` put the result
    ingredients: list[Ingredient] = field(default_factory=list)  # inputs' roles and hashes
    marks: list[str] = field(default_factory=list)  # how ``store`` marked the result

    def inputs(self) -> dict[str, RGBImage]:
        """The input images by role, as moderation reports them."""
        return {
            "source": _got(self.source),
            "target": _got(self.target),
            **{f"source {i + 1}": image for i, image in enumerate(self.extra_sources)},
            **{f"reference {i}": image for i, image in enumerate(self.references)},
        }

    def release_inputs(self) -> None:
        """Drop what only the stages up to quality need (the result keeps its pixels)."""
        self.source = self.target = self.aligned = None
        self.extra_sources, self.references = [], []
        self.side.pop("reference", None)


Step = Callable[[list[Work], PipelineContext], list[Each[None]]]
"""A stage's work for the live jobs: one outcome per job, in order; it sets the job's
fields only when the job passes (so a retried stage starts from the same inputs)."""


@dataclass(frozen=True, slots=True)
class Side:
    """Work a stage's output lets start on a side thread, taken by ``taken_in``."""

    name: str
    taken_in: StageName
    start: Callable[[Work, PipelineContext], tuple[Callable[..., Any], tuple[Any, ...]]]
    """The function and arguments to run (looked up when it starts)."""


@dataclass(frozen=True, slots=True)
class Stage:
    """One stage of the pipeline: its step, the work it lets run beside the stages after
    it, its default time budget, expected cost and retries, and whom it concerns."""

    name: StageName
    step: Step
    budget_s: float
    """Longest time one attempt may take (per job in a batch run)."""
    expected_s: float
    """Typical duration: no attempt starts with less time left."""
    retries: int
    """Retries of a transient failure of the whole stage."""
    sides: tuple[Side, ...] = ()
    """Work the stage's output lets start beside the stages after it (each taken by a
    later stage)."""
    applies: Callable[[Work, PipelineContext], bool] = lambda work, ctx: True
    """Whether the stage runs for a job (moderation by the policy, enhance by the job)."""
    stop_point: bool = False
    """A point where the flows look for the relay's stop markers before the stage."""
    frames: bool = False
    """Whether the stage also runs for each frame of a video (its render pass, on faces
    the video's face plan gives)."""
    calls: tuple[str, ...] = ()
    """The ``tasks.pipeline`` functions that hold the stage's compute (the GPU-shaped
    bench replaces them by fixed sleeps)."""


# --------------------------------------------------------------------------- steps


def load_step(works: list[Work], ctx: PipelineContext) -> list[Each[None]]:
    """Read each job's inputs and decode them (bounded by ``ctx.limits``), on
    ``cpu_threads``. Before any pixel is decoded, from the headers: a job's images together
    must fit ``max_job_pixels`` (``JobTooLarge``), and the run decodes at most
    ``max_batch_pixels`` in the jobs' order (the first always fits): the relay plans batches
    within it, so a job past it (a relay with a larger budget than this worker's) ends with
    ``OverBatchBudget``, transient: the relay sends it again in another run."""
    read = each(lambda work: _read_job(work, ctx), works, threads=ctx.cpu_threads)
    fits = within_budget(
        [r.value[1] if r.value is not None else None for r in read], ctx.limits.max_batch_pixels
    )
    admitted = [
        (work, r.value[0], r.value[2])
        for work, r, ok in zip(works, read, fits, strict=True)
        if ok and r.value is not None
    ]

    def decode(item: tuple[Work, InputBytes, list[Ingredient]]) -> None:
        work, data, ingredients = item
        decode_one = pipeline.decode_stage
        source, target = decode_one(data.source, ctx), decode_one(data.target, ctx)
        extra = [decode_one(d, ctx) for d in data.extra_sources]
        references = [decode_one(d, ctx) for d in data.references]
        work.source, work.target, work.extra_sources, work.references = (
            source,
            target,
            extra,
            references,
        )
        work.ingredients = ingredients

    decoded = iter(each(decode, admitted, threads=ctx.cpu_threads))
    outcomes: list[Each[None]] = []
    for r, ok in zip(read, fits, strict=True):
        if r.value is None:
            outcomes.append(Each(None, r.error, r.ms))
        elif not ok:
            detail = f"{r.value[1]} pixels past {ctx.limits.max_batch_pixels} in the run"
            outcomes.append(Each(None, OverBatchBudget(detail=detail), r.ms))
        else:
            done = next(decoded)
            outcomes.append(Each(None, done.error, r.ms + done.ms))
    return outcomes


def _read_job(work: Work, ctx: PipelineContext) -> tuple[InputBytes, int, list[Ingredient]]:
    """A job's encoded inputs, the pixels they decode to together (checked against
    ``max_job_pixels`` from the headers) and the inputs as a manifest's ingredients (their
    roles and SHA-256)."""
    data = work.io.read()
    encoded = [data.source, data.target, *data.extra_sources, *data.references]
    pixels = sum(probe_image(one, ctx.limits).pixels for one in encoded)
    ctx.limits.check_job_pixels(pixels)
    sources = [data.source, *data.extra_sources]
    return data, pixels, input_ingredients(sources, data.target, data.references)


def within_budget(pixels: Sequence[int | None], budget: int) -> list[bool]:
    """Which jobs (their pixels; None for a job already ended) a run may decode, in order,
    without passing ``budget`` together: each job that still fits (the first always does)."""
    fits: list[bool] = []
    total = 0
    for count in pixels:
        ok = count is not None and (total == 0 or total + count <= budget)
        total += count if ok and count is not None else 0
        fits.append(ok)
    return fits


def moderate_inputs_step(works: list[Work], ctx: PipelineContext) -> list[Each[None]]:
    """NSFW check of each job's inputs before any face model; ``ctx.model_threads`` calls
    in flight, spread over the jobs (one job: its images in that many calls)."""
    calls = max(1, ctx.model_threads // len(works))

    def moderate(work: Work) -> None:
        verdicts = pipeline.moderate_inputs_stage(work.inputs(), ctx, calls=calls)
        work.flags += pipeline.flagged_summaries(verdicts)

    return each(moderate, works, threads=min(ctx.model_threads, len(works)))


def detect_step(works: list[Work], ctx: PipelineContext) -> list[Each[None]]:
    """Faces of every job: the jobs without a per-face mapping in batched detector calls,
    each job with one (and its extra sources and references) on its own."""
    plain = [w for w in works if not w.options.mapping]
    found: dict[int, Each[Detections]] = {}
    if plain:
        jobs = [(_got(w.source), _got(w.target), w.options) for w in plain]
        batched = _timed_batch(lambda: pipeline.detect_stage_batch(jobs, ctx), len(plain))
        found.update((id(w), outcome) for w, outcome in zip(plain, batched, strict=True))
    for work in works:
        if work.options.mapping:
            (found[id(work)],) = each(lambda w: _detect_mapped(w, ctx), [work])
    outcomes = [found[id(w)] for w in works]
    for work, outcome in zip(works, outcomes, strict=True):
        if outcome.ok:
            work.detections = outcome.value
    return [Each(None, o.error, o.ms) for o in outcomes]


def _detect_mapped(work: Work, ctx: PipelineContext) -> Detections:
    return pipeline.detect_stage(
        _got(work.source),
        _got(work.target),
        work.options,
        ctx,
        extra_sources=work.extra_sources,
        references=work.references,
    )


def _timed_batch(call: Callable[[], list[Any]], n: int) -> list[Each[Any]]:
    """One batched call for ``n`` jobs (its time shared); its own failure fails them all."""
    start = _now_ms()
    try:
        values = call()
    except TimeoutError:
        raise
    except Exception as exc:
        return [Each(None, as_job_error(exc), (_now_ms() - start) / max(1, n))] * n
    return shared(values, _now_ms() - start)


def align_step(works: list[Work], ctx: PipelineContext) -> list[Each[None]]:
    """Warp each job's faces to its fuser's template."""

    def align(work: Work) -> None:
        work.aligned = pipeline.align_stage(
            _got(work.source), _got(work.target), _got(work.detections), work.options, ctx
        )

    return each(align, works)


def fuse_step(works: list[Work], ctx: PipelineContext) -> list[Each[None]]:
    """One fused crop per target face of each job."""

    def fuse(work: Work) -> None:
        work.fused = pipeline.fuse_stage(_got(work.aligned), work.options, ctx)

    return each(fuse, works)


def enhance_step(works: list[Work], ctx: PipelineContext) -> list[Each[None]]:
    """Restore each job's fused faces with its chosen enhancer."""

    def enhance(work: Work) -> None:
        work.fused = pipeline.enhance_stage(_got(work.target), _got(work.fused), work.options, ctx)

    return each(enhance, works)


def postprocess_step(works: list[Work], ctx: PipelineContext) -> list[Each[None]]:
    """Blend each job's fused faces into its target (a photo or a video frame), on
    ``cpu_threads``."""

    def postprocess(work: Work) -> None:
        work.image = pipeline.postprocess_stage(
            _got(work.target), _got(work.fused), work.options, ctx
        )

    return each(postprocess, works, threads=ctx.cpu_threads)


def quality_step(works: list[Work], ctx: PipelineContext) -> list[Each[None]]:
    """Each result's quality report (faces re-detected, identity, pose) with the
    quality-floor retry when one is due and ``work.may_retry()``; ``FaceLost`` when a face
    is missing. ``ctx.model_threads`` jobs at once."""

    def check(work: Work) -> None:
        reference = work.side["reference"].take() if "reference" in work.side else None
        image = _got(work.image)
        checked = pipeline.checked_stage(
            _got(work.source), _got(work.target), _got(work.aligned), _got(work.detections),
            _got(work.fused), image, work.options, ctx,
            may_retry=work.may_retry, reference=reference,
        )  # fmt: skip
        work.image, work.fused, work.options = checked.image, checked.fused, checked.options
        work.report = checked.report
        work.release_inputs()

    return each(check, works, threads=ctx.model_threads)


def moderate_result_step(works: list[Work], ctx: PipelineContext) -> list[Each[None]]:
    """NSFW check of each result (started beside the quality stage when it could be)."""

    def moderate(work: Work) -> None:
        ahead = work.side.get("moderated")
        image = _got(work.image)
        if ahead is not None:
            verdicts = ahead.take(image, ctx)
        else:
            verdicts = pipeline.moderate_result_stage(image, ctx)
        work.side.pop("moderated", None)
        work.flags += pipeline.flagged_summaries(verdicts)

    return each(moderate, works)


def store_step(works: list[Work], ctx: PipelineContext) -> list[Each[None]]:
    """Mark each result when the context marks (watermark, then Content Credentials on the
    encoded file: ``tasks.provenance``), encode it (metadata stripped; started beside the
    quality stage when it could be) and write it where its job wants it (``JobIO.write``),
    on ``cpu_threads``."""

    def store(work: Work) -> None:
        args = _encode_args(work, ctx)
        ahead = work.side.pop("encoded", None)
        encoded = ahead.take(*args) if ahead is not None else pipeline.marked_encode_stage(*args)
        work.image, work.encoded, work.marks = encoded
        if work.report is not None:
            work.report = work.report.model_copy(update={"marks": list(work.marks)})
        work.location = work.io.write(work)

    return each(store, works, threads=ctx.cpu_threads)


def _checks_inputs(work: Work, ctx: PipelineContext) -> bool:
    return ctx.moderation.checks_inputs


def _checks_result(work: Work, ctx: PipelineContext) -> bool:
    return ctx.moderation.checks_result


def _enhances(work: Work, ctx: PipelineContext) -> bool:
    return work.options.enhancer != "none"


def _reference(work: Work, ctx: PipelineContext) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    args = (work.source, work.target, work.detections, work.options, ctx)
    return pipeline.reference_stage, args


def _moderation(work: Work, ctx: PipelineContext) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    return pipeline.moderate_result_stage, (work.image, ctx)


def _encoding(work: Work, ctx: PipelineContext) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    return pipeline.marked_encode_stage, _encode_args(work, ctx)


def _encode_args(work: Work, ctx: PipelineContext) -> tuple[Any, ...]:
    """What ``store`` encodes: a quality-floor retry that won has another image and options
    (then the encoding started beside quality is not used)."""
    return (work.image, work.options, ctx.marker, work.job_id, work.ingredients)


# --------------------------------------------------------------------------- the table

PIPELINE: tuple[Stage, ...] = (
    Stage("load", load_step, budget_s=30.0, expected_s=0.5, retries=2),
    Stage(
        "moderate_inputs",
        moderate_inputs_step,
        budget_s=30.0,
        expected_s=0.3,
        retries=1,
        applies=_checks_inputs,
        calls=("moderate_inputs_stage",),
    ),
    Stage(
        "detect",
        detect_step,
        budget_s=60.0,
        expected_s=2.0,
        retries=1,
        sides=(Side("reference", taken_in="quality", start=_reference),),
        stop_point=True,
        calls=("detect_stage", "detect_stage_batch"),
    ),
    Stage(
        "align",
        align_step,
        frames=True,
        budget_s=15.0,
        expected_s=0.2,
        retries=0,
        calls=("align_stage",),
    ),
    Stage(
        "fuse",
        fuse_step,
        frames=True,
        budget_s=60.0,
        expected_s=2.0,
        retries=1,
        calls=("fuse_stage",),
    ),
    Stage(
        "enhance",
        enhance_step,
        budget_s=60.0,
        expected_s=1.0,
        retries=1,
        applies=_enhances,
        frames=True,
        calls=("enhance_stage",),
    ),
    Stage(
        "postprocess",
        postprocess_step,
        budget_s=30.0,
        expected_s=1.0,
        retries=0,
        sides=(
            Side("moderated", taken_in="moderate_result", start=_moderation),
            Side("encoded", taken_in="store", start=_encoding),
        ),
        frames=True,
        calls=("postprocess_stage",),
    ),
    Stage(
        "quality",
        quality_step,
        budget_s=30.0,
        expected_s=1.0,
        retries=0,
        calls=("checked_stage", "reference_stage"),
    ),
    Stage(
        "moderate_result",
        moderate_result_step,
        budget_s=30.0,
        expected_s=0.2,
        retries=1,
        applies=_checks_result,
        calls=("moderate_result_stage",),
    ),
    Stage("store", store_step, budget_s=30.0, expected_s=0.5, retries=2, stop_point=True),
)
if tuple(s.name for s in PIPELINE) != STAGE_NAMES:  # pragma: no cover - a table edit's typo
    raise RuntimeError("PIPELINE and StageName list different stages")
QUALITY_RETRY_STAGES: tuple[StageName, ...] = ("fuse", "postprocess", "quality", "store")
"""What a quality-floor retry runs again (its expected cost must fit in the time left)."""


# --------------------------------------------------------------------------- drivers


class Runner(Protocol):
    """How a driver runs each stage for the live jobs: in-process or as Prefect tasks."""

    def admit(self, stage: Stage, works: list[Work]) -> list[Work]:
        """The jobs that go into ``stage`` (the others were stopped or ran out of time)."""
        ...

    def run(self, stage: Stage, works: list[Work]) -> list[Each[None]]:
        """Run ``stage.step`` for ``works``; per job, its outcome."""
        ...

    def skip(self, stage: Stage) -> None:
        """``stage`` concerns none of the live jobs."""
        ...

    def failed(self, work: Work, error: FaceFlowError, stage: Stage) -> None:
        """``work`` left the pipeline with ``error`` at ``stage``."""
        ...


def stage_named(name: str) -> Stage:
    """The table's entry for stage ``name`` (``KeyError`` for none)."""
    for stage in PIPELINE:
        if stage.name == name:
            return stage
    raise KeyError(name)


def side_threads(jobs: int, cpu_threads: int) -> int:
    """Side threads of a run: a single job runs all its side work at once; a batch runs
    its jobs' side work (mostly CPU: encoding and marking the results) on its
    ``cpu_threads``, as it does its other per-job CPU work, beside the model stages (a
    single side thread left a core idle while they waited on their model calls, and then
    ``moderate_result`` waited for its queue: docs/batching.md)."""
    return sum(len(s.sides) for s in PIPELINE) if jobs == 1 else max(1, cpu_threads)


def run_stages(
    works: list[Work],
    ctx: PipelineContext,
    runner: Runner,
    *,
    only: Callable[[Stage], bool] = lambda stage: True,
) -> None:
    """Every stage of ``PIPELINE`` (those ``only`` keeps) in order, for the jobs still live
    before it."""
    with stage_workers(side_threads(len(works), ctx.cpu_threads)) as pool:
        for stage in PIPELINE:
            if not only(stage):
                continue
            concerned = [w for w in live(works) if stage.applies(w, ctx)]
            if not concerned:
                runner.skip(stage)
                continue
            jobs = runner.admit(stage, concerned)
            if not jobs:
                continue
            for work, outcome in zip(jobs, runner.run(stage, jobs), strict=True):
                work.timings_ms[stage.name] = work.timings_ms.get(stage.name, 0.0) + outcome.ms
                if outcome.error is not None:
                    work.error = drop_frames(outcome.error)  # frames hold images
                    work.side.clear()
                    runner.failed(work, outcome.error, stage)
                else:
                    for side in stage.sides:
                        if _taken(side, work, ctx, only):
                            fn, args = side.start(work, ctx)
                            work.side[side.name] = Beside(pool, fn, *args)
        for work in works:
            work.side.clear()


def _taken(side: Side, work: Work, ctx: PipelineContext, only: Callable[[Stage], bool]) -> bool:
    """Whether the stage that takes ``side`` runs for ``work`` (else it is not started)."""
    taker = stage_named(side.taken_in)
    return only(taker) and taker.applies(work, ctx)


def live(works: Sequence[Work]) -> list[Work]:
    """The jobs that have not left the pipeline."""
    return [w for w in works if w.error is None]


class InProcess:
    """The in-process runner: each stage called directly, a job's error raised at once."""

    def __init__(self, ctx: PipelineContext) -> None:
        self.ctx = ctx

    def admit(self, stage: Stage, works: list[Work]) -> list[Work]:
        """Every job (no deadline in-process)."""
        return works

    def run(self, stage: Stage, works: list[Work]) -> list[Each[None]]:
        """``stage.step`` on this thread."""
        return stage.step(works, self.ctx)

    def skip(self, stage: Stage) -> None:
        """Nothing to record."""

    def failed(self, work: Work, error: FaceFlowError, stage: Stage) -> None:
        """Raise ``error``: ``fuse_images`` has one job."""
        raise error


class InMemory:
    """A job's input bytes in memory; its result stays on the ``Work``."""

    def __init__(self, data: InputBytes) -> None:
        self.data = data

    def read(self) -> InputBytes:
        """The bytes given."""
        return self.data

    def write(self, work: Work) -> str | None:
        """Nothing to write: the caller reads the result off ``work``."""
        return None


def fuse_images(
    source_bytes: bytes,
    target_bytes: bytes,
    options: FusionOptions | None = None,
    ctx: PipelineContext | None = None,
    *,
    extra_sources: Sequence[bytes] = (),
    references: Sequence[bytes] = (),
    job_id: str = "",
) -> FusionResult:
    """Run every stage in this process and return the encoded result with per-stage timings
    (each stage's own time: work that runs beside others overlaps, so their sum can exceed
    the wall time). ``extra_sources`` (sources after the first) and ``references`` serve a
    per-face ``options.mapping``; ``job_id`` names the watermark's job when ``ctx`` marks.
    Raises the job's typed error."""
    options = options or FusionOptions()
    ctx = ctx or PipelineContext()
    data = InputBytes(source_bytes, target_bytes, tuple(extra_sources), tuple(references))
    work = Work(InMemory(data), options, job_id=job_id)
    run_stages([work], ctx, InProcess(ctx))
    return result_of(work, ctx)


def result_of(work: Work, ctx: PipelineContext) -> FusionResult:
    """The ``FusionResult`` of a job that went through every stage."""
    image, detections, fused = _got(work.image), _got(work.detections), _got(work.fused)
    return FusionResult(
        data=_got(work.encoded),
        content_type=work.options.content_type,
        width=int(image.shape[1]),
        height=int(image.shape[0]),
        faces_replaced=len(fused.crops),
        source_faces=detections.source_count,
        target_faces=detections.target_count,
        device=ctx.device,
        timings_ms=dict(work.timings_ms),
        quality=work.report,
        moderation_flags=tuple(work.flags),
        marks=tuple(work.marks),
    )


def _got(value: T | None) -> T:
    assert value is not None, "a live job has the output of the stages before"
    return value


def _now_ms() -> float:
    return time.perf_counter() * 1e3
