"""Video jobs in the pipeline: the analysis pass over every frame, the render pass that runs
the table's per-frame stages (``tasks.stages.PIPELINE`` entries with ``frames=True``) on the
faces the face plan gives, and the report per track.

A video frame is fused by exactly the code that fuses a photo: the render pass builds a
``Work`` per frame (the source photo, the frame as target, the plan's faces as its
detections) and hands groups of them to ``run_stages`` restricted to the frame stages
(align → fuse → enhance → postprocess). Memory is bounded by the group, not the video.
"""

from __future__ import annotations

import hashlib
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np

from tasks import pipeline, watermark
from tasks.errors import FaceFlowError, NoFaceFound
from tasks.identity import (
    embed_chips,
    embed_with_dlib,
    load_dlib_shaper,
    prepare_dlib,
    similarity,
)
from tasks.mapping import check_entries
from tasks.options import FusionOptions
from tasks.pipeline import Detections, PipelineContext, SourceFace
from tasks.registry import sha256_file
from tasks.stages import InMemory, InProcess, InputBytes, Stage, Work, run_stages
from tasks.types import Box, FloatArray, RGBImage
from tasks.video_analysis import Analysis, analysis_ranges
from tasks.video_io import (
    DEFAULT_ENCODING,
    SegmentWriter,
    VideoInfo,
    VideoLimits,
    VideoSource,
    join_segments,
    probe_frames,
    read_frames,
    read_frames_at,
)
from tasks.video_plan import (
    Chunk,
    FacePlan,
    Identities,
    Swap,
    Track,
    frame_signature,
    plan_chunks,
    plan_faces,
    scene_cuts,
)
from tasks.video_records import Planned, Probed, Source, TrackReport, track_reports

FRAME_GROUP = 8
"""Frames a render or analysis step takes at once (the detector's CPU batch)."""

T = TypeVar("T")


def sources_of(
    images: Sequence[RGBImage],
    options: FusionOptions,
    ctx: PipelineContext,
    role: str = "source",
) -> list[Source]:
    """Each photo's largest face (``NoFaceFound`` for a photo without one): the sources,
    or a mapping's reference images (``role``)."""
    if not images:
        return []
    found = pipeline.detect_images(list(images), options.detector, ctx)
    sources = []
    for i, (image, faces) in enumerate(zip(images, found, strict=True)):
        if not faces:
            raise NoFaceFound(f"No face was found in {role} image {i}.")
        sources.append(Source(image, faces[0]))
    return sources


TRACK_SAMPLES = 4
"""Detected frames per track whose identity embeddings a per-face mapping averages."""


def identities(
    video: VideoSource,
    pts: list[int],
    references: Sequence[Source],
    ctx: PipelineContext,
    keyframes: list[int] | None = None,
) -> Identities:
    """What a per-face mapping recognises people by: the references' embeddings, and each
    track's mean embedding over up to ``TRACK_SAMPLES`` of its detected frames (each
    frame read once, ``read_indices``), by the mapping's embedder (``pipeline.embed_faces``)."""
    from tasks.identity import similarity

    def embed(tracks: Sequence[Track]) -> list[FloatArray]:
        picks = {t.id: [sorted(t.detected)[i] for i in evenly(len(t.detected), TRACK_SAMPLES)]
                 for t in tracks}  # fmt: skip
        indices = sorted({i for frames in picks.values() for i in frames})
        images = dict(zip(indices, read_indices(video, indices, pts, keyframes), strict=True))
        pairs = [(images[i], t.detected[i]) for t in tracks for i in picks[t.id]]
        vectors = iter(pipeline.embed_faces(pairs, ctx))
        return [np.mean([next(vectors) for _ in picks[t.id]], axis=0) for t in tracks]

    refs = pipeline.embed_faces([(r.image, r.face) for r in references], ctx)
    return Identities(embed, similarity, list(refs))


def frame_groups(frames: Iterable[T]) -> Iterator[list[T]]:
    """``frames`` in lists of ``FRAME_GROUP`` (the last one shorter), read lazily: each list
    is yielded as soon as it is full."""
    group: list[T] = []
    for frame in frames:
        group.append(frame)
        if len(group) == FRAME_GROUP:
            yield group
            group = []
    if group:
        yield group


