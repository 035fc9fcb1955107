"""Value types of the pipeline: boxes, landmarks, faces, aligned crops, results."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from tasks.report import QualityReport

RGBImage = npt.NDArray[np.uint8]
"""An H x W x 3 RGB image, uint8."""

FloatArray = npt.NDArray[np.float32]

LANDMARK_NAMES: tuple[str, ...] = ("left_eye", "right_eye", "nose", "mouth_left", "mouth_right")
"""Order of the 5 landmarks; "left" is the viewer's left (smaller x), as in the ArcFace template."""


@dataclass(frozen=True, slots=True)
class Box:
    """An axis-aligned box in pixel coordinates (x1, y1) top-left, (x2, y2) bottom-right."""

    x1: float
    y1: float
    x2: float
    y2: float

    @property
    def width(self) -> float:
        return max(0.0, self.x2 - self.x1)

    @property
    def height(self) -> float:
        return max(0.0, self.y2 - self.y1)

    @property
    def area(self) -> float:
        return self.width * self.height

    def iou(self, other: Box) -> float:
        """Intersection over union with another box."""
        inter = Box(
            max(self.x1, other.x1),
            max(self.y1, other.y1),
            min(self.x2, other.x2),
            min(self.y2, other.y2),
        ).area
        union = self.area + other.area - inter
        return inter / union if union > 0 else 0.0

    def contains(self, x: float, y: float, margin: float = 0.0) -> bool:
        """Whether a point lies inside the box grown by ``margin`` pixels."""
        return (
            self.x1 - margin <= x <= self.x2 + margin and self.y1 - margin <= y <= self.y2 + margin
        )

    def scaled(self, factor: float) -> Box:
        """The box with every coordinate multiplied by ``factor``."""
        return Box(self.x1 * factor, self.y1 * factor, self.x2 * factor, self.y2 * factor)


@dataclass(frozen=True, slots=True)
class Face:
    """One detected face: box, confidence and 5 landmarks (see ``LANDMARK_NAMES``)."""

    box: Box
    score: float
    landmarks: FloatArray  # shape (5, 2), float32, pixel coordinates (x, y)

    def scaled(self, factor: float) -> Face:
        """The face with box and landmarks scaled by ``factor``."""
        return Face(
            self.box.scaled(factor), self.score, (self.landmarks * factor).astype(np.float32)
        )


@dataclass(frozen=True, slots=True)
class AlignedFace:
    """A face warped to the canonical template, and the transform that did it."""

    crop: RGBImage  # size x size x 3
    matrix: FloatArray  # 2 x 3 affine, image → crop
    inverse: FloatArray  # 2 x 3 affine, crop → image
    size: int
    landmarks: FloatArray  # landmarks in crop coordinates (5, 2)


@dataclass(slots=True)
class StageTimings:
    """Wall-clock milliseconds per stage."""

    ms: dict[str, float] = field(default_factory=dict)

    def add(self, stage: str, elapsed_ms: float) -> None:
        self.ms[stage] = self.ms.get(stage, 0.0) + elapsed_ms

    @property
    def total_ms(self) -> float:
        return sum(self.ms.values())


@dataclass(frozen=True, slots=True)
class FusionResult:
    """The encoded result of one fusion and what produced it."""

    data: bytes
    content_type: str
    width: int
    height: int
    faces_replaced: int
    source_faces: int
    target_faces: int
    device: str
    timings_ms: dict[str, float]
    quality: QualityReport | None = None
    moderation_flags: tuple[str, ...] = ()  # report-only moderation: what was flagged
    marks: tuple[str, ...] = ()  # what marks the file carries: "c2pa", "watermark"
