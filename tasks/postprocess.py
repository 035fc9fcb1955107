"""Colour transfer, face masks, blending a fused crop back into the target, sharpening.

Every function here touches only the region around the face: outside the support of the
mask (mapped into the target image) the output is bit-identical to the target. numpy and
OpenCV on purpose: at crop sizes (256 x 256) and face-sized regions they beat torch on
the CPU, and a GPU would spend more on transfers than on the maths.
"""

from __future__ import annotations

from typing import Literal

import cv2
import numpy as np
import numpy.typing as npt

from tasks.align import warp_scale
from tasks.options import BlendMode
from tasks.types import AlignedFace, FloatArray, RGBImage

CloneMode = Literal["normal", "mixed"]

# The convex region of the face mask, in a frame spanned by the landmarks: u in eye
# distances along the eye line from the eyes' midpoint, v in eye-to-mouth distances along
# the line from the eyes' midpoint to the mouth's. (0, 0) are the eyes, (0, 1) the mouth.
_MASK_OUTLINE = np.array(
    [
        [-0.95, -0.55],  # brow, outer end
        [-0.50, -0.72],  # brow, top
        [0.50, -0.72],
        [0.95, -0.55],
        [1.08, 0.15],  # cheekbones
        [1.00, 0.70],  # cheeks
        [0.72, 1.22],  # jaw
        [0.30, 1.48],  # chin
        [-0.30, 1.48],
        [-0.72, 1.22],
        [-1.00, 0.70],
        [-1.08, 0.15],
    ]
)
_MASK_FLOOR = 1e-3
"""Mask values below this are set to 0 (a blend cannot move a pixel by even one level), and
face_mask's values above 1 minus this to 1."""


def face_mask(
    size: int,
    landmarks_in_crop: npt.ArrayLike,
    *,
    erode: float = 0.03,
    blur: float = 0.025,
) -> FloatArray:
    """A ``size`` x ``size`` float32 mask in [0, 1] covering brows to chin.

    The region is the convex hull of an outline placed by the 5 landmarks, shrunk by
    ``erode`` and feathered by a Gaussian of sigma ``blur``, both fractions of ``size``
    (at the defaults the mask is ~0 on the outline and 1 well inside it).
    """
    lm = np.asarray(landmarks_in_crop, dtype=np.float64)
    eyes = (lm[0] + lm[1]) / 2.0
    across = lm[1] - lm[0]
    down = (lm[3] + lm[4]) / 2.0 - eyes
    outline = eyes + _MASK_OUTLINE[:, :1] * across + _MASK_OUTLINE[:, 1:] * down
    hull = cv2.convexHull(np.rint(outline * 16).astype(np.int32))
    binary = np.zeros((size, size), dtype=np.uint8)
    cv2.fillConvexPoly(binary, hull, 255, lineType=cv2.LINE_AA, shift=4)
    radius = round(erode * size)
    if radius > 0:
        kernel = cv2.getStructuringElement(cv2.MORPH_ELLIPSE, (2 * radius + 1, 2 * radius + 1))
        binary = np.asarray(cv2.erode(binary, kernel), dtype=np.uint8)
    mask = binary.astype(np.float32) / 255.0
    sigma = blur * size
    if sigma > 0:
        mask = np.asarray(
            cv2.GaussianBlur(mask, (0, 0), sigma, borderType=cv2.BORDER_CONSTANT), dtype=np.float32
        )
    mask[mask < _MASK_FLOOR] = 0.0
    mask[mask > 1.0 - _MASK_FLOOR] = 1.0
    return mask


SHADING_SCALE = 0.35
"""Sigma of a face's shading (its light) low-pass, in eye distances (≈ 25 px in a 256 crop):
what is broader than about a third of the eye spacing is the light, what is finer the
features and texture. Finer splits carry more of the target's shading and less of the
source's identity (``docs/benchmarks.md``)."""


def eye_distance(landmarks: npt.ArrayLike) -> float:
    """Distance between the eye centres (landmarks 0 and 1)."""
    points = np.asarray(landmarks, dtype=np.float64)
    return float(np.linalg.norm(points[1] - points[0]))