def analyse(
    frames: Iterable[RGBImage],
    options: FusionOptions,
    ctx: PipelineContext,
    analysis: Analysis,
    analysed: Callable[[int], None] = lambda frames: None,
) -> Analysis:
    """Detect the faces of every frame (``FRAME_GROUP`` at a time, the detection stage's
    own batched call) and take its signature, appending to ``analysis``;
    ``analysed(n)`` is called as each group of ``n`` frames is done (the progress)."""
    for group in frame_groups(frames):
        analysis.faces += pipeline.detect_images(group, options.detector, ctx)
        analysis.signatures += [frame_signature(f) for f in group]
        analysed(len(group))
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
    for group in frame_groups(frames):
        works = {
            i: frame_work(f, plan.frames[i], sources, options) for i, f in group if plan.frames[i]
        }
        if works:
            run_stages(list(works.values()), ctx, runner, only=lambda stage: stage.frames)
        for index, frame in group:
            work = works.get(index)
            fused = work.image if work is not None and work.error is None else None
            yield index, (fused if fused is not None else frame)


def sample_frames(frames: Sequence[int], most: int = 6) -> list[int]:
    """Up to ``most`` of ``frames``, evenly spread (a track's swapped frames whose fused face
    the report checks against its source)."""
    return [frames[i] for i in evenly(len(frames), most)]


# --------------------------------------------------------------------------- one video


MODERATION_SAMPLES = 8
"""Frames of the input (before any face model) and of the result that moderation sees."""


@dataclass
class VideoResult:
    """A fused video and what produced it."""

    path: Path
    info: VideoInfo
    chunks: int
    chunks_rendered: int  # the others were found rendered (``chunk_dir``)
    cuts: list[int]
    tracks: list[TrackReport]
    switches: int
    swapped: list[list[Box]]  # per frame, the boxes of the faces replaced
    swapped_sources: list[list[int]]  # per frame, the source of each (as ``swapped``)
    frame_failures: dict[str, int]
    moderation_flags: list[str]
    timings_ms: dict[str, float]


file_digest = sha256_file
"""A video's content key: the SHA-256 hex of its file."""


def chunk_name(
    video_digest: str,
    chunk: Chunk,
    plan: FacePlan,
    sources: Sequence[bytes],
    options: FusionOptions,
    payload: watermark.Payload | None = None,
) -> str:
    """A rendered chunk's file name, from all it depends on: the video, the chunk's
    frames, the plan's swaps in them (track, source, landmarks to 1/100 px), the sources,
    the fusion options and the watermark's payload (a chunk marked for another job is not
    this job's)."""
    digest = hashlib.sha256(f"{video_digest}:{chunk.start}:{chunk.stop}".encode())
    for data in sources:
        digest.update(hashlib.sha256(data).digest())
    digest.update(options.model_dump_json().encode())
    digest.update(DEFAULT_ENCODING.model_dump_json().encode())  # the join needs one encoding
    if payload is not None:
        digest.update(f"watermark:{payload.service:04x}:{payload.tag:08x}".encode())
    for index in range(chunk.start, chunk.stop):
        for swap in plan.frames[index]:
            digest.update(f"{index}:{swap.track}:{swap.source}:".encode())
            digest.update(np.round(swap.face.landmarks * 100).astype(np.int64).tobytes())
    return f"chunk-{chunk.index:05d}-{digest.hexdigest()[:32]}.mp4"


def evenly(n: int, most: int) -> list[int]:
    """Up to ``most`` indices spread evenly over ``range(n)``."""
    if n <= 0:
        return []
    return sorted({int(i) for i in np.linspace(0, n - 1, min(n, most)).round()})


def read_indices(
    path: VideoSource, indices: Sequence[int], pts: list[int], keyframes: list[int] | None = None
) -> list[RGBImage]:
    """The frames at ``indices`` (increasing), the file opened once: with the video's
    ``keyframes`` a seek only where one lies between two of them (``read_frames_at``)."""
    return [f.image for f in read_frames_at(path, indices, timestamps=pts, keyframes=keyframes)]


