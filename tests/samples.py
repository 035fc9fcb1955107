"""Sample photos for tests: re-exported from ``faceflow.samples`` (one implementation)."""

from faceflow.samples import (
    astronaut_jpeg_bytes,
    astronaut_rgb,
    colorwheel_rgb,
    encode,
    face_crop,
    flat_png,
    grace_hopper_jpeg_bytes,
    grace_hopper_path,
    grace_hopper_rgb,
    no_face_jpeg_bytes,
    no_face_rgb,
    t1_jpeg_bytes,
    t1_path,
    t1_rgb,
)

__all__ = [
    "astronaut_jpeg_bytes",
    "astronaut_rgb",
    "colorwheel_rgb",
    "encode",
    "face_crop",
    "flat_png",
    "grace_hopper_jpeg_bytes",
    "grace_hopper_path",
    "grace_hopper_rgb",
    "no_face_jpeg_bytes",
    "no_face_rgb",
    "t1_jpeg_bytes",
    "t1_path",
    "t1_rgb",
]
