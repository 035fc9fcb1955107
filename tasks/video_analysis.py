"""The analysis of a video in frame ranges: what each frame holds (faces, signature), the
ranges a video's analysis is split into (one ``fuse-video-part`` each, on any GPU worker),
and the compact stored form of one range's result (NumPy's ``.npz``, no pickle).

The analysis of a frame depends on that frame only (the detector's batches are
``tasks.video.FRAME_GROUP`` frames, and the ranges start at multiples of it, so every
batch is the one a single pass makes): the ranges' results, concatenated, are the single
pass's, and scene cuts and the face plan made from them are the same.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from tasks.types import Box, Face, FloatArray
from tasks.video_plan import plan_chunks

ANALYSIS_FORMAT = 1
"""Version of the stored form (part of every range's name)."""


@dataclass
class Analysis:
    """What the analysis pass found: each frame's faces (largest first) and signature."""

    faces: list[list[Face]] = field(default_factory=list)
    signatures: list[FloatArray] = field(default_factory=list)


def analysis_ranges(times_s: Sequence[float], chunk_s: float, group: int) -> list[tuple[int, int]]:
    """The frame ranges ``[start, stop)`` a video's analysis is split into: about
    ``chunk_s`` seconds each (``plan_chunks`` without cuts: ``times_s`` is each frame's
    time), every start a multiple of ``group`` (the analysis batch)."""
    n = len(times_s)
    starts = {0} | {
        round(c.start / group) * group for c in plan_chunks(times_s, (), target_s=chunk_s)
    }
    edges = [*sorted(s for s in starts if s < n), n]
    return [(a, b) for a, b in itertools.pairwise(edges) if a < b]


def merged(parts: Sequence[Analysis]) -> Analysis:
    """The ranges' analyses, in order, as one."""
    whole = Analysis()
    for part in parts:
        whole.faces += part.faces
        whole.signatures += part.signatures
    return whole


def range_name(
    video_digest: str, start: int, stop: int, detector: str, max_side: int,
    pins: Mapping[str, str] | None,
) -> str:  # fmt: skip
    """A range's stored name, from all its analysis depends on: the video, the frames, the
    detector, its input size and the models' pins."""
    made = {"v": ANALYSIS_FORMAT, "detector": detector, "max_side": max_side,
            "pins": dict(sorted((pins or {}).items()))}  # fmt: skip
    digest = hashlib.sha256(f"{video_digest}:{start}:{stop}:".encode())
    digest.update(json.dumps(made, sort_keys=True).encode())
    return f"analysis-{start:06d}-{stop:06d}-{digest.hexdigest()[:32]}.npz"


def encode(analysis: Analysis) -> bytes:
    """A range's analysis as ``.npz`` bytes: faces per frame, boxes, scores (float64, as
    found), landmarks (float32) and signatures."""
    faces = [f for frame in analysis.faces for f in frame]
    boxes = np.array([[f.box.x1, f.box.y1, f.box.x2, f.box.y2] for f in faces], np.float64)
    out = io.BytesIO()
    np.savez(
        out,
        counts=np.array([len(frame) for frame in analysis.faces], np.int64),
        boxes=boxes.reshape(-1, 4),
        scores=np.array([f.score for f in faces], np.float64),
        landmarks=np.array([f.landmarks for f in faces], np.float32).reshape(-1, 5, 2),
        signatures=np.array(analysis.signatures, np.float32),
    )
    return out.getvalue()


def decode(data: bytes) -> Analysis:
    """The analysis ``encode`` stored (arrays only: ``allow_pickle=False``)."""
    with np.load(io.BytesIO(data), allow_pickle=False) as stored:
        counts, boxes = stored["counts"], stored["boxes"]
        scores, landmarks, signatures = stored["scores"], stored["landmarks"], stored["signatures"]
    faces = [
        Face(Box(*(float(v) for v in boxes[i])), float(scores[i]), landmarks[i].copy())
        for i in range(len(scores))
    ]
    ends = np.cumsum(counts).tolist()
    per_frame = [faces[end - int(n) : end] for n, end in zip(counts, ends, strict=True)]
    return Analysis(per_frame, [s.copy() for s in signatures])