def render_chunk(
    path: VideoSource,
    out: Path,
    chunk: Chunk,
    *,
    info: VideoInfo,
    pts: list[int],
    plan: FacePlan,
    sources: Sequence[Source],
    options: FusionOptions,
    ctx: PipelineContext,
    runner: FrameRunner,
    keep: Callable[[int, RGBImage], None] = lambda index, image: None,
    payload: watermark.Payload | None = None,
) -> Path:
    """Decode ``chunk``'s frames, fuse them (``render``), watermark every one with
    ``payload`` (``watermark.VIDEO``; none without) and encode them, with their own pts, as
    the H.264 segment ``out``; ``keep(index, frame)`` sees every rendered frame (for the
    report's samples). Memory: one render group of frames."""
    end_pts = pts[chunk.stop] if chunk.stop < len(pts) else info.end_pts
    frames = (
        (f.index, f.image) for f in read_frames(path, chunk.start, chunk.stop, timestamps=pts)
    )
    with SegmentWriter(out, info=info, end_pts=end_pts) as writer:
        for index, fused in render(frames, plan, sources, options, ctx, runner):
            image = fused if payload is None else watermark.VIDEO.embed(fused, payload)
            keep(index, image)
            writer.write(image, pts[index])
    return out


def probe_and_moderate(
    sources: Sequence[bytes],
    video: Path,
    ctx: PipelineContext,
    limits: VideoLimits | None = None,
    references: Sequence[bytes] = (),
) -> Probed:
    """Probe ``video`` (typed errors for an unreadable or over-limit one), decode the
    sources and references and moderate them with ``MODERATION_SAMPLES`` frames, before
    any face model."""
    info, (pts, keyframes) = probe_frames(video, limits)
    images = [pipeline.decode_stage(data, ctx) for data in sources]
    refs = [pipeline.decode_stage(data, ctx) for data in references]
    samples = evenly(len(pts), MODERATION_SAMPLES)
    frames = {
        f"frame {i}": image
        for i, image in zip(samples, read_indices(video, samples, pts, keyframes), strict=True)
    }
    photos = {
        "source": images[0],
        **{f"source {i + 1}": image for i, image in enumerate(images[1:])},
        **{f"reference {i}": image for i, image in enumerate(refs)},
    }
    verdicts = pipeline.moderate_inputs_stage({**photos, **frames}, ctx)
    flags = pipeline.flagged_summaries(verdicts)
    return Probed(info, pts, images, samples, flags, refs, keyframes=keyframes)


def analyse_and_plan(
    video: Path,
    probed: Probed,
    options: FusionOptions,
    ctx: PipelineContext,
    chunk_s: float,
    analysed: Callable[[int], None] = lambda frames: None,
) -> Planned:
    """The analysis pass over every frame (``analysed(n)`` as each ``n`` are done), then
    the plan (``plan_video``; the sources' faces are detected once, by ``check_sources``)."""
    check_sources(probed, options, ctx)
    analysis = analyse_range(video, probed, 0, len(probed.pts), options, ctx, analysed)
    return plan_video(video, probed, analysis, options, ctx, chunk_s)


def check_sources(probed: Probed, options: FusionOptions, ctx: PipelineContext) -> None:
    """Fail early (before any frame is analysed) on a mapping that names what is not there
    or a source photo without a face (``NoFaceFound``); the faces found are kept
    (``probed.source_faces``) for the plan."""
    check_entries(options.mapping, len(probed.images), len(probed.references))
    probed.source_faces = sources_of(probed.images, options, ctx)


def frame_ranges(probed: Probed, chunk_s: float) -> list[tuple[int, int]]:
    """The frame ranges the analysis of ``probed``'s video is split into (one part each):
    ``video_analysis.analysis_ranges``, cut at multiples of ``FRAME_GROUP``."""
    info = probed.info
    seconds = [(p - info.first_pts) * float(info.time_base) for p in probed.pts]
    return analysis_ranges(seconds, chunk_s, FRAME_GROUP)


def analyse_range(
    video: VideoSource,
    probed: Probed,
    start: int,
    stop: int,
    options: FusionOptions,
    ctx: PipelineContext,
    analysed: Callable[[int], None] = lambda frames: None,
) -> Analysis:
    """The analysis of frames ``[start, stop)`` (decoding from the keyframe before
    ``start``; ``analysed(n)`` as each ``n`` are done); ``start`` a multiple of
    ``FRAME_GROUP`` keeps the single pass's batches."""
    frames = (f.image for f in read_frames(video, start, stop, timestamps=probed.pts))
    return analyse(frames, options, ctx, Analysis(), analysed)


