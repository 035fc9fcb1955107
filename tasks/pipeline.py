"""The face pipeline's stage functions for one job: moderate → detect → align → fuse →
enhance → postprocess → quality, and what they pass on.

Each takes the previous stage's typed output and a ``PipelineContext``. The order, the
budgets and what runs beside what are defined once, in ``tasks.stages.PIPELINE``, whose
steps call these functions for the jobs of a run; ``tasks.stages.fuse_images`` runs them
all in-process (the CLI, the benchmarks and tests), the flows as Prefect tasks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypedDict, TypeVar

import numpy as np

from tasks.align import align_face
from tasks.detect import (
    DEFAULT_DETECT_MAX_SIDE,
    detect_faces,
    detect_faces_batch,
    select_faces,
)
from tasks.errors import (
    FaceFlowError,
    FaceLost,
    InvalidInput,
    NoFaceFound,
    PoseMismatch,
    as_job_error,
)
from tasks.identity import load_dlib_embedder, load_dlib_shaper
from tasks.images import decode_image, encode_image
from tasks.options import DetectorName, FuserName, FusionOptions, ImageLimits, ModerationPolicy
from tasks.postprocess import color_transfer, face_mask, image_mask, paste_back, sharpen
from tasks.quality import IdentityReference, assess, better, identity_reference, target_indices
from tasks.registry import next_fuser_settings
from tasks.report import FuserSettings, QualityReport
from tasks.types import AlignedFace, Face, FloatArray, RGBImage

if TYPE_CHECKING:
    from tasks.moderation import ModerationVerdict
    from tasks.provenance import Ingredient, Marker

CLASSIC_CROP_SIZE = 256
INSWAPPER_CROP_SIZE = 128
ARCFACE_CROP_SIZE = 112
PASTE_MASK_ERODE = 0.015
"""Erosion of the mask that pastes a fused crop back (a fraction of the crop; the classic
fuser's own mask has the same, so none of the fused face is cut away)."""


class ModelArgs(TypedDict):
    """The keyword arguments every model function takes (``embed_with_arcface(crop,
    **ctx.model_args)``): the device it runs on, the operator's model files, their pins."""

    device: str
    model_dir: Path | None
    pins: Mapping[str, str]


@dataclass(frozen=True)
class PipelineContext:
    """Where and with what the pipeline runs: device, operator model files, input limits,
    moderation policy."""

    device: str = "cpu"
    model_dir: Path | None = None
    pins: Mapping[str, str] = field(default_factory=dict)
    limits: ImageLimits = field(default_factory=ImageLimits)
    crop_size: int = CLASSIC_CROP_SIZE
    detect_max_side: int = DEFAULT_DETECT_MAX_SIDE
    moderation: ModerationPolicy = field(default_factory=ModerationPolicy)
    cpu_threads: int = 1
    """Threads for a batch's per-job CPU work that releases the GIL (``tasks.batch.each``)."""
    model_threads: int = 1
    """Model calls kept in flight (``tasks.batch.model_threads``): detection and input
    moderation of a job's images in that many calls (a batch's detection in that many
    chunks), a batch's input moderation and quality checks of that many jobs at once."""
    marker: Marker | None = None
    """How results are marked (watermark and signed C2PA manifest); None: unmarked."""
    call_threads: int = 0
    """Intra-op threads of one model call on the CPU, the cores shared among the calls in
    flight (``tasks.batch.call_threads``): torch's (set by ``for_this_machine``) and the
    moderation session's; 0: the runtimes' own defaults."""

    @property
    def model_args(self) -> ModelArgs:
        """``device``, ``model_dir`` and ``pins``, to pass on to a model function."""
        return ModelArgs(device=self.device, model_dir=self.model_dir, pins=self.pins)

    @classmethod
    def for_this_machine(
        cls,
        *,
        device: str | None = None,
        model_dir: str | Path | None = None,
        pins: Mapping[str, str] | None = None,
        limits: ImageLimits | None = None,
        moderation: ModerationPolicy | None = None,
        cpu_threads: int = 1,
        model_threads: int = 0,
    ) -> PipelineContext:
        """A context on ``device`` (default: the best local one, ``cuda`` when available);
        ``cpu_threads`` and ``model_threads`` as the settings give them (0: by the cores and
        the device, ``tasks.batch``). Sets torch's CPU threads for this process to the
        context's ``call_threads`` (``tasks.gpu.use_torch_threads``)."""
        from tasks import batch
        from tasks.gpu import select_device, use_torch_threads

        chosen = select_device(device)
        in_flight = batch.model_threads(model_threads, chosen)
        per_call = batch.call_threads(in_flight)
        use_torch_threads(per_call)
        return cls(
            device=chosen,
            model_dir=Path(model_dir) if model_dir is not None else None,
            pins=dict(pins or {}),
            limits=limits or ImageLimits(),
            moderation=moderation or ModerationPolicy(),
            cpu_threads=batch.cpu_threads(cpu_threads),
            model_threads=in_flight,
            call_threads=per_call,
        )


@dataclass(frozen=True)
class SourceFace:
    """The source face a per-face mapping puts onto one target face, and its image."""

    index: int  # which source image (0 = the first)
    image: RGBImage
    face: Face


@dataclass(frozen=True)
class Detections:
    """The source face and the target faces chosen for replacement.

    With a per-face mapping, ``per_face`` holds each target face's own source (parallel to
    ``target_faces``) and ``target_indices`` their indices among all target faces (largest
    first); without one both are empty and ``source_face`` goes onto every target face.
    """

    source_face: Face
    target_faces: list[Face]
    source_count: int
    target_count: int
    per_face: tuple[SourceFace, ...] = ()
    target_indices: tuple[int, ...] = ()

    def sources(self, source: RGBImage) -> list[tuple[RGBImage, Face]]:
        """The (image, face) fused onto each target face, given the first source image."""
        if self.per_face:
            return [(s.image, s.face) for s in self.per_face]
        return [(source, self.source_face)] * len(self.target_faces)


@dataclass(frozen=True)
class Aligned:
    """Source and target faces warped to the template the fuser expects."""

    source: AlignedFace
    targets: list[AlignedFace]
    source_embedding: FloatArray | None = None
    per_face: tuple[AlignedFace, ...] = ()  # a per-face mapping's sources, parallel to targets
    per_face_embeddings: tuple[FloatArray, ...] = ()

    def source_for(self, k: int) -> AlignedFace:
        """The aligned source face fused onto target face ``k``."""
        return self.per_face[k] if self.per_face else self.source

    def embedding_for(self, k: int) -> FloatArray:
        """The source identity embedding (inswapper) for target face ``k``."""
        if self.per_face_embeddings:
            return self.per_face_embeddings[k]
        assert self.source_embedding is not None
        return self.source_embedding


@dataclass(frozen=True)
class Fused:
    """One fused crop per target face, with the alignment used to paste it back (and, from
    the classic fuser, the occlusion mask of each: the target's pixels it kept)."""

    crops: list[RGBImage]
    targets: list[AlignedFace]
    occlusions: tuple[FloatArray, ...] = ()


def decode_stage(data: bytes, ctx: PipelineContext) -> RGBImage:
    """Decode and validate one input image (format, bytes, pixels, orientation)."""
    return decode_image(data, ctx.limits)


def moderate_inputs_stage(
    images: Mapping[str, RGBImage], ctx: PipelineContext, *, calls: int = 1
) -> tuple[ModerationVerdict, ...]:
    """NSFW check of the inputs (role → image) on the CPU, before any face model runs, in
    ``calls`` detector calls at once (a single job: ``ctx.model_threads``; a batch keeps
    its jobs in flight instead).

    ``ContentBlocked`` when the policy enforces and an image is flagged; in report mode the
    verdicts (with what was flagged) are returned; ``()`` when the policy checks no inputs.
    """
    if not ctx.moderation.checks_inputs:
        return ()
    return _moderate(images, ctx, calls=calls)


def moderate_result_stage(image: RGBImage, ctx: PipelineContext) -> tuple[ModerationVerdict, ...]:
    """NSFW check of the result image, as ``moderate_inputs_stage`` does for the inputs."""
    return moderate_results({"result": image}, ctx)


def moderate_results(
    images: Mapping[str, RGBImage], ctx: PipelineContext
) -> tuple[ModerationVerdict, ...]:
    """NSFW check of result images by name (a photo's result, a video's sampled frames);
    ``()`` when the policy checks no results."""
    if not ctx.moderation.checks_result:
        return ()
    return _moderate(images, ctx)


def _moderate(
    images: Mapping[str, RGBImage], ctx: PipelineContext, *, calls: int = 1
) -> tuple[ModerationVerdict, ...]:
    from tasks.moderation import enforce, moderate_images

    verdicts = moderate_images(
        images,
        ctx.moderation,
        model_dir=ctx.model_dir,
        pins=ctx.pins,
        calls=calls,
        threads=ctx.call_threads,
    )
    enforce(verdicts, ctx.moderation)
    return verdicts


def flagged_summaries(verdicts: tuple[ModerationVerdict, ...]) -> list[str]:
    """``role: LABEL score`` lines of the verdicts that flagged something (report mode)."""
    return [v.summary() for v in verdicts if v.flagged]


def detect_stage(
    source: RGBImage,
    target: RGBImage,
    options: FusionOptions,
    ctx: PipelineContext,
    *,
    extra_sources: Sequence[RGBImage] = (),
    references: Sequence[RGBImage] = (),
) -> Detections:
    """Detect faces in both images; the source's largest face and the chosen target faces.

    With ``options.mapping``, the largest face of every source (``source`` then
    ``extra_sources``) and reference image too, and each target face's own source.
    """
    if options.mapping:
        return _mapped_detections(source, target, options, ctx, extra_sources, references)
    source_faces, target_faces = detect_images([source, target], options.detector, ctx)
    return _detections(source_faces, target_faces, options)


def _mapped_detections(
    source: RGBImage,
    target: RGBImage,
    options: FusionOptions,
    ctx: PipelineContext,
    extra_sources: Sequence[RGBImage],
    references: Sequence[RGBImage],
) -> Detections:
    from tasks.mapping import assign_faces, check_entries

    sources = [source, *extra_sources]
    check_entries(options.mapping, len(sources), len(references))
    found = detect_images([*sources, target, *references], options.detector, ctx)
    source_faces, target_faces, reference_faces = (
        found[: len(sources)],
        found[len(sources)],
        found[len(sources) + 1 :],
    )
    for role, images in (("source", source_faces), ("reference", reference_faces)):
        for i, faces in enumerate(images):
            if not faces:
                raise NoFaceFound(f"No face was found in {role} image {i}.")
    if not target_faces:
        raise NoFaceFound("No face was found in the target image.")
    assignment = assign_faces(
        options.mapping,
        target,
        target_faces,
        [(image, faces[0]) for image, faces in zip(references, reference_faces, strict=True)],
        embed=lambda pairs: embed_faces(pairs, ctx),
    )
    per_face = tuple(
        SourceFace(s, sources[s], source_faces[s][0]) for s in assignment.source_indices
    )
    return Detections(
        source_faces[0][0],
        [target_faces[i] for i in assignment.target_indices],
        len(source_faces[0]),
        len(target_faces),
        per_face=per_face,
        target_indices=tuple(assignment.target_indices),
    )


def embed_faces(pairs: Sequence[tuple[RGBImage, Face]], ctx: PipelineContext) -> FloatArray:
    """Identity embeddings of (image, face) pairs: the one embedder the mapping uses."""
    from tasks.identity import embed_with_dlib

    return embed_with_dlib(pairs, device=ctx.device, pins=ctx.pins)


def detect_stage_batch(
    jobs: Sequence[tuple[RGBImage, RGBImage, FusionOptions]], ctx: PipelineContext
) -> list[Detections | FaceFlowError]:
    """``detect_stage`` of several jobs: the images of all jobs that use the same detector
    go through ``detect_faces_batch`` together. Per job, its detections or the error that
    ends it (no face, bad face index, or the detector's own failure for every job using it)."""
    found: list[Detections | FaceFlowError | None] = [None] * len(jobs)
    by_detector: dict[DetectorName, list[int]] = {}
    for index, (_source, _target, options) in enumerate(jobs):
        if options.mapping:  # its extra sources and references are not in a batch
            found[index] = InvalidInput(
                "A job with a per-face mapping cannot run in a batch.",
                detail="dispatch it to fuse-faces",
            )
            continue
        by_detector.setdefault(options.detector, []).append(index)
    for detector, indices in by_detector.items():
        images = [image for i in indices for image in jobs[i][:2]]
        try:
            faces = detect_images(images, detector, ctx)
        except TimeoutError:
            raise
        except Exception as exc:
            for i in indices:
                found[i] = as_job_error(exc)
            continue
        for n, i in enumerate(indices):
            try:
                found[i] = _detections(faces[2 * n], faces[2 * n + 1], jobs[i][2])
            except FaceFlowError as error:
                found[i] = error
    return [f for f in found if f is not None]


def detect_images(
    images: Sequence[RGBImage], detector: DetectorName, ctx: PipelineContext
) -> list[list[Face]]:
    """The faces of each image (largest first) with ``detector`` where ``ctx`` says, the
    images in ``ctx.model_threads`` batched calls (a job's, a batch's, a video's frames)."""
    return detect_faces_batch(
        images,
        detector=detector,
        **ctx.model_args,
        max_side=ctx.detect_max_side,
        threads=ctx.model_threads,
    )


def _detections(
    source_faces: list[Face], target_faces: list[Face], options: FusionOptions
) -> Detections:
    if not source_faces:
        raise NoFaceFound("No face was found in the source image.")
    chosen = select_faces(target_faces, options.face, role="target")
    return Detections(source_faces[0], chosen, len(source_faces), len(target_faces))


def align_stage(
    source: RGBImage,
    target: RGBImage,
    detections: Detections,
    options: FusionOptions,
    ctx: PipelineContext,
) -> Aligned:
    """Warp the faces to the template of the chosen fuser (each target face's own source
    face too, with a per-face mapping)."""
    return FUSERS[options.fuser].align(source, target, detections, ctx)


def fuse_stage(aligned: Aligned, options: FusionOptions, ctx: PipelineContext) -> Fused:
    """Produce one fused crop per target face."""
    return FUSERS[options.fuser].fuse(aligned, options, ctx)


def _align_classic(
    source: RGBImage, target: RGBImage, detections: Detections, ctx: PipelineContext
) -> Aligned:
    aligned_source = align_face(source, detections.source_face, ctx.crop_size)
    targets = [align_face(target, f, ctx.crop_size) for f in detections.target_faces]
    per_face = tuple(align_face(s.image, s.face, ctx.crop_size) for s in detections.per_face)
    return Aligned(aligned_source, targets, per_face=per_face)


def _fuse_classic(aligned: Aligned, options: FusionOptions, ctx: PipelineContext) -> Fused:
    from tasks.fuse import fuse_with_classic

    fusions = [
        fuse_with_classic(
            aligned.source_for(k),
            t,
            identity_weight=options.identity_weight,
            keep_occluders=options.keep_occluders,
            mirror=options.mirror_source,
        )
        for k, t in enumerate(aligned.targets)
    ]
    return Fused([f.crop for f in fusions], aligned.targets, tuple(f.occlusion for f in fusions))


def _align_inswapper(
    source: RGBImage, target: RGBImage, detections: Detections, ctx: PipelineContext
) -> Aligned:
    from tasks.arcface import embed_with_arcface

    def embed(crop: RGBImage) -> FloatArray:
        return embed_with_arcface(crop, **ctx.model_args)

    source_112 = align_face(source, detections.source_face, ARCFACE_CROP_SIZE)
    targets = [align_face(target, f, INSWAPPER_CROP_SIZE) for f in detections.target_faces]
    per_face = tuple(align_face(s.image, s.face, ARCFACE_CROP_SIZE) for s in detections.per_face)
    return Aligned(
        source_112,
        targets,
        embed(source_112.crop),
        per_face=per_face,
        per_face_embeddings=tuple(embed(a.crop) for a in per_face),
    )


def _fuse_inswapper(aligned: Aligned, options: FusionOptions, ctx: PipelineContext) -> Fused:
    from tasks.inswapper import swap_with_inswapper

    crops = [
        _mix(
            t.crop,
            swap_with_inswapper(
                t.crop,
                aligned.embedding_for(k),
                **ctx.model_args,
            ),
            options.identity_weight,
        )
        for k, t in enumerate(aligned.targets)
    ]
    return Fused(crops, aligned.targets)


def _warm_up_classic(ctx: PipelineContext) -> None:
    """The classic fuser loads no model."""


def _warm_up_inswapper(ctx: PipelineContext) -> None:
    from tasks.arcface import embed_with_arcface
    from tasks.inswapper import swap_with_inswapper

    crop112 = np.full((ARCFACE_CROP_SIZE, ARCFACE_CROP_SIZE, 3), 128, dtype=np.uint8)
    emb = embed_with_arcface(crop112, **ctx.model_args)
    crop128 = np.full((INSWAPPER_CROP_SIZE, INSWAPPER_CROP_SIZE, 3), 128, dtype=np.uint8)
    swap_with_inswapper(crop128, emb, **ctx.model_args)


@dataclass(frozen=True, slots=True)
class Fuser:
    """One fuser: the template it aligns faces to (with what it embeds), how it fuses each
    target face, and how it loads its models ahead of the first job."""

    align: Callable[[RGBImage, RGBImage, Detections, PipelineContext], Aligned]
    fuse: Callable[[Aligned, FusionOptions, PipelineContext], Fused]
    warm_up: Callable[[PipelineContext], None]


FUSERS: dict[FuserName, Fuser] = {
    "classic": Fuser(_align_classic, _fuse_classic, _warm_up_classic),
    "inswapper": Fuser(_align_inswapper, _fuse_inswapper, _warm_up_inswapper),
}
"""Every fuser a job may choose (``tasks.options.FuserName``)."""


def enhance_stage(
    target: RGBImage, fused: Fused, options: FusionOptions, ctx: PipelineContext
) -> Fused:
    """Restore each fused face with the chosen enhancer (unchanged for ``"none"``); the crops
    come back in the restorer's framing, with the alignments that paste them back and the
    fuser's occlusion masks carried into that framing (the restorer would otherwise paint
    a face over the target's glasses the fuser kept)."""
    if options.enhancer == "none":
        return fused
    from tasks.enhance import enhance_face, reframe_mask

    occlusions = fused.occlusions or (None,) * len(fused.crops)
    pairs = [
        enhance_face(
            target,
            crop,
            aligned,
            enhancer=options.enhancer,
            blend=options.enhancer_blend,
            **ctx.model_args,
            occluded=occluded,
        )
        for crop, aligned, occluded in zip(fused.crops, fused.targets, occlusions, strict=True)
    ]
    framed = (
        tuple(  # none from a fuser without occlusion masks (inswapper)
            reframe_mask(occluded, aligned, framing)
            for occluded, aligned, (_, framing) in zip(
                fused.occlusions, fused.targets, pairs, strict=True
            )
        )
        if fused.occlusions
        else ()
    )
    return Fused([crop for crop, _ in pairs], [aligned for _, aligned in pairs], framed)


def _mix(target_crop: RGBImage, swapped: RGBImage, weight: float) -> RGBImage:
    """``weight`` of the swapped face over the target crop."""
    if weight >= 1.0:
        return swapped
    mixed = target_crop.astype(np.float32) * (1.0 - weight) + swapped.astype(np.float32) * weight
    return np.clip(mixed + 0.5, 0, 255).astype(np.uint8)


def postprocess_stage(
    target: RGBImage, fused: Fused, options: FusionOptions, ctx: PipelineContext
) -> RGBImage:
    """Colour-match, mask and blend each fused crop back into the full-resolution target
    (what the fuser's occlusion masks kept of the target stays out of the mask)."""
    out = target
    occlusions = fused.occlusions or (None,) * len(fused.crops)
    for crop, aligned, occluded in zip(fused.crops, fused.targets, occlusions, strict=True):
        mask = face_mask(aligned.size, aligned.landmarks, erode=PASTE_MASK_ERODE)
        if occluded is not None:
            mask = mask * (1.0 - occluded)
        if options.color_transfer:
            crop = color_transfer(crop, aligned.crop, mask)
        out = paste_back(out, crop, aligned, mask, mode=options.blend)
        if options.sharpen > 0:  # only the replaced face: the rest stays bit-identical
            out = sharpen(out, options.sharpen, region_mask=image_mask(aligned, mask, out.shape))
    return out


def fuser_settings(options: FusionOptions) -> FuserSettings:
    """The fuser settings of ``options`` (what a quality-floor retry changes)."""
    return FuserSettings(
        fuser=options.fuser, identity_weight=options.identity_weight, blend=options.blend
    )


def reference_stage(
    source: RGBImage,
    target: RGBImage,
    detections: Detections,
    options: FusionOptions,
    ctx: PipelineContext,
) -> IdentityReference:
    """Embed and pose the source and target faces once per job, for ``quality_stage``."""
    return identity_reference(
        source,
        target,
        detections.source_face,
        detections.target_faces,
        list(detections.target_indices) or target_indices(options.face, detections.target_count),
        device=ctx.device,
        pins=ctx.pins,
        per_face_sources=[(s.image, s.face) for s in detections.per_face],
    )


def quality_stage(
    image: RGBImage,
    reference: IdentityReference,
    options: FusionOptions,
    ctx: PipelineContext,
    *,
    earlier: QualityReport | None = None,
) -> QualityReport:
    """The quality report of a blended result (``earlier``: the report of the attempt
    before a quality-floor retry, listed in ``attempts``)."""
    return assess(
        image,
        reference,
        fuser_settings(options),
        detector=options.detector,
        **ctx.model_args,
        min_identity=options.min_identity,
        earlier=earlier.attempts if earlier is not None else (),
        mirror=options.fuser == "classic" and options.mirror_source,
    )


@dataclass(frozen=True)
class Assessment:
    """A result's quality report and the job's identity reference (reused by a retry)."""

    report: QualityReport
    reference: IdentityReference


def assess_stage(
    source: RGBImage,
    target: RGBImage,
    image: RGBImage,
    detections: Detections,
    options: FusionOptions,
    ctx: PipelineContext,
    *,
    reference: IdentityReference | None = None,
    earlier: QualityReport | None = None,
) -> Assessment:
    """``reference_stage`` (unless a reference is given) then ``quality_stage``."""
    if reference is None:
        reference = reference_stage(source, target, detections, options, ctx)
    report = quality_stage(image, reference, options, ctx, earlier=earlier)
    return Assessment(report, reference)


def retry_options(options: FusionOptions, report: QualityReport) -> FusionOptions | None:
    """Options of the one quality retry: the next fuser settings the registry lists, when
    a fused face was lost (or the second detector misses it) or the result is below
    ``min_identity``; else None."""
    if len(report.attempts) > 1 or (
        report.faces_lost == 0 and report.faces_unconfirmed == 0 and not report.below_floor
    ):
        return None
    settings = next_fuser_settings(report.settings)
    if settings is None:
        return None
    return options.model_copy(
        update={"identity_weight": settings.identity_weight, "blend": settings.blend}
    )


def pick(first: QualityReport, second: QualityReport) -> tuple[int, QualityReport]:
    """Which of two attempts wins (0 or 1) and its report, listing both attempts."""
    if better(first, second):
        return 1, second
    return 0, first.model_copy(update={"attempts": second.attempts})


def check_faces(report: QualityReport) -> QualityReport:
    """``report`` unchanged, or ``FaceLost`` when a fused face is missing from the result."""
    if report.faces_lost:
        lost = [f.index for f in report.faces if not f.found]
        raise FaceLost(
            detail=f"target face(s) {lost} not detected after {len(report.attempts)} attempt(s)"
        )
    return report


def check_pose(report: QualityReport, options: FusionOptions) -> QualityReport:
    """``report`` unchanged, or ``PoseMismatch`` when a face's pose mismatches and the job
    asked to refuse such results (``on_pose_mismatch="refuse"``)."""
    if report.pose_mismatch and options.on_pose_mismatch == "refuse":
        faces = [(f.index, f.pose_difference) for f in report.faces if f.pose_mismatch]
        raise PoseMismatch(
            detail="; ".join(
                f"face {i}: yaw {d.yaw:+.0f}, pitch {d.pitch:+.0f}, roll {d.roll:+.0f}"
                for i, d in faces
            )
        )
    return report


@dataclass(frozen=True)
class Checked:
    """The result that passed the quality stage: pixels, crops, options and report."""

    image: RGBImage
    fused: Fused
    options: FusionOptions
    report: QualityReport


def checked_stage(
    source: RGBImage,
    target: RGBImage,
    aligned: Aligned,
    detections: Detections,
    fused: Fused,
    image: RGBImage,
    options: FusionOptions,
    ctx: PipelineContext,
    *,
    may_retry: Callable[[], bool] = lambda: True,
    reference: IdentityReference | None = None,
) -> Checked:
    """Assess a blended result; when a face was lost or the result is below the floor,
    fuse and blend once more with the next fuser settings (if ``may_retry()``: the flows
    ask the deadline) and keep the better result. ``FaceLost`` if a face is still missing.
    ``reference``: the job's ``reference_stage``, when it was computed beforehand."""
    assessed = assess_stage(source, target, image, detections, options, ctx, reference=reference)
    report = assessed.report
    retry = retry_options(options, report)
    if retry is not None and may_retry():
        fused_again = enhance_stage(target, fuse_stage(aligned, retry, ctx), retry, ctx)
        image_again = postprocess_stage(target, fused_again, retry, ctx)
        second = quality_stage(image_again, assessed.reference, retry, ctx, earlier=report)
        winner, report = pick(report, second)
        if winner == 1:
            fused, image, options = fused_again, image_again, retry
    check_faces(report)
    check_pose(report, options)
    return Checked(image, fused, options, report)


def encode_stage(image: RGBImage, options: FusionOptions) -> bytes:
    """Encode the result (metadata stripped)."""
    return encode_image(image, options.output_format, options.jpeg_quality)


def marked_encode_stage(
    image: RGBImage,
    options: FusionOptions,
    marker: Marker | None,
    job_id: str,
    ingredients: list[Ingredient],
) -> tuple[RGBImage, bytes, list[str]]:
    """The result watermarked with the job's payload (when large enough to carry it),
    then encoded (metadata stripped) and signed with its Content Credentials
    (``tasks.provenance``); without a marker, only encoded. Returns the pixels, the file
    and its marks (``ResultRef.marks``)."""
    if marker is None:
        return image, encode_stage(image, options), []
    marked = marker.watermark(image, job_id)
    data = marker.sign(encode_stage(marked, options), options.content_type, ingredients)
    return marked, data, ["c2pa", *(["watermark"] if marked is not image else [])]


T = TypeVar("T")


def _own_time(work: Callable[[], T]) -> tuple[T, float]:
    """``work()`` and the milliseconds it took (on the thread that ran it)."""
    start = time.perf_counter()
    value = work()
    return value, (time.perf_counter() - start) * 1000.0


@contextmanager
def stage_workers(threads: int = 2) -> Iterator[ThreadPoolExecutor]:
    """Worker threads for the work a job (or a batch) runs beside its stages; on the way
    out, work not yet started is dropped and the running work is waited for, so nothing
    of the job runs on after it has ended."""
    pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="faceflow-stage")
    try:
        yield pool
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


