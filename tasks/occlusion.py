"""What covers a face: the occlusion mask that keeps a target's glasses, brim or fringe
over the fused face, and stops the fused face below the source's hairline.

No segmentation model: a face's skin is told from the rest by colour. ``skin_map`` takes
the robust spread (median and MAD, in Lab) of the face region away from the eyes, nose and
mouth as the face's skin, with lightness measured against the local shading so a face lit
from one side stays skin. On the target, an *occluder* is a patch that is not skin, only
where that is sure (``occluder_parts``): far from the skin's colour (``OCCLUDER_DISTANCE``)
and either spanning ``WIDE_OCCLUDER[1]`` eye distances across (a frame joined by its
bridge, a cap's brim) or one of a glasses frame's two sides, each the other's mirror
image across the face's midline. On the source, what is not skin above the brows is its
hair (``hair_map``, left out of the light's low-passes), and the fused face stops below
it where it is surely hair (``hairline_parts``: as far from the skin's colour as an
occluder). What this does not catch: an occluder of the skin's own colour and shading (a hand
of the same tone, pale rims on pale skin), a fringe near the skin's colour (the
astronaut's: on the target it stays under the fused face, on the source it comes along),
a narrow one (a finger, one strand of hair), one that covers only one eye.
A false occluder costs the source's identity (t1.jpg's shadows and brows, kept, cost 0.12
on some pairs), so a doubtful patch is left to the fused face.
"""

from __future__ import annotations

import cv2
import numpy as np
import numpy.typing as npt

from tasks.postprocess import SHADING_SCALE, eye_distance, face_mask, masked_low_pass, to_lab
from tasks.types import AlignedFace, FloatArray, RGBImage

FEATURE_ZONES: tuple[tuple[int, tuple[float, float], tuple[float, float]], ...] = (
    (0, (0.0, 0.0), (0.28, 0.13)),  # left eye
    (1, (0.0, 0.0), (0.28, 0.13)),  # right eye
    (2, (0.0, 0.06), (0.32, 0.16)),  # nose tip and nostrils
    (3, (0.0, 0.0), (0.10, 0.17)),  # mouth (half its width is added across)
)
"""Where a face's own features sit, not skin yet not covering it: (0 left eye, 1 right eye,
2 nose tip, 3 the mouth's midpoint), the centre's offset and the ellipse's semi-axes, in
eye distances."""
WIDE_OCCLUDER = (0.8, 1.3)
"""A patch of the target face that is not skin and spans the first of these, in eye
distances across, is an occluder around the eyes (``GLASSES_BAND``) where the source face is skin (one
side of a glasses frame, ≈ 0.85 on grace_hopper; a brow is ≈ 0.7 and lies on the source's brow); one that
spans the second is an occluder wherever it lies (a frame with its bridge, a brim, a
fringe)."""
SKIN_DISTANCE = (2.5, 4.0)
"""A pixel's colour distance from the face's skin (robust z-score in Lab): at the first
value it starts to count as not skin, at the second it is not skin at all."""
GLASSES_BAND = (-0.4, 0.3)
"""Where a glasses frame sits (eye-to-mouth distances from the eye line): the narrower
occluders (``WIDE_OCCLUDER``) are looked for there only."""
HAIRLINE_BAND = -0.5
"""Above this (in eye-to-mouth distances from the eye line, upwards negative) a source
pixel that is not skin is its hair: the fused face stops below it."""
HAIRLINE_EDGE = 0.03
"""How far (eye distances) the source's cut hair (``hairline_parts``) is grown over its own
soft edge, strands that are not yet far from the skin's colour."""
OCCLUDER_DISTANCE = 6.0
"""A part of the target face is an occluder only this far from the skin's colour
(``skin_distance``; ``occluder_parts`` says of which pixels): a cap's brim is ≈ 6.6, a
shadow, a smile's or the target's own hair at the mask's edge ≈ 4-5, and those, kept as
occluders, cost the source's identity."""
MIRROR_AGREEMENT = 0.8
"""A glasses frame is found by its two sides: this share of each side's pixels must land
on the other side's mirror image across the face's midline (``occluder_parts``; ≈ 1.0 on
grace_hopper's rims, 0.53 for the brow of t1.jpg's face turned 38°, which crosses the
midline, 0 for a brow or a shadow on one side only)."""
MIRROR_TOLERANCE = 0.08
"""How far (eye distances) a side's mirror image may miss the other side's pixels: the
residual yaw of an aligned face."""
_WORK_SIZE = 128
"""Skin maps are computed at this size (and scaled back): a face's colour does not need
more."""


