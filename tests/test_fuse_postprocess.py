"""Classic fusion and postprocessing on real photos: astronaut's face onto Grace Hopper."""

from __future__ import annotations

import statistics
import time
from functools import cache

import cv2
import numpy as np
import pytest

from tasks.align import align_face
from tasks.fuse import fuse_with_classic, in_target_geometry, warp_to_landmarks
from tasks.options import BLEND_MODES, BlendMode
from tasks.postprocess import color_transfer, face_mask, image_mask, paste_back, sharpen
from tasks.types import AlignedFace, Box, Face, RGBImage
from tests.faces import astronaut_face, grace_hopper_face
from tests.samples import astronaut_rgb, grace_hopper_rgb

SIZE = 256


@cache
def _aligned() -> tuple[AlignedFace, AlignedFace]:
    source = align_face(astronaut_rgb(), astronaut_face(), SIZE)
    target = align_face(grace_hopper_rgb(), grace_hopper_face(), SIZE)
    return source, target


def _fuse_into_target(weight: float, mode: BlendMode) -> RGBImage:
    source, target = _aligned()
    fused = fuse_with_classic(source, target, identity_weight=weight).crop
    mask = face_mask(SIZE, target.landmarks)
    fused = color_transfer(fused, target.crop, mask)
    return paste_back(grace_hopper_rgb(), fused, target, mask, mode=mode)


def _far_from_face(shape: tuple[int, ...], margin: int = 12) -> np.ndarray:
    """Pixels more than ``margin`` px outside the warped mask's support."""
    _, target = _aligned()
    support = (image_mask(target, face_mask(SIZE, target.landmarks), shape) > 0).astype(np.uint8)
    kernel = cv2.getStructuringElement(cv2.MORPH_ELLIPSE, (2 * margin + 1, 2 * margin + 1))
    return cv2.dilate(support, kernel) == 0


def _inner_face(shape: tuple[int, ...]) -> np.ndarray:
    _, target = _aligned()
    return image_mask(target, face_mask(SIZE, target.landmarks), shape) > 0.9


def _high_pass(image: RGBImage) -> np.ndarray:
    gray = cv2.cvtColor(image, cv2.COLOR_RGB2GRAY).astype(np.float32)
    return gray - cv2.GaussianBlur(gray, (0, 0), 3.0)


def _correlation(a: np.ndarray, b: np.ndarray, where: np.ndarray) -> float:
    return float(np.corrcoef(a[where], b[where])[0, 1])


# --- fusion ------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", BLEND_MODES)
def test_fusion_changes_only_the_face(mode: BlendMode) -> None:
    target = grace_hopper_rgb()
    out = _fuse_into_target(0.85, mode)
    assert out.shape == target.shape and out.dtype == np.uint8
    far = _far_from_face(target.shape)
    assert far.mean() > 0.7  # most of the photo is far from the face
    np.testing.assert_array_equal(out[far], target[far])
    box = grace_hopper_face().box  # grown by a fifth of its size on every side
    dx, dy = box.width / 5, box.height / 5
    outside_box = np.ones(target.shape[:2], bool)
    outside_box[int(box.y1 - dy) : int(box.y2 + dy), int(box.x1 - dx) : int(box.x2 + dx)] = False
    np.testing.assert_array_equal(out[outside_box], target[outside_box])
    inner = _inner_face(target.shape)
    change = np.abs(out.astype(int) - target.astype(int))[inner].mean()
    assert change > 10.0, change


def test_identity_weight_orders_the_change() -> None:
    target = grace_hopper_rgb()
    inner = _inner_face(target.shape)
    changes = [
        np.abs(_fuse_into_target(w, "multiband").astype(int) - target.astype(int))[inner].mean()
        for w in (0.0, 0.5, 1.0)
    ]
    assert changes[0] < 3.0, changes  # resampling only
    assert changes[2] > changes[1] + 0.5 > changes[0] + 1.0, changes


def test_identity_weight_zero_returns_the_target_crop() -> None:
    source, target = _aligned()
    np.testing.assert_array_equal(
        fuse_with_classic(source, target, identity_weight=0.0).crop, target.crop
    )
    small = fuse_with_classic(source, target, identity_weight=0.02).crop
    assert np.abs(small.astype(int) - target.crop.astype(int)).max() <= 6


