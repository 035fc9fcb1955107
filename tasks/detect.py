"""Face detection dispatcher: picks the detector, downsizes large images, maps back, selects faces.

``detect_faces`` → ``detect_with_<model>`` (tasks.mtcnn / tasks.scrfd) → ``Face`` objects in
the coordinates of the image passed in.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import cv2
import numpy as np

from tasks.errors import InvalidInput, NoFaceFound
from tasks.options import DetectorName, FaceChoice
from tasks.types import Face, RGBImage

DEFAULT_DETECT_MAX_SIDE = 1024
"""Longest side the detector sees; larger images are detected on a downscaled copy."""


def detect_faces(
    image: RGBImage,
    *,
    detector: DetectorName = "mtcnn",
    device: str = "cpu",
    model_dir: str | Path | None = None,
    pins: Mapping[str, str] | None = None,
    max_side: int = DEFAULT_DETECT_MAX_SIDE,
) -> list[Face]:
    """All faces in ``image``, largest first, in ``image``'s pixel coordinates."""
    height, width = image.shape[:2]
    scale = min(1.0, max_side / max(height, width))
    work = image
    if scale < 1.0:
        size = (max(1, round(width * scale)), max(1, round(height * scale)))
        work = np.asarray(cv2.resize(image, size, interpolation=cv2.INTER_AREA), dtype=np.uint8)
    if detector == "mtcnn":
        from tasks.mtcnn import detect_with_mtcnn

        faces = detect_with_mtcnn(work, device=device)
    elif detector == "scrfd":
        from tasks.scrfd import detect_with_scrfd

        faces = detect_with_scrfd(work, device=device, model_dir=model_dir, pins=pins)
    else:  # pragma: no cover - the Literal type makes this unreachable for typed callers
        raise InvalidInput(f"Unknown detector {detector!r}.")
    if scale < 1.0:
        faces = [face.scaled(1.0 / scale) for face in faces]
    return sorted(faces, key=lambda f: f.box.area, reverse=True)


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