def plan_video(
    video: VideoSource,
    probed: Probed,
    analysis: Analysis,
    options: FusionOptions,
    ctx: PipelineContext,
    chunk_s: float,
) -> Planned:
    """From the analysis of every frame: scene cuts, chunks (``chunk_s`` apart, moved to a
    cut nearby) and the face plan (a per-face mapping's: ``identities``, which reads a few
    frames of ``video``). The sources' faces are ``check_sources``' when it ran."""
    check_entries(options.mapping, len(probed.images), len(probed.references))
    found = probed.source_faces or sources_of(probed.images, options, ctx)
    references = sources_of(probed.references, options, ctx, role="reference")
    if len(analysis.faces) != len(probed.pts):
        raise ValueError(f"{len(analysis.faces)} frames analysed of {len(probed.pts)}")
    cuts = scene_cuts(analysis.signatures)
    info = probed.info
    seconds = [(p - info.first_pts) * float(info.time_base) for p in probed.pts]
    chunks = plan_chunks(seconds, cuts, target_s=chunk_s)
    people = (
        identities(video, probed.pts, references, ctx, probed.keyframes)
        if options.mapping
        else None
    )
    plan = plan_faces(
        analysis.faces, cuts, options.face, mapping=options.mapping, identities=people
    )
    return Planned(found, cuts, chunks, plan)


class Samples:
    """What the end of a job looks at of the rendered frames: the moderated frames, and the
    fused face of up to 6 swapped frames per track (identity check against its source),
    kept as its 150 x 150 dlib chip, not the frame (tracks come with the video's shots, so
    whole frames would make memory grow with its length)."""

    def __init__(
        self, plan: FacePlan, moderated: Iterable[int], pins: Mapping[str, str] | None = None
    ) -> None:
        self.plan, self.pins = plan, pins
        self.moderated = set(moderated)
        swapped_in: dict[int, list[int]] = {}
        for index, swaps in enumerate(plan.frames):
            for swap in swaps:
                swapped_in.setdefault(swap.track, []).append(index)
        self.wanted: dict[int, set[int]] = {}  # frame → the tracks sampled there
        for track, seen in swapped_in.items():
            for i in sample_frames(seen):
                self.wanted.setdefault(i, set()).add(track)
        self.checks: dict[int, list[tuple[RGBImage, int]]] = {}  # track: (chip, source)
        self.results: dict[int, RGBImage] = {}

    def keep(self, index: int, image: RGBImage) -> None:
        """Keep rendered frame ``index`` if it is a sample (``render_chunk``'s ``keep``)."""
        if index in self.moderated:
            self.results[index] = image
        for swap in self.plan.frames[index]:
            if swap.track in self.wanted.get(index, ()):
                chip = prepare_dlib(load_dlib_shaper(self.pins), image, swap.face)
                self.checks.setdefault(swap.track, []).append((chip, swap.source))

    def wants(self, chunk: Chunk) -> bool:
        """Whether a frame of ``chunk`` is a sample."""
        return bool((self.moderated | set(self.wanted)) & set(range(chunk.start, chunk.stop)))

    def read_from(self, segment: Path, chunk: Chunk) -> None:
        """Keep the samples of an already rendered ``segment`` (only read when it has any)."""
        if self.wants(chunk):
            for f in read_frames(segment, 0, chunk.frames):
                self.keep(chunk.start + f.index, f.image)

    def moderate_and_check(
        self, sources: Sequence[Source], ctx: PipelineContext
    ) -> tuple[list[str], dict[int, list[float]]]:
        """Moderation's flags on the sampled result frames, and each track's identity
        similarities."""
        named = {f"result frame {i}": image for i, image in sorted(self.results.items())}
        flags = pipeline.flagged_summaries(pipeline.moderate_results(named, ctx))
        return flags, identity_similarities(self.checks, sources, ctx)