def test_full_weight_carries_source_detail_and_target_lighting() -> None:
    source, target = _aligned()
    # The target's glasses aside (kept over the face by default: tests/test_look.py).
    fused = fuse_with_classic(source, target, identity_weight=1.0, keep_occluders=False).crop
    assert fused.shape == target.crop.shape and fused.dtype == np.uint8
    inner = face_mask(SIZE, target.landmarks) > 0.95
    warped_source = in_target_geometry(source, target).crop
    # Detail (features, edges) follows the source face ...
    detail = _high_pass(fused)
    to_source = _correlation(detail, _high_pass(warped_source), inner)
    to_target = _correlation(detail, _high_pass(target.crop), inner)
    assert to_source > 0.8 and to_target < 0.5, (to_source, to_target)
    # ... the broad shading and colour follow the target.
    low = [cv2.GaussianBlur(x.astype(np.float32), (0, 0), 20)[inner] for x in (fused, target.crop)]
    low_source = cv2.GaussianBlur(warped_source.astype(np.float32), (0, 0), 20)[inner]
    assert np.abs(low[0] - low[1]).mean() < 0.5 * np.abs(low_source - low[1]).mean()
    # Away from the face (a tenth of the crop outside the mask's outline) it is the target's.
    outline = (face_mask(SIZE, target.landmarks, erode=0.0, blur=0.0) > 0).astype(np.uint8)
    kernel = cv2.getStructuringElement(cv2.MORPH_ELLIPSE, (53, 53))
    outside = cv2.dilate(outline, kernel) == 0
    np.testing.assert_array_equal(fused[outside], target.crop[outside])


def test_warp_to_landmarks_moves_landmarks_and_keeps_the_border() -> None:
    source, target = _aligned()
    marks = np.zeros((SIZE, SIZE, 3), np.uint8)
    for x, y in source.landmarks:
        cv2.circle(marks, (round(float(x)), round(float(y))), 2, (255, 255, 255), -1)
    moved = warp_to_landmarks(marks, source.landmarks, target.landmarks)
    for x, y in target.landmarks:
        assert moved[round(float(y)), round(float(x))].min() > 100
    # Where each output pixel samples from: coordinate ramps as images.
    ramp = np.arange(SIZE, dtype=np.uint8)
    xs = np.ascontiguousarray(np.broadcast_to(ramp[None, :, None], (SIZE, SIZE, 3)))
    dx = warp_to_landmarks(xs, source.landmarks, target.landmarks)[..., 0] - xs[..., 0].astype(int)
    ys = np.ascontiguousarray(xs.transpose(1, 0, 2))
    dy = warp_to_landmarks(ys, source.landmarks, target.landmarks)[..., 0] - ys[..., 0].astype(int)
    for edge in (np.s_[0], np.s_[-1], np.s_[:, 0], np.s_[:, -1]):
        assert np.abs(dx[edge]).max() <= 1 and np.abs(dy[edge]).max() <= 1
    x, y = np.rint(target.landmarks[3]).astype(int)
    expected = source.landmarks[3] - target.landmarks[3]
    assert abs(dx[y, x] - expected[0]) <= 1.5 and abs(dy[y, x] - expected[1]) <= 1.5
    image = source.crop
    same = warp_to_landmarks(image, source.landmarks, source.landmarks)
    assert np.abs(same.astype(int) - image.astype(int)).max() <= 1


def test_fuse_rejects_mismatched_crops() -> None:
    source = align_face(astronaut_rgb(), astronaut_face(), 128)
    _, target = _aligned()
    with pytest.raises(ValueError):
        fuse_with_classic(source, target, identity_weight=0.5)
    with pytest.raises(ValueError):
        fuse_with_classic(target, target, identity_weight=1.5)


# --- masks and colour ---------------------------------------------------------------------


def test_face_mask_covers_brows_to_chin_and_is_feathered() -> None:
    _, target = _aligned()
    mask = face_mask(SIZE, target.landmarks)
    assert mask.shape == (SIZE, SIZE) and mask.dtype == np.float32
    assert mask.min() == 0.0 and mask.max() == 1.0
    for x, y in target.landmarks:
        assert mask[round(float(y)), round(float(x))] > 0.95
    eyes_y = float(target.landmarks[:2, 1].mean())
    mouth_y = float(target.landmarks[3:, 1].mean())
    centre_x = round(float(target.landmarks[:, 0].mean()))
    brow_y = round(eyes_y - 0.3 * (mouth_y - eyes_y))
    assert mask[brow_y, centre_x] > 0.9
    assert mask[round(mouth_y + 0.25 * (mouth_y - eyes_y)), centre_x] > 0.85
    for corner in (mask[0, 0], mask[0, -1], mask[-1, 0], mask[-1, -1]):
        assert corner == 0.0
    values = mask[(mask > 0) & (mask < 1)]
    assert values.size > 0.05 * SIZE * SIZE  # a real feather, not a hard edge
    smaller = face_mask(SIZE, target.landmarks, erode=0.08)
    assert smaller.sum() < mask.sum()
    hard = face_mask(SIZE, target.landmarks, erode=0.0, blur=0.0)
    assert ((hard > 0) & (hard < 1)).mean() < 0.02  # anti-aliased outline only


