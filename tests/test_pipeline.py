"""The whole pipeline in one process on real photos: fuse_images, face selection, bad inputs."""

from __future__ import annotations

import io
import struct
import threading
import zlib
from collections.abc import Callable
from typing import Any, NoReturn

import numpy as np
import pytest
from PIL import Image

from tasks import errors, pipeline
from tasks.detect import detect_faces, select_faces
from tasks.images import decode_image
from tasks.models import MODEL_CACHE
from tasks.options import FusionOptions
from tasks.pipeline import PipelineContext
from tasks.stages import fuse_images
from tests import samples

CTX = PipelineContext()


def _decode(data: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as im:
        return np.asarray(im.convert("RGB"))


@pytest.fixture(scope="module")
def fused() -> tuple[np.ndarray, np.ndarray]:
    result = fuse_images(
        samples.astronaut_jpeg_bytes(),
        samples.grace_hopper_jpeg_bytes(),
        FusionOptions(output_format="png"),
        CTX,
    )
    assert result.content_type == "image/png"
    return _decode(result.data), samples.grace_hopper_rgb()


def test_result_has_the_target_size_and_changes_only_the_face(
    fused: tuple[np.ndarray, np.ndarray],
) -> None:
    out, target = fused
    assert out.shape == target.shape
    face = detect_faces(target)[0]
    diff = np.abs(out.astype(np.int16) - target.astype(np.int16)).max(axis=2)
    # Far outside the face (beyond 1.5 face widths of the box centre) nothing changes.
    cx, cy = (face.box.x1 + face.box.x2) / 2, (face.box.y1 + face.box.y2) / 2
    reach = 1.5 * max(face.box.width, face.box.height)
    yy, xx = np.mgrid[0 : target.shape[0], 0 : target.shape[1]]
    far = (np.abs(xx - cx) > reach) | (np.abs(yy - cy) > reach)
    assert far.any()
    assert diff[far].max() == 0
    inner = diff[int(face.box.y1) : int(face.box.y2), int(face.box.x1) : int(face.box.x2)]
    assert inner.mean() > 4.0


def test_identity_weight_zero_leaves_the_face_almost_untouched() -> None:
    result = fuse_images(
        samples.astronaut_jpeg_bytes(),
        samples.grace_hopper_jpeg_bytes(),
        FusionOptions(identity_weight=0.0, color_transfer=False),
        CTX,
    )
    out, target = _decode(result.data), samples.grace_hopper_rgb()
    face = detect_faces(target)[0]
    box = (slice(int(face.box.y1), int(face.box.y2)), slice(int(face.box.x1), int(face.box.x2)))
    diff = np.abs(out[box].astype(np.int16) - target[box].astype(np.int16))
    assert diff.mean() < 2.0


def test_all_faces_replaced_on_a_group_photo() -> None:
    result = fuse_images(
        samples.astronaut_jpeg_bytes(), samples.t1_jpeg_bytes(), FusionOptions(face="all"), CTX
    )
    assert result.target_faces >= 5
    assert result.faces_replaced == result.target_faces
    assert (result.width, result.height) == (1280, 886)


def test_face_index_out_of_range_is_invalid_input() -> None:
    faces = detect_faces(samples.grace_hopper_rgb())
    with pytest.raises(errors.InvalidInput, match="out of range"):
        select_faces(faces, 5)
    with pytest.raises(errors.NoFaceFound):
        select_faces([], "largest")


def test_models_load_once_across_jobs() -> None:
    fuse_images(samples.astronaut_jpeg_bytes(), samples.grace_hopper_jpeg_bytes(), None, CTX)
    loaded = MODEL_CACHE.total_loads("mtcnn")
    assert loaded >= 1
    for _ in range(3):
        fuse_images(samples.astronaut_jpeg_bytes(), samples.grace_hopper_jpeg_bytes(), None, CTX)
    assert MODEL_CACHE.total_loads("mtcnn") == loaded


def _png_header(width: int, height: int) -> bytes:
    """A PNG whose IHDR claims ``width`` x ``height`` (a decompression-bomb header)."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = b"IHDR" + ihdr
    crc = struct.pack(">I", zlib.crc32(chunk) & 0xFFFFFFFF)
    idat = zlib.compress(b"\x00" * 64)
    idat_chunk = b"IDAT" + idat
    return (
        b"\x89PNG\r\n\x1a\n"
        + struct.pack(">I", len(ihdr))
        + chunk
        + crc
        + struct.pack(">I", len(idat))
        + idat_chunk
        + struct.pack(">I", zlib.crc32(idat_chunk) & 0xFFFFFFFF)
    )


@pytest.mark.parametrize(
    ("data", "error"),
    [
        (b"this is not an image at all", errors.UnsupportedFormat),
        (samples.grace_hopper_jpeg_bytes()[:2000], errors.InvalidInput),
        (samples.encode(np.zeros((1, 1, 3), np.uint8), "PNG"), errors.ImageTooSmall),
        (_png_header(100_000, 100_000), errors.ImageTooLarge),
        (samples.encode(np.zeros((64, 64, 3), np.uint8), "GIF"), errors.UnsupportedFormat),
    ],
    ids=["not-an-image", "truncated-jpeg", "1x1", "bomb-header", "gif"],
)
def test_bad_inputs_give_typed_errors(data: bytes, error: type[errors.FaceFlowError]) -> None:
    with pytest.raises(error) as info:
        fuse_images(data, samples.grace_hopper_jpeg_bytes(), None, CTX)
    assert info.value.permanent


def test_no_face_in_target_is_no_face_found() -> None:
    with pytest.raises(errors.NoFaceFound, match="target"):
        fuse_images(samples.astronaut_jpeg_bytes(), samples.no_face_jpeg_bytes(), None, CTX)
    with pytest.raises(errors.NoFaceFound, match="source"):
        fuse_images(samples.no_face_jpeg_bytes(), samples.astronaut_jpeg_bytes(), None, CTX)


def test_large_image_is_detected_on_a_downscaled_copy_and_mapped_back() -> None:
    target = samples.grace_hopper_rgb()
    base = detect_faces(target)[0]
    big = np.kron(target, np.ones((3, 3, 1), dtype=np.uint8))  # 1536 x 1800
    found = detect_faces(big, max_side=1024)[0]
    # Same face, mapped back to full-resolution coordinates: within 10% of the face's size
    # (the detector sees a different pyramid at the other scale).
    tol = 0.1 * 3 * base.box.height
    for got, want in zip(
        (found.box.x1, found.box.y1, found.box.x2, found.box.y2),
        (base.box.x1, base.box.y1, base.box.x2, base.box.y2),
        strict=True,
    ):
        assert abs(got - 3 * want) < tol
    assert np.abs(found.landmarks - 3 * base.landmarks).max() < tol


def test_decode_honours_limits_before_full_decode() -> None:
    from tasks.options import ImageLimits

    data = samples.grace_hopper_jpeg_bytes()
    with pytest.raises(errors.ImageTooLarge):
        decode_image(data, ImageLimits(max_bytes=len(data) - 1))
    with pytest.raises(errors.ImageTooLarge):
        decode_image(data, ImageLimits(max_pixels=512 * 600 - 1))
    assert decode_image(data, ImageLimits()).shape == (600, 512, 3)


# The identity reference and the result's moderation run on worker threads beside other
# stages; errors still come out as if the stages ran one after the other.


def _no_stage_threads() -> bool:
    return not any(t.name.startswith("faceflow-stage") for t in threading.enumerate())


def _fail(error: Exception) -> Callable[..., NoReturn]:
    def fail(*_args: object, **_kwargs: object) -> NoReturn:
        raise error

    return fail


@pytest.mark.parametrize(
    ("failing", "expected"),
    [
        (("checked_stage", "moderate_result_stage"), errors.FaceLost),
        (("moderate_result_stage", "encode_stage"), errors.ContentBlocked),
    ],
)
def test_errors_come_out_in_stage_order(
    monkeypatch: pytest.MonkeyPatch, failing: tuple[str, str], expected: type[Exception]
) -> None:
    """A quality error before the result's ContentBlocked, which comes before an encoding
    error (the store stage's)."""
    stage_errors = {
        "checked_stage": errors.FaceLost(detail="gone"),
        "moderate_result_stage": errors.ContentBlocked(),
        "encode_stage": errors.InvalidInput("no encoder"),
    }
    for stage in failing:
        monkeypatch.setattr(pipeline, stage, _fail(stage_errors[stage]))
    with pytest.raises(expected):
        fuse_images(samples.astronaut_jpeg_bytes(), samples.grace_hopper_jpeg_bytes())
    assert _no_stage_threads()


def test_the_reference_error_comes_after_those_of_earlier_stages(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    missing = errors.ModelUnavailable(detail="no dlib model")
    monkeypatch.setattr(pipeline, "reference_stage", _fail(missing))
    with pytest.raises(errors.ModelUnavailable) as info:
        fuse_images(samples.astronaut_jpeg_bytes(), samples.grace_hopper_jpeg_bytes())
    assert info.value is missing
    monkeypatch.setattr(pipeline, "fuse_stage", _fail(errors.InvalidInput("bad crop")))
    with pytest.raises(errors.InvalidInput):
        fuse_images(samples.astronaut_jpeg_bytes(), samples.grace_hopper_jpeg_bytes())
    assert _no_stage_threads()


def test_the_image_a_retry_keeps_is_the_one_moderated_and_encoded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    checked_stage = pipeline.checked_stage
    other = np.ascontiguousarray(samples.grace_hopper_rgb()[:, ::-1])
    checked: list[np.ndarray] = []

    def retry_won(*args: Any, **kwargs: Any) -> pipeline.Checked:
        result = checked_stage(*args, **kwargs)
        return pipeline.Checked(other, result.fused, result.options, result.report)

    def moderate(image: np.ndarray, ctx: PipelineContext) -> tuple[()]:
        checked.append(image)
        return ()

    monkeypatch.setattr(pipeline, "checked_stage", retry_won)
    monkeypatch.setattr(pipeline, "moderate_result_stage", moderate)
    result = fuse_images(
        samples.astronaut_jpeg_bytes(),
        samples.grace_hopper_jpeg_bytes(),
        FusionOptions(output_format="png"),
    )
    assert np.array_equal(_decode(result.data), other)
    # the blended image (unless its check had not started yet), then the kept one
    assert checked[-1] is other and all(image is not other for image in checked[:-1])
    assert result.quality is not None and result.timings_ms["quality"] > 0


def test_work_beside_a_stage_is_reused_only_for_the_inputs_it_started_with() -> None:
    runs: list[object] = []

    def work(value: object) -> object:
        runs.append(value)
        return value

    first, second = object(), object()
    with pipeline.stage_workers() as pool:
        ahead = pipeline.Beside(pool, work, first)
        assert ahead.take(first) is first  # the thread's result
        assert ahead.take() is first  # a retry: run again, here
        other = pipeline.Beside(pool, work, first)
        assert other.take(second) is second  # other inputs (a retry that won): run here
        failing = pipeline.Beside(pool, _fail(errors.ContentBlocked()))
        with pytest.raises(errors.ContentBlocked):
            failing.take()
    assert [r is first for r in runs].count(True) == 3 and runs.count(second) == 1


def test_the_context_for_this_machine_shares_the_cores_among_model_calls(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On two cores two model calls are in flight with one torch thread each (two calls of
    two threads each wait on each other's threads); an operator's ``OMP_NUM_THREADS`` wins."""
    import os

    import torch

    before = torch.get_num_threads()
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    try:
        torch.set_num_threads(2)
        ctx = PipelineContext.for_this_machine(device="cpu")
        assert (ctx.model_threads, ctx.call_threads) == (2, 1)
        assert torch.get_num_threads() == 1
        one = PipelineContext.for_this_machine(device="cpu", model_threads=1)
        assert (one.model_threads, one.call_threads) == (1, 2)
        assert torch.get_num_threads() == 2
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        ctx = PipelineContext.for_this_machine(device="cpu")
        assert ctx.call_threads == 1 and torch.get_num_threads() == 2  # the operator's
    finally:
        torch.set_num_threads(before)
