"""Alignment: template scaling, the Umeyama fit against OpenCV and skimage, round trips."""

from __future__ import annotations

import cv2
import numpy as np
import pytest
from skimage.transform import SimilarityTransform

from tasks.align import (
    ARCFACE_TEMPLATE_112,
    align_face,
    estimate_similarity,
    invert_affine,
    template_for,
    transform_points,
    warp_scale,
)
from tasks.errors import InvalidInput
from tasks.types import Box, Face
from tests.faces import astronaut_face, grace_hopper_face
from tests.samples import astronaut_rgb, grace_hopper_rgb


def _similarity(scale: float, angle: float, tx: float, ty: float) -> np.ndarray:
    c, s = np.cos(angle) * scale, np.sin(angle) * scale
    return np.array([[c, -s, tx], [s, c, ty]])


def test_template_112_multiples_scale_the_arcface_template() -> None:
    np.testing.assert_allclose(template_for(112), ARCFACE_TEMPLATE_112)
    np.testing.assert_allclose(template_for(224), ARCFACE_TEMPLATE_112 * 2, rtol=1e-6)
    # 896 is a multiple of both: InsightFace's rule checks 112 first.
    np.testing.assert_allclose(template_for(896), ARCFACE_TEMPLATE_112 * 8, rtol=1e-6)


def test_template_128_multiples_use_the_inswapper_framing() -> None:
    shift = np.array([8.0, 0.0])
    np.testing.assert_allclose(template_for(128), ARCFACE_TEMPLATE_112 + shift, rtol=1e-6)
    expected_256 = (ARCFACE_TEMPLATE_112 + shift) * 2
    np.testing.assert_allclose(template_for(256), expected_256, rtol=1e-6)
    # The same face framing at any 128-multiple: the 256 crop is the 128 one at 2x.
    np.testing.assert_allclose(template_for(512), template_for(128) * 4, rtol=1e-6)


def test_template_other_sizes_and_override() -> None:
    np.testing.assert_allclose(template_for(200), ARCFACE_TEMPLATE_112 * 200 / 112, rtol=1e-6)
    np.testing.assert_allclose(template_for(256, base=112), ARCFACE_TEMPLATE_112 * 256 / 112)
    assert template_for(256).dtype == np.float32
    with pytest.raises(ValueError):
        template_for(0)


def test_estimate_similarity_recovers_a_known_transform() -> None:
    rng = np.random.default_rng(7)
    src = rng.uniform(0, 500, (5, 2))
    known = _similarity(0.37, np.deg2rad(-23.0), 41.5, -12.25)
    dst = transform_points(src, known)
    np.testing.assert_allclose(estimate_similarity(src, dst), known, atol=1e-3)
    assert estimate_similarity(src, dst).shape == (2, 3)


def test_estimate_similarity_matches_opencv_and_skimage_least_squares() -> None:
    rng = np.random.default_rng(11)
    for _ in range(20):
        src = rng.uniform(50, 450, (5, 2))
        truth = _similarity(
            rng.uniform(0.2, 3), rng.uniform(-np.pi, np.pi), *rng.uniform(-99, 99, 2)
        )
        dst = transform_points(src, truth) + rng.normal(0, 2.0, (5, 2))
        ours = estimate_similarity(src, dst).astype(np.float64)
        # All points inliers + Levenberg-Marquardt refinement = the least-squares optimum.
        theirs, inliers = cv2.estimateAffinePartial2D(
            src, dst, method=cv2.RANSAC, ransacReprojThreshold=1e6, maxIters=10, refineIters=100
        )
        assert inliers.all()
        np.testing.assert_allclose(ours, theirs, rtol=1e-3, atol=1e-2)
        tform = SimilarityTransform.from_estimate(src, dst)
        np.testing.assert_allclose(ours, tform.params[:2], rtol=1e-4, atol=1e-3)
        # Least squares: no worse than the true transform on the squared error.
        residual = ((transform_points(src, ours) - dst) ** 2).sum()
        assert residual <= ((transform_points(src, truth) - dst) ** 2).sum() + 1e-3


