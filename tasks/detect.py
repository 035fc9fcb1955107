"""Face detection dispatcher: picks the detector, downsizes large images, maps back, selects faces.

``detect_faces`` → ``detect_with_<model>`` (tasks.mtcnn / tasks.scrfd) → ``Face`` objects in
the coordinates of the image passed in.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict, Unpack

import cv2
import numpy as np

from tasks.batch import in_chunks, in_flight
from tasks.errors import InvalidInput, NoFaceFound
from tasks.options import DetectorName, FaceChoice
from tasks.types import Face, RGBImage

DEFAULT_DETECT_MAX_SIDE = 1024
"""Longest side the detector sees; larger images are detected on a downscaled copy."""


CPU_MTCNN_BATCH = 8
"""Most images in one MTCNN batch on the CPU. Measured on the 2-core machine, 32 jobs'
source and target photos in one call, sizes alternating in one process, median ms per job
of six: 8 images 109-114, 4: 121, 16: 138, 2: 134, all 64 at once 174 (a batch's pyramid
tensors outgrow the caches). On a GPU every image goes in one batch."""


class DetectOptions(TypedDict, total=False):
    """The keyword options of ``detect_faces`` (their defaults: ``detect_faces_batch``)."""

    detector: DetectorName
    device: str
    model_dir: str | Path | None
    pins: Mapping[str, str] | None
    max_side: int
    min_face_size: int | None


def detect_faces(image: RGBImage, **options: Unpack[DetectOptions]) -> list[Face]:
    """All faces in ``image``, largest first, in ``image``'s pixel coordinates
    (``min_face_size``: smallest face MTCNN looks for, in the detector's pixels)."""
    return detect_faces_batch([image], **options)[0]


def detect_faces_batch(
    images: Sequence[RGBImage],
    *,
    detector: DetectorName = "mtcnn",
    device: str = "cpu",
    model_dir: str | Path | None = None,
    pins: Mapping[str, str] | None = None,
    max_side: int = DEFAULT_DETECT_MAX_SIDE,
    min_face_size: int | None = None,
    threads: int = 1,
) -> list[list[Face]]:
    """``detect_faces`` of several images; MTCNN runs them as one batch (its R-Net and
    O-Net on every image's crops at once, P-Net per pyramid level of same-size images), on
    the CPU in batches of at most ``CPU_MTCNN_BATCH`` images. ``threads``: how many of
    those batches (SCRFD: images) are in flight at once."""
    scales = [min(1.0, max_side / max(image.shape[:2])) for image in images]
    work = [_downscale(image, scale) for image, scale in zip(images, scales, strict=True)]
    call = DetectCall(device, model_dir, pins, min_face_size, threads)
    found = DETECTORS[detector].detect(work, call)
    return [
        sorted(
            faces if scale >= 1.0 else [face.scaled(1.0 / scale) for face in faces],
            key=lambda f: f.box.area,
            reverse=True,
        )
        for faces, scale in zip(found, scales, strict=True)
    ]


@dataclass(frozen=True, slots=True)
class DetectCall:
    """Where and how a detector runs on a batch of images."""

    device: str
    model_dir: str | Path | None
    pins: Mapping[str, str] | None
    min_face_size: int | None  # MTCNN's smallest face, in the detector's pixels
    threads: int  # calls in flight


def _detect_with_mtcnn(images: list[RGBImage], call: DetectCall) -> list[list[Face]]:
    from tasks.mtcnn import DEFAULT_MIN_FACE_SIZE, detect_batch_with_mtcnn

    # On the CPU: batches of at most CPU_MTCNN_BATCH, and at least one per thread (a job's
    # source and target go in two calls at once: 120 -> 75 ms on two cores); on a GPU one
    # batch.
    smallest = call.min_face_size or DEFAULT_MIN_FACE_SIZE
    on_cpu = call.device == "cpu"
    return in_chunks(
        lambda chunk: detect_batch_with_mtcnn(chunk, device=call.device, min_face_size=smallest),
        images,
        threads=call.threads if on_cpu else 1,
        most=CPU_MTCNN_BATCH if on_cpu else None,
    )


def _detect_with_scrfd(images: list[RGBImage], call: DetectCall) -> list[list[Face]]:
    from tasks.scrfd import detect_with_scrfd

    return in_flight(
        lambda image: detect_with_scrfd(
            image, device=call.device, model_dir=call.model_dir, pins=call.pins
        ),
        images,
        threads=call.threads,
    )


@dataclass(frozen=True, slots=True)
class Detector:
    """One face detector: how it runs on a batch of images (faces in the images' own
    pixels, any order) and whether it can search a region of a photo at a chosen scale
    (MTCNN's pyramid; SCRFD sees a fixed-size input)."""

    detect: Callable[[list[RGBImage], DetectCall], list[list[Face]]]
    searches_region: bool


DETECTORS: dict[DetectorName, Detector] = {
    "mtcnn": Detector(_detect_with_mtcnn, searches_region=True),
    "scrfd": Detector(_detect_with_scrfd, searches_region=False),
}
"""Every detector a job may choose (``tasks.options.DetectorName``)."""


def _downscale(image: RGBImage, scale: float) -> RGBImage:
    if scale >= 1.0:
        return image
    height, width = image.shape[:2]
    size = (max(1, round(width * scale)), max(1, round(height * scale)))
    return np.asarray(cv2.resize(image, size, interpolation=cv2.INTER_AREA), dtype=np.uint8)


def select_faces(faces: list[Face], choice: FaceChoice, *, role: str = "target") -> list[Face]:
    """The faces a job replaces: the largest, all of them, or one by index (largest first)."""
    if not faces:
        raise NoFaceFound(f"No face was found in the {role} image.")
    if choice == "largest":
        return [faces[0]]
    if choice == "all":
        return list(faces)
    assert isinstance(choice, int)
    if choice >= len(faces):
        raise InvalidInput(
            f"Face index {choice} is out of range: the {role} image has {len(faces)} face(s)."
        )
    return [faces[choice]]
