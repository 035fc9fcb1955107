"""SCRFD, ArcFace and inswapper paths on onnxruntime, run on tiny models with the real I/O."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tasks import registry
from tasks.align import align_face, template_for
from tasks.arcface import embed_with_arcface
from tasks.detect import detect_faces
from tasks.errors import InvalidInput, ModelUnavailable
from tasks.inswapper import load_emap, swap_with_inswapper
from tasks.models import MODEL_CACHE
from tasks.onnx_runtime import (
    CPU_PROVIDER,
    CUDA_PROVIDER,
    available_providers,
    load_onnx_model,
    providers_for,
)
from tasks.options import FusionOptions
from tasks.pipeline import PipelineContext, warm_up
from tasks.scrfd import detect_with_scrfd
from tasks.stages import fuse_images
from tasks.types import LANDMARK_NAMES, Box, Face
from tests.onnx_builders import (
    SCRFD_BOX_HALF,
    SCRFD_FIRING_STRIDE,
    SCRFD_KPS_OFFSETS,
    SCRFD_SQUARE,
    build_tiny_arcface,
    build_tiny_inswapper,
    build_tiny_scrfd,
    plant_square,
)
from tests.samples import astronaut_rgb, encode


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


# --- providers and sessions -------------------------------------------------------------


def test_providers_are_cpu_here_and_cuda_only_for_a_cuda_device() -> None:
    assert providers_for("cpu") == (CPU_PROVIDER,)
    if CUDA_PROVIDER in available_providers():
        assert providers_for("cuda:0") == (CUDA_PROVIDER, CPU_PROVIDER)
    else:
        assert providers_for("cuda") == (CPU_PROVIDER,)
        assert providers_for("cuda:1") == (CPU_PROVIDER,)


def test_session_loads_once_per_file_device_and_providers(tmp_path: Path) -> None:
    tiny = build_tiny_scrfd(tmp_path, variant=7)  # a hash no other test loads
    key = ("scrfd-10g", "cpu", (providers_for("cpu"), tiny.sha256, 0))  # default threads
    assert MODEL_CACHE.loads[key] == 0
    image = plant_square(640, 640, (320, 320), SCRFD_SQUARE)
    for _ in range(3):
        assert len(detect_with_scrfd(image, model_dir=tmp_path, pins=tiny.pins)) == 1
    assert MODEL_CACHE.loads[key] == 1 and key in MODEL_CACHE
    model = load_onnx_model("scrfd-10g", model_dir=tmp_path, pins=tiny.pins)
    assert model.providers == (CPU_PROVIDER,)
    assert model.input_names == ("input.1",) and len(model.output_names) == 9
    assert MODEL_CACHE.loads[key] == 1


@pytest.mark.parametrize(
    ("name", "filename"),
    [
        ("scrfd-10g", "det_10g.onnx"),
        ("arcface-w600k-r50", "w600k_r50.onnx"),
        ("inswapper-128", "inswapper_128.onnx"),
    ],
)
def test_missing_model_names_file_and_expected_hash(
    tmp_path: Path, name: str, filename: str
) -> None:
    expected = registry.REGISTRY[name].sha256  # type: ignore[index]
    assert expected is not None  # each of these models is pinned
    calls = {
        "scrfd-10g": lambda: detect_with_scrfd(np.zeros((64, 64, 3), np.uint8), model_dir=tmp_path),
        "arcface-w600k-r50": lambda: embed_with_arcface(
            np.zeros((112, 112, 3), np.uint8), model_dir=tmp_path
        ),
        "inswapper-128": lambda: swap_with_inswapper(
            np.zeros((128, 128, 3), np.uint8), np.ones(512, np.float32), model_dir=tmp_path
        ),
    }
    with pytest.raises(ModelUnavailable) as info:
        calls[name]()
    assert filename in str(info.value) and expected in str(info.value)
    assert info.value.permanent


def test_hash_mismatch_names_file_and_expected_hash(tmp_path: Path) -> None:
    tiny = build_tiny_scrfd(tmp_path)
    image = np.zeros((64, 64, 3), np.uint8)
    with pytest.raises(ModelUnavailable) as info:  # the registry pins the real det_10g.onnx
        detect_with_scrfd(image, model_dir=tmp_path)
    message = str(info.value)
    pinned = registry.REGISTRY["scrfd-10g"].sha256
    assert pinned is not None and "det_10g.onnx" in message and pinned in message
    assert tiny.sha256 in message  # the actual hash, so an operator can see what is there
    wrong = "0" * 64
    with pytest.raises(ModelUnavailable) as info:
        detect_with_scrfd(image, model_dir=tmp_path, pins={"scrfd-10g": wrong})
    assert wrong in str(info.value)


# --- SCRFD ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("width", "height", "center"),
    [
        (960, 600, (480.0, 312.0)),  # landscape: padded at the bottom, scale 2/3
        (360, 480, (180.0, 240.0)),  # portrait: padded at the right, scale 4/3 (upscaled)
        (1280, 720, (640.0, 352.0)),  # 16:9, scale 1/2
    ],
)
def test_scrfd_detection_lands_on_the_planted_square(
    tmp_path: Path, width: int, height: int, center: tuple[float, float]
) -> None:
    tiny = build_tiny_scrfd(tmp_path)
    scale = min(640 / width, 640 / height)
    side = SCRFD_SQUARE / scale
    faces = detect_with_scrfd(
        plant_square(width, height, center, side), model_dir=tmp_path, pins=tiny.pins
    )
    assert len(faces) == 1
    face = faces[0]
    assert 0.5 < face.score < 1.0
    cx, cy = (face.box.x1 + face.box.x2) / 2, (face.box.y1 + face.box.y2) / 2
    assert abs(cx - center[0]) < 2 and abs(cy - center[1]) < 2
    expected_side = 2 * SCRFD_BOX_HALF * SCRFD_FIRING_STRIDE / scale
    assert face.box.width == pytest.approx(expected_side, abs=2)
    assert face.box.height == pytest.approx(expected_side, abs=2)
    assert face.landmarks.shape == (len(LANDMARK_NAMES), 2) and face.landmarks.dtype == np.float32
    expected_kps = np.array(center) + SCRFD_KPS_OFFSETS * SCRFD_FIRING_STRIDE / scale
    np.testing.assert_allclose(face.landmarks, expected_kps, atol=2)
    left_eye, right_eye, nose, mouth_left, mouth_right = face.landmarks
    assert left_eye[0] < nose[0] < right_eye[0] and mouth_left[0] < mouth_right[0]
    assert left_eye[1] < nose[1] < mouth_left[1]


def test_scrfd_off_grid_square_is_found_within_half_a_stride(tmp_path: Path) -> None:
    tiny = build_tiny_scrfd(tmp_path)
    center = (486.0, 318.0)  # 4 input pixels off the anchor grid in x and y
    faces = detect_with_scrfd(
        plant_square(960, 600, center, 96), model_dir=tmp_path, pins=tiny.pins
    )
    assert len(faces) == 1
    half_stride = SCRFD_FIRING_STRIDE / 2 * 1.5  # input → original at scale 2/3
    box = faces[0].box
    assert abs((box.x1 + box.x2) / 2 - center[0]) <= half_stride
    assert abs((box.y1 + box.y2) / 2 - center[1]) <= half_stride


def test_scrfd_feeds_rgb_and_finds_nothing_without_a_face(tmp_path: Path) -> None:
    tiny = build_tiny_scrfd(tmp_path)
    # The tiny detector reads only the first input channel: a red square fires, a blue one
    # would fire only if the image were fed as BGR.
    blue = plant_square(640, 640, (320, 320), SCRFD_SQUARE, colour=(0, 0, 255))
    assert detect_with_scrfd(blue, model_dir=tmp_path, pins=tiny.pins) == []
    dark = np.full((480, 640, 3), 30, np.uint8)
    assert detect_with_scrfd(dark, model_dir=tmp_path, pins=tiny.pins) == []


def test_scrfd_keeps_separate_faces_and_the_dispatcher_maps_downscaled_images(
    tmp_path: Path,
) -> None:
    tiny = build_tiny_scrfd(tmp_path)
    image = plant_square(1920, 1200, (960.0, 624.0), 192)  # 1/3 overall: 1024 then 640
    image[:, :700] = plant_square(700, 1200, (336.0, 336.0), 192)
    faces = detect_faces(image, detector="scrfd", model_dir=tmp_path, pins=tiny.pins)
    centers = sorted(((f.box.x1 + f.box.x2) / 2, (f.box.y1 + f.box.y2) / 2) for f in faces)
    assert len(centers) == 2
    np.testing.assert_allclose(centers, [(336, 336), (960, 624)], atol=4)


def test_scrfd_rejects_a_non_rgb_image(tmp_path: Path) -> None:
    tiny = build_tiny_scrfd(tmp_path)
    with pytest.raises(InvalidInput):
        detect_with_scrfd(np.zeros((64, 64), np.uint8), model_dir=tmp_path, pins=tiny.pins)


# --- ArcFace ----------------------------------------------------------------------------


def _astronaut_face(size: int) -> np.ndarray:
    """An aligned crop of the astronaut photo around made-up landmarks."""
    landmarks = (template_for(112) * 1.6 + np.array([130.0, 40.0])).astype(np.float32)
    face = Face(box=Box(130.0, 40.0, 310.0, 220.0), score=1.0, landmarks=landmarks)
    return align_face(astronaut_rgb(), face, size).crop


def _reference_embedding(crop: np.ndarray, weights: np.ndarray) -> np.ndarray:
    blob = ((crop.astype(np.float32) - 127.5) / 127.5).transpose(2, 0, 1)
    pooled = blob.reshape(3, 14, 8, 14, 8).mean(axis=(2, 4)).reshape(-1)
    raw = np.tanh(pooled) @ weights
    return raw / np.linalg.norm(raw)


def test_arcface_embedding_is_unit_norm_rgb_and_deterministic(tmp_path: Path) -> None:
    tiny = build_tiny_arcface(tmp_path)
    crop = _astronaut_face(112)
    embedding = embed_with_arcface(crop, model_dir=tmp_path, pins=tiny.pins)
    assert embedding.shape == (512,) and embedding.dtype == np.float32
    assert float(np.linalg.norm(embedding)) == pytest.approx(1.0, abs=1e-5)
    np.testing.assert_allclose(embedding, _reference_embedding(crop, tiny.weights), atol=1e-4)
    bgr_reference = _reference_embedding(np.ascontiguousarray(crop[:, :, ::-1]), tiny.weights)
    assert float(np.abs(embedding - bgr_reference).max()) > 1e-2  # channel order matters
    again = embed_with_arcface(crop.copy(), model_dir=tmp_path, pins=tiny.pins)
    np.testing.assert_array_equal(embedding, again)
    other = embed_with_arcface(crop[::-1].copy(), model_dir=tmp_path, pins=tiny.pins)
    assert float(embedding @ other) < 0.999


def test_arcface_accepts_a_larger_aligned_crop_and_rejects_non_square(tmp_path: Path) -> None:
    tiny = build_tiny_arcface(tmp_path)
    small = embed_with_arcface(_astronaut_face(112), model_dir=tmp_path, pins=tiny.pins)
    large = embed_with_arcface(_astronaut_face(224), model_dir=tmp_path, pins=tiny.pins)
    assert float(small @ large) > 0.99
    with pytest.raises(InvalidInput):
        embed_with_arcface(np.zeros((112, 100, 3), np.uint8), model_dir=tmp_path, pins=tiny.pins)


# --- inswapper --------------------------------------------------------------------------


def _reference_swap(crop: np.ndarray, latent: np.ndarray, colour: np.ndarray) -> np.ndarray:
    target = crop.astype(np.float32) / 255.0
    tint = _sigmoid(latent @ colour)
    out = 0.5 * (target + tint[np.newaxis, np.newaxis, :])
    return np.rint(np.clip(out * 255.0, 0, 255)).astype(np.uint8)


def test_inswapper_uses_the_emap_latent_and_keeps_range(tmp_path: Path) -> None:
    tiny = build_tiny_inswapper(tmp_path)
    rng = np.random.default_rng(3)
    embedding = rng.normal(size=512).astype(np.float32)
    embedding /= np.linalg.norm(embedding)
    crop = _astronaut_face(128)
    swapped = swap_with_inswapper(crop, embedding, model_dir=tmp_path, pins=tiny.pins)
    assert swapped.shape == (128, 128, 3) and swapped.dtype == np.uint8

    latent = embedding @ tiny.emap
    latent /= np.linalg.norm(latent)
    expected = _reference_swap(crop, latent, tiny.colour)
    assert int(np.abs(swapped.astype(int) - expected).max()) <= 1
    without_emap = _reference_swap(crop, embedding, tiny.colour)
    assert int(np.abs(swapped.astype(int) - without_emap).max()) > 10
    model = load_onnx_model("inswapper-128", model_dir=tmp_path, pins=tiny.pins)
    assert model.input_names == ("target", "source")
    np.testing.assert_array_equal(load_emap(model), tiny.emap)


def test_inswapper_is_independent_of_embedding_scale_and_checks_inputs(tmp_path: Path) -> None:
    tiny = build_tiny_inswapper(tmp_path)
    crop = _astronaut_face(128)
    embedding = np.random.default_rng(5).normal(size=512).astype(np.float32)
    a = swap_with_inswapper(crop, embedding, model_dir=tmp_path, pins=tiny.pins)
    b = swap_with_inswapper(crop, embedding * 7.0, model_dir=tmp_path, pins=tiny.pins)
    assert int(np.abs(a.astype(int) - b).max()) <= 1
    with pytest.raises(InvalidInput):
        swap_with_inswapper(crop, np.ones(256, np.float32), model_dir=tmp_path, pins=tiny.pins)
    with pytest.raises(InvalidInput):
        swap_with_inswapper(crop[:112, :112], embedding, model_dir=tmp_path, pins=tiny.pins)


# --- the pipeline on the optional models ------------------------------------------------


def test_pipeline_runs_scrfd_arcface_and_inswapper_end_to_end(tmp_path: Path) -> None:
    pins: dict[str, str] = {}
    for build in (build_tiny_scrfd, build_tiny_arcface, build_tiny_inswapper):
        pins.update(build(tmp_path).pins)
    ctx = PipelineContext(model_dir=tmp_path, pins=pins)
    assert warm_up(ctx, "scrfd", "inswapper") > 0
    source = encode(plant_square(640, 480, (320, 240), 64), "PNG")
    target = encode(plant_square(960, 600, (480, 312), 96), "PNG")
    options = FusionOptions.model_validate({"detector": "scrfd", "fuser": "inswapper"})
    result = fuse_images(source, target, options, ctx)
    assert (result.width, result.height) == (960, 600)
    assert result.faces_replaced == result.source_faces == result.target_faces == 1
    # the quality stage finds the fused "face" again with the same (tiny) detector
    assert result.quality is not None and result.quality.faces[0].found