def feature_zones(size: int, landmarks_in_crop: npt.ArrayLike) -> npt.NDArray[np.uint8]:
    """1 on the eyes, the nose tip and the mouth (ellipses placed by the 5 landmarks)."""
    lm = np.asarray(landmarks_in_crop, dtype=np.float64)
    eye = eye_distance(lm)
    centres = [lm[0], lm[1], lm[2], (lm[3] + lm[4]) / 2.0]
    mouth_half = float(np.linalg.norm(lm[4] - lm[3])) / 2.0
    angle = float(np.degrees(np.arctan2(lm[1, 1] - lm[0, 1], lm[1, 0] - lm[0, 0])))
    zones = np.zeros((size, size), dtype=np.uint8)
    for which, (dx, dy), (ax, ay) in FEATURE_ZONES:
        cx, cy = centres[which] + np.array([dx, dy]) * eye
        half_x = ax * eye + (mouth_half if which == 3 else 0.0)
        axes = (max(1, round(half_x)), max(1, round(ay * eye)))
        cv2.ellipse(zones, (round(cx), round(cy)), axes, angle, 0, 360, 1, thickness=-1)
    return zones


def skin_map(crop: RGBImage, landmarks_in_crop: npt.ArrayLike) -> FloatArray:
    """How much each pixel of an aligned face crop looks like that face's own skin: 1, or
    0 for hair, a brim, a glasses frame, the eyes and the lips."""
    return _full_size(skin_likeness(_skin_distance(crop, landmarks_in_crop)), crop.shape[0])


def skin_likeness(distance: FloatArray) -> FloatArray:
    """``skin_distance`` as 1 (skin) to 0 (not skin), ramped over ``SKIN_DISTANCE``."""
    low, high = SKIN_DISTANCE
    return np.clip((high - distance) / (high - low), 0.0, 1.0).astype(np.float32)


def skin_distance(crop: RGBImage, landmarks_in_crop: npt.ArrayLike) -> FloatArray:
    """Each pixel's colour distance from the face's own skin (robust z-score in Lab, the
    lightness against the local shading): ≈ 1 on skin, above ``SKIN_DISTANCE`` off it."""
    return _full_size(_skin_distance(crop, landmarks_in_crop), crop.shape[0])


def _full_size(values: FloatArray, size: int) -> FloatArray:
    if values.shape[0] == size:
        return values
    return np.asarray(cv2.resize(values, (size, size), interpolation=cv2.INTER_LINEAR), np.float32)


def _skin_distance(crop: RGBImage, landmarks_in_crop: npt.ArrayLike) -> FloatArray:
    """``skin_distance`` at the work size (``_WORK_SIZE`` at most)."""
    size = crop.shape[0]
    scale = min(1.0, _WORK_SIZE / size)
    work = size if scale >= 1.0 else _WORK_SIZE
    landmarks = np.asarray(landmarks_in_crop, dtype=np.float64) * scale
    small = crop if work == size else cv2.resize(crop, (work, work), interpolation=cv2.INTER_AREA)
    lab = to_lab(np.asarray(small, dtype=np.uint8))
    reference = (face_mask(work, landmarks, erode=0.03, blur=0.0) > 0.5) & (
        feature_zones(work, landmarks) == 0
    )
    if int(reference.sum()) < 64:
        return np.zeros((work, work), dtype=np.float32)
    shading = masked_low_pass(
        lab[..., 0], reference.astype(np.float32), SHADING_SCALE * eye_distance(landmarks)
    )
    relative = np.dstack([lab[..., 0] - shading, lab[..., 1], lab[..., 2]])
    samples = relative[reference]
    centre = np.median(samples, axis=0)
    spread = np.maximum(1.4826 * np.median(np.abs(samples - centre), axis=0), (2.0, 1.5, 1.5))
    return np.sqrt((((relative - centre) / spread) ** 2).sum(axis=-1)).astype(np.float32)