class Beside(Generic[T]):
    """``work(*args)`` started on a ``stage_workers`` thread ahead of the stage that needs it.

    ``take()`` returns its result (or raises its error) where that stage runs, so errors
    come out in the order of the stages; ``ms`` is then the work's own time. ``take(*other)``
    asks for the work on other arguments: unless they are the very objects it started with
    (a quality-floor retry that won has a new image), it runs the work on them here; so
    does a second ``take`` (a retry of the stage that waits for it)."""

    def __init__(self, pool: ThreadPoolExecutor, work: Callable[..., T], *args: Any) -> None:
        self._work, self._args = work, args
        self._future: Future[tuple[T, float]] | None = pool.submit(_own_time, partial(work, *args))
        self.ms = 0.0

    def take(self, *args: Any) -> T:
        """The work's result on ``args`` (default: those it started with)."""
        args = args or self._args
        future, self._future = self._future, None
        started = len(args) == len(self._args) and all(
            a is b for a, b in zip(args, self._args, strict=True)
        )
        if future is not None and started:
            value, self.ms = future.result()
        else:
            value, self.ms = _own_time(partial(self._work, *args))
        return value


def warm_up(
    ctx: PipelineContext, detector: DetectorName = "mtcnn", fuser: FuserName = "classic"
) -> float:
    """Load the models of ``detector`` and ``fuser`` (and the moderation detector when the
    context's policy checks anything) and run one tiny inference each; returns ms."""
    start = time.perf_counter()
    if ctx.moderation.checks_inputs or ctx.moderation.checks_result:
        from tasks.moderation import warm_up_moderation

        warm_up_moderation(model_dir=ctx.model_dir, pins=ctx.pins, threads=ctx.call_threads)
    probe = np.full((96, 96, 3), 128, dtype=np.uint8)
    detect_faces(probe, detector=detector, **ctx.model_args)
    load_dlib_shaper(ctx.pins)  # the quality report's identity models
    load_dlib_embedder(ctx.device, ctx.pins)
    FUSERS[fuser].warm_up(ctx)
    return (time.perf_counter() - start) * 1000.0
