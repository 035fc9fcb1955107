"""Sample photos from installed packages (no network), for the demo, tests and benchmarks."""

from __future__ import annotations

import importlib.util
import io
from functools import cache
from pathlib import Path

import numpy as np
from PIL import Image

from tasks.types import Face, RGBImage


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.submodule_search_locations, f"{name} is not installed"
    return Path(next(iter(spec.submodule_search_locations)))


def grace_hopper_path() -> Path:
    """matplotlib's sample ``grace_hopper.jpg`` (one face)."""
    import matplotlib.cbook

    return Path(str(matplotlib.cbook.get_sample_data("grace_hopper.jpg", asfileobj=False)))


def t1_path() -> Path:
    """insightface's ``t1.jpg`` (six faces); the package is located, never imported."""
    return _package_dir("insightface") / "data" / "images" / "t1.jpg"


@cache
def astronaut_rgb() -> RGBImage:
    """skimage's astronaut (Eileen Collins, one face), 512 x 512 RGB."""
    from skimage import data

    return np.ascontiguousarray(data.astronaut(), dtype=np.uint8)


@cache
def grace_hopper_rgb() -> RGBImage:
    with Image.open(grace_hopper_path()) as im:
        return np.asarray(im.convert("RGB"), dtype=np.uint8)


@cache
def t1_rgb() -> RGBImage:
    with Image.open(t1_path()) as im:
        return np.asarray(im.convert("RGB"), dtype=np.uint8)


@cache
def no_face_rgb() -> RGBImage:
    """skimage's coffee cup: a photo without people."""
    from skimage import data

    return np.ascontiguousarray(data.coffee(), dtype=np.uint8)


@cache
def colorwheel_rgb() -> RGBImage:
    """skimage's synthetic colour wheel, 371 x 370: NudeNet's 320n detector flags it
    (``BUTTOCKS_EXPOSED``, 0.83), so moderation tests can be blocked by a harmless image."""
    from skimage import data

    return np.ascontiguousarray(data.colorwheel(), dtype=np.uint8)


CROP_FACE_WIDTH = 200
"""Width in pixels of the face in ``face_crop``."""
CROP_MARGIN = 0.8
"""``face_crop`` takes the face box grown by this fraction of its size on every side."""


def face_crop(image: RGBImage, face: Face) -> RGBImage:
    """One face of a group photo as a photo of its own: its box grown by ``CROP_MARGIN``,
    upscaled so the face is ``CROP_FACE_WIDTH`` wide (bicubic)."""
    import cv2

    box = face.box
    grow_x, grow_y = box.width * CROP_MARGIN, box.height * CROP_MARGIN
    height, width = image.shape[:2]
    x0, y0 = max(0, int(box.x1 - grow_x)), max(0, int(box.y1 - grow_y))
    x1, y1 = min(width, int(box.x2 + grow_x)), min(height, int(box.y2 + grow_y))
    region = image[y0:y1, x0:x1]
    scale = CROP_FACE_WIDTH / max(box.width, 1.0)
    size = (round(region.shape[1] * scale), round(region.shape[0] * scale))
    return np.asarray(cv2.resize(region, size, interpolation=cv2.INTER_CUBIC), dtype=np.uint8)


def encode(image: RGBImage, fmt: str = "JPEG", **kwargs: object) -> bytes:
    """Encode an RGB array with Pillow."""
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format=fmt, **kwargs)
    return buf.getvalue()


def astronaut_jpeg_bytes() -> bytes:
    return encode(astronaut_rgb(), "JPEG", quality=95)


def grace_hopper_jpeg_bytes() -> bytes:
    return grace_hopper_path().read_bytes()


def t1_jpeg_bytes() -> bytes:
    return t1_path().read_bytes()


def no_face_jpeg_bytes() -> bytes:
    return encode(no_face_rgb(), "JPEG", quality=90)


@cache
def flat_png(width: int, height: int, level: int = 128) -> bytes:
    """A PNG of one grey level: a few dozen KB that decode to ``width x height`` RGB pixels
    (8000 x 5000: 40 MP, 120 MB decoded, from ≈ 40 KB; the memory amplification of issue 22)."""
    buf = io.BytesIO()
    Image.new("L", (width, height), level).save(buf, format="PNG")
    return buf.getvalue()