def below_eyes(landmarks_in_crop: npt.ArrayLike, size: int) -> FloatArray:
    """Each pixel's place between the eye line (0) and the mouth's (1); negative above."""
    lm = np.asarray(landmarks_in_crop, dtype=np.float64)
    eyes = (lm[0] + lm[1]) / 2.0
    down = (lm[3] + lm[4]) / 2.0 - eyes
    ys, xs = np.mgrid[0:size, 0:size].astype(np.float64)
    return (((xs - eyes[0]) * down[0] + (ys - eyes[1]) * down[1]) / float(down @ down)).astype(
        np.float32
    )


def occlusion_mask(
    target: AlignedFace,
    source: AlignedFace | None = None,
    *,
    target_distance: FloatArray | None = None,
    source_distance: FloatArray | None = None,
) -> FloatArray:
    """1 where the fused face must not go: an occluder of the target face (glasses, a
    brim, a fringe) and, given the aligned ``source``, the source's hair above its brows.
    Only confident occluders (``occluder_parts``, ``hairline_parts``). Grown and softened
    by a pixel or two so an occluder's edge blends. The faces' ``skin_distance`` maps may
    be given (the fuser has them already)."""
    size = target.size
    small = (
        _skin_distance(target.crop, target.landmarks)
        if target_distance is None
        else target_distance
    )
    distance = _full_size(small, size)
    not_skin = (1.0 - _full_size(skin_likeness(small), size)) * (
        face_mask(size, target.landmarks, erode=0.0, blur=0.0) > 0.0
    )
    # Drop specks (skin texture, a wrinkle), keep the wide parts, not the face's features.
    solid = np.asarray(
        cv2.morphologyEx(
            (not_skin > 0.5).astype(np.uint8),
            cv2.MORPH_OPEN,
            cv2.getStructuringElement(cv2.MORPH_ELLIPSE, (3, 3)),
        ),
        dtype=np.uint8,
    )
    wide, mirrored = occluder_parts(solid, distance, target.landmarks)
    if source is not None:
        if source_distance is None:
            source_distance = skin_distance(source.crop, source.landmarks)
        source_skin = skin_likeness(source_distance)
        band = below_eyes(target.landmarks, size)
        glasses = mirrored * source_skin * ((band > GLASSES_BAND[0]) & (band < GLASSES_BAND[1]))
        parts = np.maximum(wide, glasses)
        hair = hairline_parts(source, source_distance, target.landmarks)
    else:
        parts, hair = wide, np.zeros_like(wide)
    covered = np.maximum(parts * not_skin * (1 - feature_zones(size, target.landmarks)), hair)
    grown = cv2.dilate(covered, cv2.getStructuringElement(cv2.MORPH_ELLIPSE, (3, 3)))
    return np.asarray(cv2.GaussianBlur(grown, (0, 0), 0.004 * size + 0.5), dtype=np.float32)


def hair_map(distance: FloatArray, landmarks_in_crop: npt.ArrayLike) -> FloatArray:
    """How much each pixel of a face crop is its hair (or a cap, or the background): not
    skin (``skin_likeness`` of its ``skin_distance``) above ``HAIRLINE_BAND``."""
    above = below_eyes(landmarks_in_crop, distance.shape[0]) < HAIRLINE_BAND
    return np.asarray((1.0 - skin_likeness(distance)) * above, dtype=np.float32)


def hairline_parts(
    source: AlignedFace, distance: FloatArray, target_landmarks: npt.ArrayLike
) -> FloatArray:
    """The source's hair the fused face stops below: the connected parts of its hair
    (``hair_map``) inside the target's face whose median ``distance`` from the source's
    skin is at least ``OCCLUDER_DISTANCE`` (dark hair on a light face, a cap), each made
    solid (its gaps closed) so the cut has one clean edge. A fringe near the skin's colour
    (the astronaut's, ≈ 4.5) is doubtful and goes with the fused face: cut, it cost her
    identity 0.05 on t1.jpg's faces and left a pale band of the target's forehead."""
    size = source.size
    inside = face_mask(size, target_landmarks, erode=0.0, blur=0.0) > 0.0
    binary = ((hair_map(distance, source.landmarks) > 0.5) & inside).astype(np.uint8)
    eye = eye_distance(source.landmarks)
    close = max(3, 2 * round(0.06 * eye) + 1)
    binary = np.asarray(
        cv2.morphologyEx(
            binary, cv2.MORPH_CLOSE, cv2.getStructuringElement(cv2.MORPH_ELLIPSE, (close, close))
        ),
        dtype=np.uint8,
    ) & inside.astype(np.uint8)
    count, labels = cv2.connectedComponents(binary, connectivity=8)
    if count <= 1:
        return np.zeros((size, size), dtype=np.float32)
    flat = labels.ravel()
    keep = np.zeros(count, dtype=bool)
    for k in range(1, count):
        keep[k] = float(np.median(distance.ravel()[flat == k])) >= OCCLUDER_DISTANCE
    parts = keep.astype(np.uint8)[labels]
    # Grown over the hair's soft edge (hair_map below one half), which would be a dark seam.
    grow = 2 * max(1, round(HAIRLINE_EDGE * eye)) + 1
    grown = cv2.dilate(parts, cv2.getStructuringElement(cv2.MORPH_ELLIPSE, (grow, grow)))
    return np.asarray(grown, dtype=np.float32)