def low_pass(image: FloatArray, sigma: float) -> FloatArray:
    """Gaussian blur of large ``sigma``, computed at 1/4 resolution (within 0.3 levels of the
    full blur at sigma 26, several times faster)."""
    factor = 4 if sigma >= 8.0 else 1
    height, width = image.shape[:2]
    small: npt.NDArray[np.float32] = image
    if factor > 1:
        small_size = (max(1, width // factor), max(1, height // factor))
        small = np.asarray(
            cv2.resize(image, small_size, interpolation=cv2.INTER_AREA), dtype=np.float32
        )
    blurred = cv2.GaussianBlur(small, (0, 0), sigma / factor, borderType=cv2.BORDER_REFLECT)
    if factor > 1:
        blurred = cv2.resize(blurred, (width, height), interpolation=cv2.INTER_LINEAR)
    return np.asarray(blurred, dtype=np.float32)


def masked_low_pass(image: FloatArray, weights: FloatArray, sigma: float) -> FloatArray:
    """Gaussian low-pass of ``image`` (H x W or H x W x C) over the pixels ``weights``
    covers only (normalised convolution: hair, glasses or background outside them do not
    bleed in), extended smoothly beyond them."""
    w = np.asarray(weights, dtype=np.float32)
    values = np.asarray(image, dtype=np.float32)
    per_pixel = w if values.ndim == 2 else w[..., None]
    num = low_pass(np.ascontiguousarray(values * per_pixel), sigma)
    den = np.maximum(low_pass(w, sigma), np.float32(1e-3))
    return np.asarray(num / (den if values.ndim == 2 else den[..., None]), dtype=np.float32)


def color_transfer(src_crop: RGBImage, ref_crop: RGBImage, mask: npt.ArrayLike) -> RGBImage:
    """Reinhard colour transfer: match ``src_crop``'s LAB mean and spread to ``ref_crop``'s.

    Statistics of both crops are weighted by ``mask`` (the face region), and the mapping
    is applied in proportion to it: outside the mask the crop is unchanged. Spread ratios
    are clamped to [0.5, 2].
    """
    weights = np.asarray(mask, dtype=np.float32)
    total = float(weights.sum())
    if total < 16.0:
        return src_crop.copy()
    src_lab = to_lab(src_crop)
    ref_lab = to_lab(ref_crop)
    src_mean, src_std = _weighted_stats(src_lab, weights, total)
    ref_mean, ref_std = _weighted_stats(ref_lab, weights, total)
    ratio = np.clip(ref_std / np.maximum(src_std, 1e-3), 0.5, 2.0)
    moved = (src_lab - src_mean.astype(np.float32)) * ratio.astype(np.float32) + ref_mean.astype(
        np.float32
    )
    rgb = cv2.cvtColor(moved.astype(np.float32), cv2.COLOR_LAB2RGB) * np.float32(255.0)
    crop = src_crop.astype(np.float32)
    return _to_uint8(crop + weights[..., None] * (rgb - crop))


def to_lab(image: RGBImage) -> FloatArray:
    lab = cv2.cvtColor(image.astype(np.float32) * (1.0 / 255.0), cv2.COLOR_RGB2LAB)
    return np.asarray(lab, dtype=np.float32)


def _weighted_stats(
    lab: FloatArray, weights: FloatArray, total: float
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    flat = lab.reshape(-1, 3).astype(np.float64)
    w = weights.reshape(-1).astype(np.float64)
    mean = w @ flat / total
    var = w @ (flat - mean) ** 2 / total
    return mean, np.sqrt(np.maximum(var, 0.0))


def _to_uint8(values: npt.NDArray[np.floating]) -> RGBImage:
    return np.clip(np.rint(values), 0, 255).astype(np.uint8)


def image_mask(aligned: AlignedFace, mask: npt.ArrayLike, shape: tuple[int, ...]) -> FloatArray:
    """The crop-space ``mask`` warped into a full image of ``shape`` (zero elsewhere)."""
    crop_mask = np.asarray(mask, dtype=np.float32)
    full = np.zeros(shape[:2], dtype=np.float32)
    roi = _face_roi(aligned, crop_mask, shape, pad=2)
    if roi is not None:
        x0, y0, x1, y1 = roi
        full[y0:y1, x0:x1] = _warp_mask(crop_mask, aligned, roi)
    return full


def paste_back(
    target_image: RGBImage,
    fused_crop: RGBImage,
    aligned: AlignedFace,
    mask: npt.ArrayLike,
    *,
    mode: BlendMode = "multiband",
    clone: CloneMode = "normal",
) -> RGBImage:
    """Warp ``fused_crop`` and ``mask`` back with ``aligned.inverse`` and blend into the target.

    ``feather`` alpha-blends with the mask; ``multiband`` blends a Laplacian pyramid of the
    face's region only (low frequencies over a wide seam, detail over a narrow one);
    ``seamless`` solves Poisson (``cv2.seamlessClone``, ``clone`` = normal or mixed
    gradients) and falls back to ``multiband`` if OpenCV refuses the region. Pixels where
    the warped mask is 0 are returned unchanged.
    """
    crop_mask = np.asarray(mask, dtype=np.float32)
    if crop_mask.shape != fused_crop.shape[:2]:
        raise ValueError(f"mask {crop_mask.shape} does not match crop {fused_crop.shape[:2]}")
    out = target_image.copy()
    roi = _face_roi(aligned, crop_mask, target_image.shape, pad=_roi_pad(aligned, mode))
    if roi is None:
        return out
    x0, y0, x1, y1 = roi
    base = target_image[y0:y1, x0:x1]
    face = _warp_crop(fused_crop, aligned, roi)
    weight = _warp_mask(crop_mask, aligned, roi)
    if mode == "seamless":
        blended = _seamless(face, base, weight, clone)
        if blended is None:
            blended = _multiband(face, base, weight)
    elif mode == "multiband":
        blended = _multiband(face, base, weight)
    else:
        blended = _feather(face, base, weight)
    out[y0:y1, x0:x1] = blended
    return out


def _roi_pad(aligned: AlignedFace, mode: BlendMode) -> int:
    """Margin around the mask's support: pyramids and Poisson need some context."""
    return (
        2 if mode == "feather" else max(8, round(0.05 * aligned.size / warp_scale(aligned.matrix)))
    )


def _face_roi(
    aligned: AlignedFace, crop_mask: FloatArray, shape: tuple[int, ...], *, pad: int
) -> tuple[int, int, int, int] | None:
    """The image rectangle (x0, y0, x1, y1) holding the mask's support, padded and clipped."""
    bx, by, bw, bh = cv2.boundingRect((crop_mask > 0).astype(np.uint8))
    if bw == 0 or bh == 0:
        return None
    corners = np.array(
        [[bx - 1, by - 1], [bx + bw, by - 1], [bx - 1, by + bh], [bx + bw, by + bh]],
        dtype=np.float64,
    )
    inv = aligned.inverse.astype(np.float64)
    region = corners @ inv[:, :2].T + inv[:, 2]
    height, width = shape[:2]
    x0 = max(int(np.floor(region[:, 0].min())) - pad, 0)
    y0 = max(int(np.floor(region[:, 1].min())) - pad, 0)
    x1 = min(int(np.ceil(region[:, 0].max())) + pad + 1, width)
    y1 = min(int(np.ceil(region[:, 1].max())) + pad + 1, height)
    if x1 <= x0 or y1 <= y0:
        return None
    return x0, y0, x1, y1


def _roi_matrix(aligned: AlignedFace, roi: tuple[int, int, int, int]) -> npt.NDArray[np.float64]:
    """Crop → ROI coordinates."""
    m = aligned.inverse.astype(np.float64).copy()
    m[0, 2] -= roi[0]
    m[1, 2] -= roi[1]
    return m


def _warp_crop(crop: RGBImage, aligned: AlignedFace, roi: tuple[int, int, int, int]) -> RGBImage:
    size = (roi[2] - roi[0], roi[3] - roi[1])
    flags = cv2.INTER_CUBIC if warp_scale(aligned.inverse) > 1.0 else cv2.INTER_LINEAR
    warped = cv2.warpAffine(
        crop, _roi_matrix(aligned, roi), size, flags=flags, borderMode=cv2.BORDER_REPLICATE
    )
    return np.asarray(warped, dtype=np.uint8)


def _warp_mask(
    crop_mask: FloatArray, aligned: AlignedFace, roi: tuple[int, int, int, int]
) -> FloatArray:
    size = (roi[2] - roi[0], roi[3] - roi[1])
    warped = cv2.warpAffine(
        crop_mask,
        _roi_matrix(aligned, roi),
        size,
        flags=cv2.INTER_LINEAR,
        borderMode=cv2.BORDER_CONSTANT,
        borderValue=0.0,
    )
    out = np.clip(np.asarray(warped, dtype=np.float32), 0.0, 1.0)
    out[out < _MASK_FLOOR] = 0.0
    return out


def _feather(face: RGBImage, base: RGBImage, weight: FloatArray) -> RGBImage:
    f = face.astype(np.float32)
    b = base.astype(np.float32)
    return _to_uint8(b + weight[..., None] * (f - b))


def _multiband(face: RGBImage, base: RGBImage, weight: FloatArray) -> RGBImage:
    """Burt-Adelson Laplacian-pyramid blend, confined to the mask's support."""
    height, width = weight.shape
    levels = int(np.clip(np.log2(max(min(height, width), 1) / 16.0), 1, 6))
    top_f, top_b, top_w = face.astype(np.float32), base.astype(np.float32), weight
    bands: list[FloatArray] = []
    for _ in range(levels):
        down_f = np.asarray(cv2.pyrDown(top_f), dtype=np.float32)
        down_b = np.asarray(cv2.pyrDown(top_b), dtype=np.float32)
        dsize = (top_f.shape[1], top_f.shape[0])
        lap_f = top_f - cv2.pyrUp(down_f, dstsize=dsize)
        lap_b = top_b - cv2.pyrUp(down_b, dstsize=dsize)
        bands.append(lap_b + top_w[..., None] * (lap_f - lap_b))
        top_f, top_b = down_f, down_b
        top_w = np.asarray(cv2.pyrDown(top_w), dtype=np.float32)
    result = top_b + top_w[..., None] * (top_f - top_b)
    for band in reversed(bands):
        result = cv2.pyrUp(result, dstsize=(band.shape[1], band.shape[0])) + band
    # Coarse bands spread a little past the mask; taper them to zero where the mask ends.
    b = base.astype(np.float32)
    keep = np.clip(weight * 20.0, 0.0, 1.0)[..., None]
    return _to_uint8(b + keep * (result - b))


def _seamless(
    face: RGBImage, base: RGBImage, weight: FloatArray, clone: CloneMode
) -> RGBImage | None:
    """Poisson blend inside the mask; None if OpenCV cannot (degenerate region)."""
    region = (weight > 0.05).astype(np.uint8) * 255
    if cv2.countNonZero(region) < 16:
        return None
    # A margin keeps the region off the image border, where seamlessClone misbehaves.
    pad = 4
    src = cv2.copyMakeBorder(face, pad, pad, pad, pad, cv2.BORDER_REFLECT)
    dst = cv2.copyMakeBorder(base, pad, pad, pad, pad, cv2.BORDER_REFLECT)
    region = np.asarray(
        cv2.copyMakeBorder(region, pad, pad, pad, pad, cv2.BORDER_CONSTANT, value=0), dtype=np.uint8
    )
    region[: pad + 1, :] = 0
    region[-pad - 1 :, :] = 0
    region[:, : pad + 1] = 0
    region[:, -pad - 1 :] = 0
    bx, by, bw, bh = cv2.boundingRect(region)
    if bw < 3 or bh < 3:
        return None
    center = (bx + bw // 2, by + bh // 2)
    flag = cv2.MIXED_CLONE if clone == "mixed" else cv2.NORMAL_CLONE
    try:
        # OpenCV 5 writes into the mask it is given: hand it a copy.
        cloned = cv2.seamlessClone(src, dst, region.copy(), center, flag)
    except cv2.error:
        return None
    inside = region[pad:-pad, pad:-pad] > 0
    out = base.copy()
    out[inside] = cloned[pad:-pad, pad:-pad][inside]
    return out


def sharpen(image: RGBImage, amount: float, region_mask: npt.ArrayLike | None = None) -> RGBImage:
    """Unsharp mask (Gaussian sigma 1.2 px) of strength ``amount``.

    With ``region_mask`` (H x W in [0, 1], e.g. from ``image_mask``) only that region is
    sharpened, in proportion to the mask, and everything else is returned unchanged.
    """
    if amount <= 0:
        return image.copy()
    sigma = 1.2
    if region_mask is None:
        return _unsharp(image, amount, sigma, None)
    weight = np.asarray(region_mask, dtype=np.float32)
    if weight.shape != image.shape[:2]:
        raise ValueError(f"region mask {weight.shape} does not match image {image.shape[:2]}")
    out = image.copy()
    bx, by, bw, bh = cv2.boundingRect((weight > 0).astype(np.uint8))
    if bw == 0 or bh == 0:
        return out
    pad = int(np.ceil(4 * sigma))
    x0, y0 = max(bx - pad, 0), max(by - pad, 0)
    x1, y1 = min(bx + bw + pad, image.shape[1]), min(by + bh + pad, image.shape[0])
    out[y0:y1, x0:x1] = _unsharp(image[y0:y1, x0:x1], amount, sigma, weight[y0:y1, x0:x1])
    return out


def _unsharp(image: RGBImage, amount: float, sigma: float, weight: FloatArray | None) -> RGBImage:
    values = image.astype(np.float32)
    detail = values - cv2.GaussianBlur(values, (0, 0), sigma)
    gain = amount if weight is None else amount * weight[..., None]
    return _to_uint8(values + gain * detail)
