"""Optional face restoration of the fused crops by a GFPGAN 1.4 class ONNX model.

The model is operator-provided and operator-pinned (``tasks.registry``: ``gfpgan-1.4`` has
no pin of its own, since every ONNX export has its own bytes). ``enhance_face`` runs on one
fused face before it is pasted back:

``reframe`` (the target photo warped to the FFHQ template the restorer was trained on, at
the model's input size, with the fused crop laid over it where that crop has pixels) →
``enhance_with_gfpgan`` → ``prepare_gfpgan`` (RGB, ``x / 127.5 - 1``, 1 x 3 x 512 x 512) →
``forward_gfpgan`` (the only code that runs the session) → ``normalize_gfpgan`` (clip to
[-1, 1], back to RGB uint8) → ``blend`` of the restored face over the reframed one.

It returns the new crop with the alignment of its framing, so postprocess colour-matches,
masks and pastes it back like any fused crop, at the restorer's resolution.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import cv2
import numpy as np
import numpy.typing as npt

from tasks.align import estimate_similarity, invert_affine, transform_points, warp_to_crop
from tasks.errors import ModelUnavailable
from tasks.onnx_runtime import OnnxModel, check_rgb, load_onnx_model, to_nchw
from tasks.options import EnhancerName
from tasks.registry import ModelName
from tasks.types import AlignedFace, FloatArray, RGBImage

ENHANCER_MODELS: dict[EnhancerName, ModelName] = {"gfpgan": "gfpgan-1.4"}
"""The registry model of each enhancer choice (``"none"`` has none)."""

FFHQ_TEMPLATE_512: FloatArray = np.array(
    [
        [192.98138, 239.94708],
        [318.90277, 240.19360],
        [256.63416, 314.01935],
        [201.26117, 371.41043],
        [313.08905, 371.15118],
    ],
    dtype=np.float32,
)
"""The 5 landmarks (``tasks.types.LANDMARK_NAMES`` order) of an FFHQ-aligned 512 crop, the
framing GFPGAN and CodeFormer are trained on (facexlib's template)."""

COVER_ERODE = 0.01
"""How far inside the fused crop's edge, as a fraction of the frame, its pixels are used."""
COVER_BLUR = 0.01
"""Feather of that edge (Gaussian sigma, fraction of the frame)."""

F32 = npt.NDArray[np.float32]


def ffhq_template(size: int) -> FloatArray:
    """The FFHQ template in a ``size`` x ``size`` crop."""
    return (FFHQ_TEMPLATE_512 * np.float32(size / 512.0)).astype(np.float32)


def _compose(outer: FloatArray, inner: FloatArray) -> FloatArray:
    """The 2 x 3 affine ``outer ∘ inner`` (apply ``inner`` first)."""
    a = np.vstack([outer.astype(np.float64), [0.0, 0.0, 1.0]])
    b = np.vstack([inner.astype(np.float64), [0.0, 0.0, 1.0]])
    return (a @ b)[:2].astype(np.float32)


def reframe(
    target_image: RGBImage, fused_crop: RGBImage, aligned: AlignedFace, size: int
) -> tuple[RGBImage, AlignedFace]:
    """The fused face in the FFHQ framing at ``size``, and the target's face in that framing.

    Where the fused crop has no pixels (the FFHQ framing is wider than the ArcFace one),
    the target photo shows through; the crop's edge is feathered.
    """
    landmarks = transform_points(aligned.landmarks, aligned.inverse)  # in the photo
    matrix = estimate_similarity(landmarks, ffhq_template(size))
    base = warp_to_crop(target_image, matrix, size)
    to_frame = _compose(matrix, aligned.inverse)
    laid = cv2.warpAffine(
        fused_crop, to_frame, (size, size), flags=cv2.INTER_LINEAR, borderMode=cv2.BORDER_REPLICATE
    )
    cover = cv2.warpAffine(
        np.ones(fused_crop.shape[:2], dtype=np.float32),
        to_frame,
        (size, size),
        flags=cv2.INTER_LINEAR,
        borderMode=cv2.BORDER_CONSTANT,
        borderValue=0.0,
    )
    radius = max(1, round(COVER_ERODE * size))
    kernel = cv2.getStructuringElement(cv2.MORPH_ELLIPSE, (2 * radius + 1, 2 * radius + 1))
    cover = cv2.GaussianBlur(cv2.erode(cover, kernel), (0, 0), COVER_BLUR * size)[..., None]
    mixed = base.astype(np.float32) * (1.0 - cover) + laid.astype(np.float32) * cover
    framed = AlignedFace(
        crop=base,
        matrix=matrix,
        inverse=invert_affine(matrix),
        size=size,
        landmarks=transform_points(landmarks, matrix),
    )
    return np.clip(mixed + 0.5, 0, 255).astype(np.uint8), framed


def reframe_mask(mask: FloatArray, aligned: AlignedFace, framed: AlignedFace) -> FloatArray:
    """A mask over the fused crop of ``aligned`` (e.g. the occlusion mask: the target's
    pixels the fuser kept) carried into the restorer's framing ``framed`` (0 outside)."""
    to_frame = _compose(framed.matrix, aligned.inverse)
    moved = cv2.warpAffine(
        np.asarray(mask, dtype=np.float32),
        to_frame,
        (framed.size, framed.size),
        flags=cv2.INTER_LINEAR,
        borderMode=cv2.BORDER_CONSTANT,
        borderValue=0.0,
    )
    return np.asarray(moved, dtype=np.float32)


def prepare_gfpgan(crop: RGBImage, size: int) -> F32:
    """The 1 x 3 x size x size blob, RGB in [-1, 1]."""
    check_rgb(crop, "face crop", size)
    return to_nchw(crop, 127.5, 127.5)


def forward_gfpgan(model: OnnxModel, blob: F32) -> F32:
    """Run the restorer: the raw 1 x 3 x H x W prediction."""
    (out,) = model.session.run([model.output_names[0]], {model.input_names[0]: blob})
    return np.asarray(out, dtype=np.float32)


def normalize_gfpgan(pred: F32, size: int) -> RGBImage:
    """The restored crop as RGB uint8 (the prediction is clipped to [-1, 1])."""
    if pred.shape != (1, 3, size, size):
        raise ModelUnavailable(
            "The enhancer model is not the expected model.",
            detail=f"output shape {pred.shape}, expected (1, 3, {size}, {size})",
        )
    image = (np.clip(pred[0].transpose(1, 2, 0), -1.0, 1.0) + 1.0) * 127.5
    return np.ascontiguousarray(np.rint(image).astype(np.uint8))


def load_enhancer(
    enhancer: EnhancerName,
    *,
    device: str = "cpu",
    model_dir: str | Path | None = None,
    pins: Mapping[str, str] | None = None,
) -> OnnxModel:
    """The verified, cached session of ``enhancer`` (``ModelUnavailable``: missing, unpinned,
    mismatched, or not a square single-input RGB restorer)."""
    if enhancer not in ENHANCER_MODELS:
        raise ValueError(f"{enhancer!r} has no model")
    model = load_onnx_model(
        ENHANCER_MODELS[enhancer], device=device, model_dir=model_dir, pins=pins
    )
    width, height = model.input_size()
    if len(model.input_names) != 1 or width != height:
        raise ModelUnavailable(
            "The enhancer model is not the expected model.",
            detail=f"inputs {model.input_names} of {model.input_shapes}",
        )
    return model


def enhance_with_gfpgan(
    crop: RGBImage,
    *,
    device: str = "cpu",
    model_dir: str | Path | None = None,
    pins: Mapping[str, str] | None = None,
) -> RGBImage:
    """``crop`` (FFHQ-aligned, the model's input size) restored by the GFPGAN model."""
    return _restore(load_enhancer("gfpgan", device=device, model_dir=model_dir, pins=pins), crop)


def _restore(model: OnnxModel, crop: RGBImage) -> RGBImage:
    size = model.input_size()[0]
    return normalize_gfpgan(forward_gfpgan(model, prepare_gfpgan(crop, size)), size)


def enhance_face(
    target_image: RGBImage,
    fused_crop: RGBImage,
    aligned: AlignedFace,
    *,
    enhancer: EnhancerName,
    blend: float,
    device: str = "cpu",
    model_dir: str | Path | None = None,
    pins: Mapping[str, str] | None = None,
    occluded: FloatArray | None = None,
) -> tuple[RGBImage, AlignedFace]:
    """One fused face restored: the new crop and its alignment (FFHQ framing). Where
    ``occluded`` (the fuser's occlusion mask over ``fused_crop``) is 1, the crop keeps the
    fuser's pixels (the target's glasses), not the restorer's."""
    model = load_enhancer(enhancer, device=device, model_dir=model_dir, pins=pins)
    composite, framed = reframe(target_image, fused_crop, aligned, model.input_size()[0])
    restored = _restore(model, composite)
    weight = np.full(composite.shape[:2], blend, dtype=np.float32)
    if occluded is not None:
        weight *= 1.0 - reframe_mask(occluded, aligned, framed)
    if blend >= 1.0 and occluded is None:
        return restored, framed
    mixed = composite + weight[..., None] * (restored.astype(np.float32) - composite)
    return np.clip(mixed + 0.5, 0, 255).astype(np.uint8), framed