def occluder_parts(
    binary: npt.NDArray[np.uint8], distance: FloatArray, landmarks_in_crop: npt.ArrayLike
) -> tuple[FloatArray, FloatArray]:
    """The confident occluders among the connected parts of ``binary`` (not skin): the
    wide ones (``WIDE_OCCLUDER[1]`` eye distances across: a brim, a fringe, a frame with
    its bridge) whose median colour ``distance`` from the skin is at least
    ``OCCLUDER_DISTANCE``, and a glasses frame's two sides: parts of ``WIDE_OCCLUDER[0]``
    in ``GLASSES_BAND`` that mirror each other across the face's midline (at least
    ``MIRROR_AGREEMENT`` of each one's pixels land on such a part, up to
    ``MIRROR_TOLERANCE`` eye distances) and whose far pixels (90th percentile: a thin
    rim's edge blends into the skin) are ``OCCLUDER_DISTANCE`` from it. A shadow, a brow,
    a lock of hair over one eye or a smile's shadow is neither."""
    lm = np.asarray(landmarks_in_crop, dtype=np.float64)
    eye = eye_distance(lm)
    count, labels, stats, _ = cv2.connectedComponentsWithStats(binary, connectivity=8)
    empty = np.zeros(binary.shape, dtype=np.float32)
    if count <= 1:
        return empty, empty
    spans = stats[:, cv2.CC_STAT_WIDTH]
    wide = np.zeros(count, dtype=bool)
    sides = np.zeros(count, dtype=bool)
    places = below_eyes(lm, binary.shape[0])
    for k in np.flatnonzero(spans >= WIDE_OCCLUDER[0] * eye):  # specks need no statistics
        if k == 0:
            continue
        part = labels == k
        median, far = np.percentile(distance[part], (50, 90))
        place = float(np.median(places[part]))
        wide[k] = median >= OCCLUDER_DISTANCE and spans[k] >= WIDE_OCCLUDER[1] * eye
        sides[k] = far >= OCCLUDER_DISTANCE and GLASSES_BAND[0] < place < GLASSES_BAND[1]
    wide[0] = sides[0] = False
    if sides.any():
        candidates = sides.astype(np.uint8)[labels]
        # The mirror image across the midline: half way between the eyes, square to them.
        centre = (lm[0] + lm[1]) / 2.0
        across = (lm[1] - lm[0]) / max(float(np.linalg.norm(lm[1] - lm[0])), 1e-6)
        reflect = np.eye(2) - 2.0 * np.outer(across, across)
        matrix = np.hstack([reflect, (centre - reflect @ centre)[:, None]]).astype(np.float32)
        height, width = binary.shape
        mirrored = cv2.warpAffine(candidates, matrix, (width, height), flags=cv2.INTER_NEAREST)
        reach = max(1, round(MIRROR_TOLERANCE * eye))
        near = cv2.dilate(
            mirrored, cv2.getStructuringElement(cv2.MORPH_ELLIPSE, (2 * reach + 1, 2 * reach + 1))
        )
        flat = labels.ravel()
        agreement = np.bincount(flat, weights=near.ravel() > 0, minlength=count)
        sides &= agreement / np.maximum(np.bincount(flat, minlength=count), 1) >= MIRROR_AGREEMENT
    return (
        np.asarray(wide.astype(np.float32)[labels], dtype=np.float32),
        np.asarray(sides.astype(np.float32)[labels], dtype=np.float32),
    )
