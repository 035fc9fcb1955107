"""Real detections on the sample photos (MTCNN, detected once per test session)."""

from __future__ import annotations

from functools import cache

from tasks.mtcnn import detect_with_mtcnn
from tasks.types import Face
from tests.samples import astronaut_rgb, grace_hopper_rgb


@cache
def astronaut_face() -> Face:
    """The one face in skimage's astronaut."""
    faces = detect_with_mtcnn(astronaut_rgb(), device="cpu")
    assert len(faces) == 1, faces
    return faces[0]


@cache
def grace_hopper_face() -> Face:
    """The one face in matplotlib's grace_hopper.jpg."""
    faces = detect_with_mtcnn(grace_hopper_rgb(), device="cpu")
    assert len(faces) == 1, faces
    return faces[0]