def fuse_video(
    sources: Sequence[bytes],
    video: Path,
    out: Path,
    options: FusionOptions | None = None,
    ctx: PipelineContext | None = None,
    *,
    limits: VideoLimits | None = None,
    workdir: Path | None = None,
    chunk_dir: Path | None = None,
    chunk_s: float = 10.0,
    rendered_frame: Callable[[int], None] = lambda index: None,
    analysed_frames: Callable[[int], None] = lambda frames: None,
    references: Sequence[bytes] = (),
    payload: watermark.Payload | None = None,
) -> VideoResult:
    """Fuse the first source's face (a per-face mapping: each source's) into every frame
    of ``video`` where the plan puts it, in this process: probe → moderation of sampled
    frames → analysis → plan → render chunk by chunk → join with the audio → moderation
    of sampled result frames. Raises the job's typed error. (The ``fuse-video`` flow and
    its parts run the same steps as Prefect tasks: ``flows/video_steps.py``.)

    ``chunk_dir`` keeps rendered chunks under names made from their content (``chunk_name``):
    a second call for the same video, sources, plan and options renders only the chunks
    missing there (a re-dispatched attempt resumes). ``rendered_frame(index)`` is called as
    each frame is rendered and ``analysed_frames(n)`` as each ``n`` frames are analysed
    (where the flow counts its progress). ``references``: the
    reference photos a per-face mapping (``options.mapping``) names. ``payload``: the
    watermark every frame carries (``render_chunk``)."""
    options = options or FusionOptions()
    ctx = ctx or PipelineContext()
    timings: dict[str, float] = {}
    clock = _Clock(timings)
    with clock("probe"):
        probed = probe_and_moderate(sources, video, ctx, limits, references)
    info, pts = probed.info, probed.pts
    with clock("analyse"):
        planned = analyse_and_plan(video, probed, options, ctx, chunk_s, analysed_frames)
    plan = planned.plan
    runner = FrameRunner(ctx)
    samples = Samples(plan, probed.samples, ctx.pins)
    video_digest = file_digest(video)
    rendered = 0

    def keep(index: int, image: RGBImage) -> None:
        samples.keep(index, image)
        rendered_frame(index)

    with tempfile.TemporaryDirectory(dir=workdir) as tmp, clock("render"):
        keep_dir = chunk_dir or Path(tmp)
        keep_dir.mkdir(parents=True, exist_ok=True)
        segments = []
        for c in planned.chunks:
            segment = keep_dir / chunk_name(video_digest, c, plan, sources, options, payload)
            if segment.exists():  # rendered by an earlier attempt: only its samples are read
                samples.read_from(segment, c)
            else:
                partial = Path(tmp) / f"{segment.name}.partial"
                render_chunk(
                    video, partial, c, info=info, pts=pts, plan=plan, sources=planned.sources,
                    options=options, ctx=ctx, runner=runner, keep=keep, payload=payload,
                )  # fmt: skip
                partial.replace(segment)  # whole chunks only: a killed render leaves none
                rendered += 1
            segments.append(segment)
        with clock("join"):
            joined = join_segments(segments, video, out, source_info=info)
    with clock("moderate_result"):
        flags, similarities = samples.moderate_and_check(planned.sources, ctx)
    return VideoResult(
        path=out,
        info=joined,
        chunks=len(planned.chunks),
        chunks_rendered=rendered,
        cuts=planned.cuts,
        tracks=track_reports(plan, similarities),
        switches=plan.switches,
        swapped=[[swap.face.box for swap in swaps] for swaps in plan.frames],
        swapped_sources=[[swap.source for swap in swaps] for swaps in plan.frames],
        frame_failures=dict(runner.failures),
        moderation_flags=probed.flags + flags,
        timings_ms=timings,
    )


def identity_similarities(
    checks: dict[int, list[tuple[RGBImage, int]]],
    sources: Sequence[Source],
    ctx: PipelineContext,
) -> dict[int, list[float]]:
    """Per track, the identity similarity of each sampled fused face (its dlib chip, with
    its source's index) to its source (the quality report's embedder and measure)."""
    source_vectors = embed_with_dlib(
        [(s.image, s.face) for s in sources], device=ctx.device, pins=ctx.pins
    )
    out: dict[int, list[float]] = {}
    for track, samples in checks.items():
        vectors = embed_chips([chip for chip, _ in samples], device=ctx.device, pins=ctx.pins)
        out[track] = [
            similarity(v, source_vectors[source])
            for v, (_, source) in zip(vectors, samples, strict=True)
        ]
    return out


class _Clock:
    """Milliseconds per named step, into ``timings``."""

    def __init__(self, timings: dict[str, float]) -> None:
        self.timings = timings

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.timings[name] = self.timings.get(name, 0.0) + (time.perf_counter() - start) * 1e3