def test_estimate_similarity_never_reflects() -> None:
    src = ARCFACE_TEMPLATE_112.astype(np.float64)
    mirrored = src * [-1.0, 1.0]
    m = estimate_similarity(src, mirrored)
    assert np.linalg.det(m[:, :2]) > 0


def test_estimate_similarity_refuses_degenerate_points() -> None:
    with pytest.raises(InvalidInput):
        estimate_similarity(np.full((5, 2), 3.0), ARCFACE_TEMPLATE_112)
    with pytest.raises(ValueError):
        estimate_similarity(np.zeros((5, 2)), np.zeros((4, 2)))


def test_invert_affine() -> None:
    m = _similarity(1.7, 0.4, 10, -30)
    inv = invert_affine(m)
    np.testing.assert_allclose(inv, cv2.invertAffineTransform(m), atol=1e-5)
    pts = np.array([[3.0, 4.0], [100.0, -7.0]])
    np.testing.assert_allclose(transform_points(transform_points(pts, m), inv), pts, atol=1e-3)


@pytest.mark.parametrize("size", [112, 128, 256])
def test_align_real_face_lands_on_the_template(size: int) -> None:
    face = grace_hopper_face()
    aligned = align_face(grace_hopper_rgb(), face, size)
    assert aligned.crop.shape == (size, size, 3) and aligned.crop.dtype == np.uint8
    assert aligned.size == size
    # 5-point similarity residual: a few percent of the crop at most.
    error = np.linalg.norm(aligned.landmarks - template_for(size), axis=1)
    assert error.max() < 0.05 * size, error
    np.testing.assert_allclose(
        transform_points(aligned.landmarks, aligned.inverse), face.landmarks, atol=1e-2
    )


def test_align_round_trip_reproduces_the_face_region() -> None:
    image = astronaut_rgb()
    face = astronaut_face()
    aligned = align_face(image, face, 256)
    assert warp_scale(aligned.matrix) > 1.0  # the astronaut's face is upscaled into the crop
    back = cv2.warpAffine(aligned.crop, aligned.inverse, (image.shape[1], image.shape[0]))
    box = face.box
    y0, y1, x0, x1 = int(box.y1) + 10, int(box.y2) - 10, int(box.x1) + 10, int(box.x2) - 10
    diff = np.abs(back[y0:y1, x0:x1].astype(int) - image[y0:y1, x0:x1].astype(int))
    assert diff.mean() < 3.0, diff.mean()


def test_align_large_face_is_area_averaged_not_aliased() -> None:
    image = astronaut_rgb()
    face = astronaut_face()
    big = np.asarray(cv2.resize(image, None, fx=5, fy=5, interpolation=cv2.INTER_CUBIC), np.uint8)
    reference = align_face(image, face, 256).crop.astype(int)
    # cv2.resize's pixel centres: x in the image is 5 * x + 2 in the 5x image.
    landmarks = (face.landmarks * 5.0 + 2.0).astype(np.float32)
    aligned = align_face(big, Face(face.box.scaled(5.0), face.score, landmarks), 256)
    assert warp_scale(aligned.matrix) < 0.5
    assert np.abs(aligned.crop.astype(int) - reference).mean() < 1.5
    # A plain bilinear warp of the 5x image would alias: noticeably further off.
    naive = cv2.warpAffine(big, aligned.matrix, (256, 256), borderMode=cv2.BORDER_REPLICATE)
    assert (
        np.abs(aligned.crop.astype(int) - reference).mean()
        < np.abs(naive.astype(int) - reference).mean()
    )


def test_align_face_at_the_border_replicates_edges() -> None:
    image = grace_hopper_rgb()[:, 230:]  # cut through the face
    face = grace_hopper_face()
    shifted = Face(
        Box(0.0, face.box.y1, face.box.x2 - 230, face.box.y2),
        face.score,
        (face.landmarks - [230.0, 0.0]).astype(np.float32),
    )
    aligned = align_face(image, shifted, 256)
    assert aligned.crop.shape == (256, 256, 3)
    left = aligned.crop[:, :20]
    assert left.std(axis=1).mean() < 25  # replicated edge columns, not a black border
    assert left.mean() > 30
