"""Video jobs in the pipeline: the analysis pass over every frame, the render pass that runs
the table's per-frame stages (``tasks.stages.PIPELINE`` entries with ``frames=True``) on the
faces the face plan gives, and the report per track.

A video frame is fused by exactly the code that fuses a photo: the render pass builds a
``Work`` per frame (the source photo, the frame as target, the plan's faces as its
detections) and hands groups of them to ``run_stages`` restricted to the frame stages
(align → fuse → enhance → postprocess). Memory is bounded by the group, not the video.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from tasks.detect import detect_faces_batch
from tasks.errors import FaceFlowError, NoFaceFound
from tasks.options import FusionOptions
from tasks.pipeline import Detections, PipelineContext, SourceFace
from tasks.stages import InMemory, InProcess, InputBytes, Stage, Work, run_stages
from tasks.types import Face, FloatArray, RGBImage
from tasks.video_plan import FacePlan, Swap, Track, frame_signature

FRAME_GROUP = 8
"""Frames a render or analysis step takes at once (the detector's CPU batch)."""


@dataclass(frozen=True, slots=True)
class Source:
    """A source photo of a video job and its largest face."""

    image: RGBImage
    face: Face


@dataclass
class Analysis:
    """What the analysis pass found: each frame's faces (largest first) and signature."""

    faces: list[list[Face]] = field(default_factory=list)
    signatures: list[FloatArray] = field(default_factory=list)


def sources_of(
    images: Sequence[RGBImage], options: FusionOptions, ctx: PipelineContext
) -> list[Source]:
    """Each source photo's largest face (``NoFaceFound`` for a photo without one)."""
    found = detect_faces_batch(
        list(images),
        detector=options.detector,
        device=ctx.device,
        model_dir=ctx.model_dir,
        pins=ctx.pins,
        max_side=ctx.detect_max_side,
        threads=ctx.model_threads,
    )
    sources = []
    for i, (image, faces) in enumerate(zip(images, found, strict=True)):
        if not faces:
            raise NoFaceFound(f"No face was found in source image {i}.")
        sources.append(Source(image, faces[0]))
    return sources


def analyse(
    frames: Iterable[RGBImage], options: FusionOptions, ctx: PipelineContext, analysis: Analysis
) -> Analysis:
    """Detect the faces of every frame (``FRAME_GROUP`` at a time, the detection stage's
    own batched call) and take its signature, appending to ``analysis``."""
    group: list[RGBImage] = []

    def flush() -> None:
        analysis.faces += detect_faces_batch(
            group,
            detector=options.detector,
            device=ctx.device,
            model_dir=ctx.model_dir,
            pins=ctx.pins,
            max_side=ctx.detect_max_side,
            threads=ctx.model_threads,
        )
        analysis.signatures += [frame_signature(f) for f in group]
        group.clear()

    for frame in frames:
        group.append(frame)
        if len(group) == FRAME_GROUP:
            flush()
    if group:
        flush()
    return analysis


class FrameRunner(InProcess):
    """The frame stages in-process; a frame a stage fails on keeps its original pixels
    (counted in ``failures``) instead of failing the video."""

    def __init__(self, ctx: PipelineContext) -> None:
        super().__init__(ctx)
        self.failures: dict[str, int] = {}

    def failed(self, work: Work, error: FaceFlowError, stage: Stage) -> None:
        """Count the frame's error by code."""
        self.failures[error.code] = self.failures.get(error.code, 0) + 1


_NO_BYTES = InMemory(InputBytes(b"", b""))


def frame_work(
    frame: RGBImage, swaps: Sequence[Swap], sources: Sequence[Source], options: FusionOptions
) -> Work:
    """The ``Work`` of one frame: the plan's faces as its detections, each with its
    source (a per-face mapping's sources as ``per_face``)."""
    first = sources[0]
    per_face: tuple[SourceFace, ...] = ()
    if any(s.source for s in swaps) or len(sources) > 1:
        per_face = tuple(
            SourceFace(s.source, sources[s.source].image, sources[s.source].face) for s in swaps
        )
    detections = Detections(
        first.face,
        [s.face for s in swaps],
        1,
        len(swaps),
        per_face=per_face,
    )
    return Work(_NO_BYTES, options, source=first.image, target=frame, detections=detections)


def render(
    frames: Iterable[tuple[int, RGBImage]],
    plan: FacePlan,
    sources: Sequence[Source],
    options: FusionOptions,
    ctx: PipelineContext,
    runner: FrameRunner,
) -> Iterator[tuple[int, RGBImage]]:
    """Each frame with the plan's faces fused (frames without a swap pass unchanged), in
    order, ``FRAME_GROUP`` frames through the table's frame stages at a time."""
    group: list[tuple[int, RGBImage]] = []

    def flush() -> Iterator[tuple[int, RGBImage]]:
        works = {
            i: frame_work(f, plan.frames[i], sources, options) for i, f in group if plan.frames[i]
        }
        if works:
            run_stages(list(works.values()), ctx, runner, only=lambda stage: stage.frames)
        for index, frame in group:
            work = works.get(index)
            fused = work.image if work is not None and work.error is None else None
            yield index, (fused if fused is not None else frame)
        group.clear()

    for item in frames:
        group.append(item)
        if len(group) == FRAME_GROUP:
            yield from flush()
    if group:
        yield from flush()


@dataclass(frozen=True, slots=True)
class TrackReport:
    """What a video's report says of one track."""

    track: int
    frames: int
    swapped_frames: int
    interpolated_frames: int
    jitter_before_px: float
    jitter_after_px: float
    similarity_mean: float | None = None
    similarity_p10: float | None = None
    similarity_min: float | None = None


def track_reports(plan: FacePlan, similarities: dict[int, list[float]]) -> list[TrackReport]:
    """One report per track (``similarities``: the track's sampled identity similarities
    of fused faces to their source)."""
    out = []
    for track in plan.tracks:
        sims = similarities.get(track.id) or []
        out.append(
            TrackReport(
                track=track.id,
                frames=len(track.faces),
                swapped_frames=plan.swapped_frames(track.id),
                interpolated_frames=len(track.filled),
                jitter_before_px=round(track.jitter_before, 3),
                jitter_after_px=round(track.jitter_after, 3),
                similarity_mean=float(np.mean(sims)) if sims else None,
                similarity_p10=float(np.percentile(sims, 10)) if sims else None,
                similarity_min=float(np.min(sims)) if sims else None,
            )
        )
    return out


def sample_frames(track: Track, most: int = 6) -> list[int]:
    """Up to ``most`` of a track's detected frames, evenly spread (for its embedding and
    its identity similarity)."""
    seen = sorted(track.detected)
    if len(seen) <= most:
        return seen
    picks = np.linspace(0, len(seen) - 1, most).round().astype(int)
    return [seen[i] for i in picks]
