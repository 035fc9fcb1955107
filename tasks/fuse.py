"""Classical landmark-aligned face fusion (the default fuser; no model needed).

Both faces arrive aligned to the same template, so the source face already sits in the
target's pose, position and scale up to the residual of a 5-point similarity. That
residual is the source's own proportions (eye spacing, nose and mouth placement): identity,
which ``fuse_with_classic`` keeps. Moving the source's landmarks onto the target's with a
thin-plate spline (``TARGET_GEOMETRY`` = 1, the earlier default) gave the target's
proportions back: on the 98 sample pairs of ``bench/quality.py`` the median identity
similarity to the source rose from 0.55 to 0.65 without it. Then it

1. mirrors the source when it is turned the other way from the target (opposite yaws,
   ``tasks.pose.should_mirror``): a face turned left fused onto one turned right would
   be stretched over the far cheek;
2. relights the source with the target's light: the source's detail (image over its
   Gaussian low-pass) times the target's low-pass, per RGB channel, the split at
   ``SHADING_SCALE`` eye distances (tied to the face's size, not the photo's), so the
   broad shading and skin tone come from the target and features and texture from the
   source; both low-passes leave the faces' hair out (``tasks.occlusion.hair_map``), so
   the fused forehead is not lit by either one's hair;
3. keeps what covers the target face (glasses, a brim, a fringe) and stops below the
   source's hairline where its hair is surely hair (``tasks.occlusion.occlusion_mask``,
   returned with the crop so the paste-back keeps them out too);
4. blends the relit face into the target crop under a feathered inner-face mask, less the
   occlusion mask, scaled by ``identity_weight`` (0 returns the target crop, 1 carries the
   whole source face).

numpy + OpenCV: on a 256 x 256 crop this takes ≈ 11 ms on one CPU core (7.5 ms without
the occlusion mask: the two skin maps the light needs), less than moving the crop to a GPU and back.
"""

from __future__ import annotations

from dataclasses import dataclass

import cv2
import numpy as np
import numpy.typing as npt

from tasks.occlusion import hair_map, occlusion_mask, skin_distance
from tasks.pose import head_pose, should_mirror
from tasks.postprocess import SHADING_SCALE, eye_distance, face_mask, low_pass, masked_low_pass
from tasks.types import AlignedFace, FloatArray, RGBImage

TARGET_GEOMETRY = 0.0
"""How far the source's 5 landmarks move towards the target's before fusing (thin-plate
spline): 0 keeps the source's proportions (identity), 1 takes the target's."""

_FUSE_MASK_ERODE = 0.015
"""The fusion mask's erosion, as the paste mask's (``tasks.pipeline.PASTE_MASK_ERODE``)."""


@dataclass(frozen=True)
class ClassicFusion:
    """A fused crop and the occlusion mask (1: the target's pixel kept) it was made with."""

    crop: RGBImage
    occlusion: FloatArray


_LOW_PASS_FLOOR = 0.02
"""Weight every pixel keeps in a hair-free low-pass (``relight``), so a crop that is all
hair still has a light."""

_TPS_GRID_STEP = 8
_TPS_REGULARISATION = 1e-3


def fuse_with_classic(
    source: AlignedFace,
    target: AlignedFace,
    *,
    identity_weight: float,
    keep_occluders: bool = True,
    mirror: bool = True,
) -> ClassicFusion:
    """The target crop with the source face fused in (a ``target.size`` square crop), and
    the occlusion mask that kept the target's glasses, brim or hair and stopped the fused
    face below the source's hairline (zero with ``keep_occluders`` off). With ``mirror``, a
    source turned the other way from the target (``tasks.pose.should_mirror``) is fused
    mirrored."""
    if source.crop.shape != target.crop.shape:
        raise ValueError(
            f"source crop {source.crop.shape} and target crop {target.crop.shape} differ: "
            "align both faces to the same crop size"
        )
    if not 0.0 <= identity_weight <= 1.0:
        raise ValueError(f"identity_weight must be within [0, 1], not {identity_weight}")
    size = target.size
    if identity_weight == 0.0:
        return ClassicFusion(target.crop.copy(), np.zeros((size, size), dtype=np.float32))
    if mirror and should_mirror(head_pose(source.landmarks), head_pose(target.landmarks)):
        source = mirror_face(source)
    source = in_target_geometry(source, target)
    src = source.crop.astype(np.float32)
    tgt = target.crop.astype(np.float32)
    source_distance = skin_distance(source.crop, source.landmarks)
    target_distance = skin_distance(target.crop, target.landmarks)
    relit = relight(
        src,
        tgt,
        sigma=SHADING_SCALE * eye_distance(target.landmarks),
        weights=(
            1.0 - hair_map(source_distance, source.landmarks),
            1.0 - hair_map(target_distance, target.landmarks),
        ),
    )
    occluded = (
        occlusion_mask(
            target, source, target_distance=target_distance, source_distance=source_distance
        )
        if keep_occluders
        else np.zeros((size, size), dtype=np.float32)
    )
    mask = face_mask(size, target.landmarks, erode=_FUSE_MASK_ERODE) * (1.0 - occluded)
    fused = tgt + (mask * np.float32(identity_weight))[..., None] * (relit - tgt)
    return ClassicFusion(np.clip(np.rint(fused), 0, 255).astype(np.uint8), occluded)