def test_color_transfer_moves_lab_statistics_toward_the_reference() -> None:
    source, target = _aligned()
    mask = face_mask(SIZE, target.landmarks)
    moved = color_transfer(source.crop, target.crop, mask)
    assert moved.shape == source.crop.shape and moved.dtype == np.uint8
    weights = mask.reshape(-1)

    def lab_stats(image: RGBImage) -> tuple[np.ndarray, np.ndarray]:
        lab = cv2.cvtColor(image.astype(np.float32) / 255, cv2.COLOR_RGB2LAB).reshape(-1, 3)
        mean = weights @ lab / weights.sum()
        std = np.sqrt(weights @ (lab - mean) ** 2 / weights.sum())
        return mean, std

    (src_mean, src_std), (ref_mean, ref_std), (out_mean, out_std) = map(
        lab_stats, (source.crop, target.crop, moved)
    )
    assert np.linalg.norm(out_mean - ref_mean) < 0.15 * np.linalg.norm(src_mean - ref_mean)
    assert np.abs(out_std - ref_std).sum() < np.abs(src_std - ref_std).sum()
    unchanged = color_transfer(source.crop, target.crop, np.zeros((SIZE, SIZE), np.float32))
    np.testing.assert_array_equal(unchanged, source.crop)


# --- paste back ---------------------------------------------------------------------------


def _edge_target() -> tuple[RGBImage, Face]:
    """Grace Hopper cut so that her face touches the image's left border."""
    cut = 215
    image = np.ascontiguousarray(grace_hopper_rgb()[:, cut:])
    face = grace_hopper_face()
    box = Box(0.0, face.box.y1, face.box.x2 - cut, face.box.y2)
    return image, Face(box, face.score, (face.landmarks - [cut, 0.0]).astype(np.float32))


@pytest.mark.parametrize("mode", BLEND_MODES)
def test_paste_back_at_the_image_border(mode: BlendMode) -> None:
    image, face = _edge_target()
    source, _ = _aligned()
    target = align_face(image, face, SIZE)
    fused = fuse_with_classic(source, target, identity_weight=1.0).crop
    mask = face_mask(SIZE, target.landmarks)
    out = paste_back(image, fused, target, mask, mode=mode)
    assert out.shape == image.shape
    region = image_mask(target, mask, image.shape)
    assert region[:, 0].max() > 0.5  # the face region does touch the border
    change = np.abs(out.astype(int) - image.astype(int))
    assert change[region > 0.9].mean() > 10.0
    np.testing.assert_array_equal(out[region == 0], image[region == 0])


def test_seamless_modes_and_tiny_region_fallback() -> None:
    source, target = _aligned()
    fused = fuse_with_classic(source, target, identity_weight=1.0).crop
    mask = face_mask(SIZE, target.landmarks)
    image = grace_hopper_rgb()
    normal = paste_back(image, fused, target, mask, mode="seamless", clone="normal")
    mixed = paste_back(image, fused, target, mask, mode="seamless", clone="mixed")
    assert np.abs(normal.astype(int) - mixed.astype(int)).mean() > 0.1
    tiny = np.zeros_like(mask)
    tiny[128, 128] = 1.0
    out = paste_back(image, fused, target, tiny, mode="seamless")
    assert out.shape == image.shape
    changed = np.argwhere(np.any(out != image, axis=-1))
    assert len(changed) < 50
    empty = paste_back(image, fused, target, np.zeros_like(mask), mode="multiband")
    np.testing.assert_array_equal(empty, image)


def test_paste_back_rejects_a_mask_of_the_wrong_size() -> None:
    _, target = _aligned()
    with pytest.raises(ValueError):
        paste_back(grace_hopper_rgb(), target.crop, target, np.ones((10, 10), np.float32))


def test_sharpen_only_inside_the_region() -> None:
    image = grace_hopper_rgb()
    np.testing.assert_array_equal(sharpen(image, 0.0), image)
    _, target = _aligned()
    region = image_mask(target, face_mask(SIZE, target.landmarks), image.shape)
    out = sharpen(image, 1.0, region)
    np.testing.assert_array_equal(out[region == 0], image[region == 0])
    inner = region > 0.9
    assert np.abs(_high_pass(out)[inner]).mean() > 1.3 * np.abs(_high_pass(image)[inner]).mean()
    whole = sharpen(image, 1.0)
    assert np.abs(whole.astype(int) - image.astype(int))[region == 0].mean() > 1.0


# --- cost ----------------------------------------------------------------------------------


def test_align_fuse_postprocess_is_fast() -> None:
    source_image, target_image = astronaut_rgb(), grace_hopper_rgb()  # target is 512 x 600
    source_face, target_face = astronaut_face(), grace_hopper_face()

    def run() -> None:
        source = align_face(source_image, source_face, SIZE)
        target = align_face(target_image, target_face, SIZE)
        fused = fuse_with_classic(source, target, identity_weight=0.85).crop
        mask = face_mask(SIZE, target.landmarks)
        fused = color_transfer(fused, target.crop, mask)
        paste_back(target_image, fused, target, mask, mode="multiband")

    run()
    times = []
    for _ in range(7):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    assert statistics.median(times) < 0.150, times
