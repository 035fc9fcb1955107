"""5-point similarity alignment to the ArcFace template, at any crop size.

``template_for`` follows InsightFace's ``estimate_norm`` rule: sizes that are multiples of
112 scale the 112 template; multiples of 128 use the 128-based framing (scale size/128 and
an x offset of 8 * scale) that ``inswapper_128`` expects; any other size scales the 112
template. The similarity is a least-squares Umeyama fit in numpy.
"""

from __future__ import annotations

from typing import Literal

import cv2
import numpy as np
import numpy.typing as npt

from tasks.errors import InvalidInput
from tasks.types import AlignedFace, Face, FloatArray, RGBImage

ARCFACE_TEMPLATE_112: FloatArray = np.array(
    [
        [38.2946, 51.6963],
        [73.5318, 51.5014],
        [56.0252, 71.7366],
        [41.5493, 92.3655],
        [70.7299, 92.2041],
    ],
    dtype=np.float32,
)
"""The 5 ArcFace landmarks (see ``tasks.types.LANDMARK_NAMES``) in a 112 x 112 crop."""

DEFAULT_CROP_SIZE = 256
"""A multiple of 128: the same framing as ``inswapper_128`` at twice its resolution."""

_DOWNSCALE_BELOW = 0.5
"""Below this warp scale the face region is first shrunk with area averaging (no aliasing)."""


def template_for(size: int, *, base: Literal[112, 128] | None = None) -> FloatArray:
    """The template in a ``size`` x ``size`` crop; ``base`` overrides InsightFace's rule."""
    if size <= 0:
        raise ValueError(f"crop size must be positive, not {size}")
    if base is None:
        base = 128 if size % 112 != 0 and size % 128 == 0 else 112
    ratio = size / base
    template = ARCFACE_TEMPLATE_112.astype(np.float64) * ratio
    if base == 128:
        template[:, 0] += 8.0 * ratio
    return template.astype(np.float32)


def estimate_similarity(src: npt.ArrayLike, dst: npt.ArrayLike) -> FloatArray:
    """The 2 x 3 similarity (rotation, uniform scale, translation) that best maps src to dst.

    Umeyama (1991) least squares, no reflection. Raises ``InvalidInput`` when the source
    points coincide (no scale can be estimated).
    """
    s = np.asarray(src, dtype=np.float64)
    d = np.asarray(dst, dtype=np.float64)
    if s.ndim != 2 or s.shape[1] != 2 or s.shape != d.shape or len(s) < 2:
        raise ValueError(f"expected two (N, 2) point sets, got {s.shape} and {d.shape}")
    mean_s, mean_d = s.mean(axis=0), d.mean(axis=0)
    cs, cd = s - mean_s, d - mean_d
    var_s = float((cs**2).sum() / len(s))
    if not np.isfinite(var_s) or var_s < 1e-12:
        raise InvalidInput("The face landmarks are degenerate.", detail="zero spread")
    u, sigma, vt = np.linalg.svd(cd.T @ cs / len(s))
    signs = np.ones(2)
    if np.linalg.det(u) * np.linalg.det(vt) < 0:
        signs[1] = -1.0
    rotation = (u * signs) @ vt
    scale = float((sigma * signs).sum() / var_s)
    matrix = np.empty((2, 3))
    matrix[:, :2] = scale * rotation
    matrix[:, 2] = mean_d - scale * rotation @ mean_s
    return matrix.astype(np.float32)


def invert_affine(matrix: npt.ArrayLike) -> FloatArray:
    """The inverse of a 2 x 3 affine transform."""
    m = np.asarray(matrix, dtype=np.float64)
    linear = np.linalg.inv(m[:, :2])
    out = np.empty((2, 3))
    out[:, :2] = linear
    out[:, 2] = -linear @ m[:, 2]
    return out.astype(np.float32)


def transform_points(points: npt.ArrayLike, matrix: npt.ArrayLike) -> FloatArray:
    """Apply a 2 x 3 affine transform to (N, 2) points."""
    p = np.asarray(points, dtype=np.float64)
    m = np.asarray(matrix, dtype=np.float64)
    return (p @ m[:, :2].T + m[:, 2]).astype(np.float32)


def warp_scale(matrix: npt.ArrayLike) -> float:
    """The uniform scale of a similarity (sqrt of the linear part's determinant)."""
    m = np.asarray(matrix, dtype=np.float64)
    return float(np.sqrt(abs(np.linalg.det(m[:, :2]))))


def align_face(image: RGBImage, face: Face, size: int = DEFAULT_CROP_SIZE) -> AlignedFace:
    """Warp ``face`` to the template of a ``size`` x ``size`` crop (edges replicated)."""
    matrix = estimate_similarity(face.landmarks, template_for(size))
    crop = _warp_to_crop(image, matrix, size)
    return AlignedFace(
        crop=crop,
        matrix=matrix,
        inverse=invert_affine(matrix),
        size=size,
        landmarks=transform_points(face.landmarks, matrix),
    )


def warp_to_crop(image: RGBImage, matrix: FloatArray, size: int) -> RGBImage:
    """The ``size`` x ``size`` crop that ``matrix`` (image → crop) frames, edges replicated."""
    return _warp_to_crop(image, matrix, size)


def _warp_to_crop(image: RGBImage, matrix: FloatArray, size: int) -> RGBImage:
    """``cv2.warpAffine``, shrinking a large face by area averaging first (warps alias)."""
    scale = warp_scale(matrix)
    m = matrix.astype(np.float64)
    if scale < _DOWNSCALE_BELOW:
        height, width = image.shape[:2]
        corners = np.array([[0, 0], [size, 0], [0, size], [size, size]], dtype=np.float64)
        region = transform_points(corners, invert_affine(m))
        x0, y0 = np.maximum(np.floor(region.min(axis=0)) - 2, 0).astype(int)
        x1, y1 = np.minimum(np.ceil(region.max(axis=0)) + 2, (width, height)).astype(int)
        if x1 - x0 >= 2 and y1 - y0 >= 2:
            new_w = max(1, round((x1 - x0) * scale))
            new_h = max(1, round((y1 - y0) * scale))
            image = np.asarray(
                cv2.resize(image[y0:y1, x0:x1], (new_w, new_h), interpolation=cv2.INTER_AREA),
                dtype=np.uint8,
            )
            # small → image (cv2.resize's pixel-centre convention), then image → crop by m.
            sx, sy = (x1 - x0) / new_w, (y1 - y0) / new_h
            back = np.array(
                [[sx, 0.0, x0 + 0.5 * sx - 0.5], [0.0, sy, y0 + 0.5 * sy - 0.5], [0.0, 0.0, 1.0]]
            )
            m = m @ back
    crop = cv2.warpAffine(
        image, m, (size, size), flags=cv2.INTER_LINEAR, borderMode=cv2.BORDER_REPLICATE
    )
    return np.ascontiguousarray(crop, dtype=np.uint8)