def mirror_face(face: AlignedFace) -> AlignedFace:
    """``face`` mirrored left to right in its crop (the eyes' and the mouth corners'
    landmarks swapped, so the left eye is still the viewer's left). Only the crop and its
    landmarks: a mirrored source is never pasted back through its own matrix."""
    size = face.size
    landmarks = face.landmarks[[1, 0, 2, 4, 3]].copy()
    landmarks[:, 0] = (size - 1) - landmarks[:, 0]
    return AlignedFace(
        np.ascontiguousarray(face.crop[:, ::-1]),
        face.matrix,
        face.inverse,
        size,
        landmarks.astype(np.float32),
    )


def in_target_geometry(source: AlignedFace, target: AlignedFace) -> AlignedFace:
    """The source face with its landmarks moved ``TARGET_GEOMETRY`` of the way to the
    target's (the face itself when that is 0)."""
    if TARGET_GEOMETRY <= 0.0:
        return source
    to = source.landmarks + TARGET_GEOMETRY * (target.landmarks - source.landmarks)
    crop = warp_to_landmarks(source.crop, source.landmarks, to)
    return AlignedFace(crop, source.matrix, source.inverse, source.size, to.astype(np.float32))


def relight(
    source: FloatArray,
    target: FloatArray,
    *,
    sigma: float,
    weights: tuple[FloatArray, FloatArray] | None = None,
) -> FloatArray:
    """``source``'s detail on ``target``'s shading: source * low(target) / low(source), per
    RGB channel. With ``weights`` (source's, target's), each low-pass is taken over the
    pixels its weights cover (``masked_low_pass``): the faces' hair left out, a forehead
    under a dark fringe is not brightened nor one beside the target's hair darkened (a
    band along the hairline)."""
    eps = np.float32(8.0)
    if weights is None:
        low_s, low_t = low_pass(source, sigma), low_pass(target, sigma)
    else:
        floor = np.float32(_LOW_PASS_FLOOR)
        low_s = masked_low_pass(source, weights[0] + floor, sigma)
        low_t = masked_low_pass(target, weights[1] + floor, sigma)
    gain = np.clip((low_t + eps) / (low_s + eps), 0.25, 4.0)
    return np.asarray(np.clip(source * gain, 0.0, 255.0), dtype=np.float32)


def warp_to_landmarks(
    crop: RGBImage, crop_landmarks: npt.ArrayLike, to_landmarks: npt.ArrayLike
) -> RGBImage:
    """Warp ``crop`` so ``crop_landmarks`` land on ``to_landmarks`` (thin-plate spline).

    The crop's border (16 points around it) is held (nearly) fixed, so the warp is local
    to the face. Evaluated on a coarse grid and interpolated, then ``cv2.remap``.
    """
    size_y, size_x = crop.shape[:2]
    scale = float(max(size_x, size_y))
    ticks = (0.0, 0.25, 0.5, 0.75, 1.0)
    anchors = np.array(
        [[x, y] for x in ticks for y in ticks if x in (0.0, 1.0) or y in (0.0, 1.0)]
    ) * [size_x - 1, size_y - 1]
    dst = np.vstack([np.asarray(to_landmarks, dtype=np.float64), anchors]) / scale
    src = np.vstack([np.asarray(crop_landmarks, dtype=np.float64), anchors]) / scale
    # Backward mapping: for each output pixel (at a ``dst`` position) where to sample.
    weights, affine = _fit_tps(dst, src - dst)
    gx = np.arange(0, size_x + _TPS_GRID_STEP, _TPS_GRID_STEP, dtype=np.float64)
    gy = np.arange(0, size_y + _TPS_GRID_STEP, _TPS_GRID_STEP, dtype=np.float64)
    grid = np.stack(np.meshgrid(gx, gy), axis=-1).reshape(-1, 2) / scale
    shift = (_tps_kernel(grid, dst) @ weights + np.c_[np.ones(len(grid)), grid] @ affine) * scale
    shift = shift.reshape(len(gy), len(gx), 2).astype(np.float32)
    xs, ys = np.meshgrid(np.arange(size_x, dtype=np.float32), np.arange(size_y, dtype=np.float32))
    # Bilinear interpolation of the coarse grid at every pixel (grid node i is pixel i * step).
    step = np.float32(1.0 / _TPS_GRID_STEP)
    full = cv2.remap(shift, xs * step, ys * step, interpolation=cv2.INTER_LINEAR)
    warped = cv2.remap(
        crop,
        xs + full[..., 0],
        ys + full[..., 1],
        interpolation=cv2.INTER_LINEAR,
        borderMode=cv2.BORDER_REPLICATE,
    )
    return np.asarray(warped, dtype=np.uint8)


def _tps_kernel(
    points: npt.NDArray[np.float64], centres: npt.NDArray[np.float64]
) -> npt.NDArray[np.float64]:
    r2 = ((points[:, None, :] - centres[None, :, :]) ** 2).sum(axis=-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        k = 0.5 * r2 * np.log(r2)
    return np.nan_to_num(k, nan=0.0)


def _fit_tps(
    centres: npt.NDArray[np.float64], values: npt.NDArray[np.float64]
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    """Thin-plate spline through ``values`` at ``centres``: kernel weights and affine part."""
    n = len(centres)
    p = np.c_[np.ones(n), centres]
    system = np.zeros((n + 3, n + 3))
    system[:n, :n] = _tps_kernel(centres, centres) + _TPS_REGULARISATION * np.eye(n)
    system[:n, n:] = p
    system[n:, :n] = p.T
    rhs = np.zeros((n + 3, values.shape[1]))
    rhs[:n] = values
    solution = np.asarray(np.linalg.lstsq(system, rhs, rcond=None)[0], dtype=np.float64)
    return solution[:n], solution[n:]
