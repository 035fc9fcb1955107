"""What a video job's steps hand each other (kept in its stored plan,
``flows.video_store``) and the report per track: light (numpy, PyAV's ``VideoInfo``, the
face plan), so the ``fuse-video`` coordinator on the control pool reads a plan and
writes the report without importing the pipeline or its models. ``tasks.video`` makes
them."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tasks.types import Face, RGBImage
from tasks.video_io import VideoInfo
from tasks.video_plan import Chunk, FacePlan


@dataclass(frozen=True, slots=True)
class Source:
    """A source photo of a video job and its largest face."""

    image: RGBImage
    face: Face


@dataclass
class Probed:
    """A video after probe and input moderation: its info, every frame's pts, the decoded
    source photos (and a mapping's reference photos), the frames moderation saw and what
    it flagged, the keyframes' pts and the sources' faces."""

    info: VideoInfo
    pts: list[int]
    images: list[RGBImage]
    samples: list[int]
    flags: list[str]
    references: list[RGBImage] = field(default_factory=list)
    keyframes: list[int] = field(default_factory=list)
    """The keyframes' pts (sampled frames are read with a seek only past one)."""
    source_faces: list[Source] = field(default_factory=list)
    """The sources' largest faces, once ``tasks.video.check_sources`` found them (the plan
    takes them from here rather than detecting them again)."""


@dataclass
class Planned:
    """A video's sources' faces, scene cuts, chunks and face plan."""

    sources: list[Source]
    cuts: list[int]
    chunks: list[Chunk]
    plan: FacePlan


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
    source: int | None = None  # the source it was swapped with (None: never swapped)


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
                source=plan.source_of(track.id),
            )
        )
    return out
