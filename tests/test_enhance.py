"""The optional enhancer (GFPGAN 1.4 class) on a tiny ONNX model with the real I/O."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tasks.detect import detect_faces
from tasks.enhance import enhance_with_gfpgan, ffhq_template, reframe
from tasks.errors import ModelUnavailable
from tasks.models import MODEL_CACHE
from tasks.onnx_runtime import providers_for
from tasks.options import FusionOptions
from tasks.pipeline import PipelineContext, align_face
from tasks.stages import fuse_images
from tasks.types import AlignedFace
from tests.onnx_builders import GFPGAN_CHANNEL_GAINS, build_tiny_gfpgan
from tests.samples import astronaut_jpeg_bytes, astronaut_rgb, grace_hopper_jpeg_bytes


def _crop(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (512, 512, 3), dtype=np.uint8)


def _expected(crop: np.ndarray, gain: float = 1.0) -> np.ndarray:
    """What the tiny restorer returns, computed here in pixels."""
    weights = gain * np.array(GFPGAN_CHANNEL_GAINS)
    value = weights * (crop.astype(np.float64) / 127.5 - 1.0)
    return np.rint((np.clip(value, -1.0, 1.0) + 1.0) * 127.5).astype(int)


def test_restorer_is_fed_rgb_in_minus_one_to_one_and_read_back(tmp_path: Path) -> None:
    tiny = build_tiny_gfpgan(tmp_path)
    crop = _crop()
    out = enhance_with_gfpgan(crop, model_dir=tmp_path, pins=tiny.pins).astype(int)
    # Red and green unchanged, blue at half contrast: scaling and channel order show.
    assert np.abs(out - _expected(crop)).max() <= 1
    assert np.abs(out[..., :2] - crop[..., :2].astype(int)).max() <= 1
    assert np.abs(out[..., 2] - (crop[..., 2] / 2 + 63.75)).max() <= 1
    strong = build_tiny_gfpgan(tmp_path / "strong", gain=3.0)
    out = enhance_with_gfpgan(crop, model_dir=tmp_path / "strong", pins=strong.pins).astype(int)
    assert np.abs(out - _expected(crop, 3.0)).max() <= 1
    assert set(np.unique(out[..., 0][crop[..., 0] < 80])) == {0}  # clipped, not wrapped
    assert set(np.unique(out[..., 0][crop[..., 0] > 175])) == {255}
    with pytest.raises(Exception, match="512 x 512"):
        enhance_with_gfpgan(crop[:256, :256], model_dir=tmp_path, pins=tiny.pins)


def test_missing_unpinned_mismatched_or_wrong_model_is_model_unavailable(tmp_path: Path) -> None:
    with pytest.raises(ModelUnavailable, match=r"gfpgan_1\.4\.onnx") as info:
        enhance_with_gfpgan(_crop(), model_dir=tmp_path)
    assert info.value.permanent
    tiny = build_tiny_gfpgan(tmp_path)
    with pytest.raises(ModelUnavailable, match="not pinned") as info:
        enhance_with_gfpgan(_crop(), model_dir=tmp_path)  # the registry pins no GFPGAN build
    assert info.value.detail is not None and tiny.sha256 in info.value.detail
    with pytest.raises(ModelUnavailable, match="failed verification"):
        enhance_with_gfpgan(_crop(), model_dir=tmp_path, pins={"gfpgan-1.4": "0" * 64})
    wrong = build_tiny_gfpgan(tmp_path / "wrong", out_size=256)
    with pytest.raises(ModelUnavailable, match="output shape"):
        enhance_with_gfpgan(_crop(), model_dir=tmp_path / "wrong", pins=wrong.pins)


def test_reframe_puts_the_face_on_the_ffhq_template_over_the_target() -> None:
    image = astronaut_rgb()
    face = detect_faces(image)[0]
    aligned = align_face(image, face, 256)
    fused = np.full((256, 256, 3), 200, dtype=np.uint8)
    composite, framed = reframe(image, fused, aligned, 512)
    assert isinstance(framed, AlignedFace) and framed.size == 512
    template = ffhq_template(512)
    # A least-squares similarity: the eyes land on the template, the rest within a face's
    # departure from the average one.
    assert np.abs(framed.landmarks[:2].mean(0) - template[:2].mean(0)).max() < 6.0
    assert np.abs(framed.landmarks - template).mean() < 8.0
    assert framed.crop.shape == composite.shape == (512, 512, 3)
    centre = framed.landmarks[2].astype(int)  # the nose: well inside the fused crop
    assert (
        composite[centre[1] - 20 : centre[1] + 20, centre[0] - 20 : centre[0] + 20] == 200
    ).all()
    # The FFHQ framing is wider than the ArcFace crop: its corners show the target photo.
    assert np.array_equal(composite[:8, :8], framed.crop[:8, :8])
    assert not (framed.crop[:8, :8] == 200).all()


def test_pipeline_restores_the_fused_face_before_paste_back(tmp_path: Path) -> None:
    tiny = build_tiny_gfpgan(tmp_path)
    ctx = PipelineContext(model_dir=tmp_path, pins=tiny.pins)
    plain_options = FusionOptions(color_transfer=False, blend="feather")
    plain = fuse_images(astronaut_jpeg_bytes(), grace_hopper_jpeg_bytes(), plain_options, ctx)
    options = plain_options.model_copy(update={"enhancer": "gfpgan", "enhancer_blend": 1.0})
    enhanced = fuse_images(astronaut_jpeg_bytes(), grace_hopper_jpeg_bytes(), options, ctx)
    assert "enhance" in enhanced.timings_ms and "enhance" not in plain.timings_ms
    kept = plain_options.model_copy(update={"enhancer": "gfpgan", "enhancer_blend": 0.0})
    unrestored = fuse_images(astronaut_jpeg_bytes(), grace_hopper_jpeg_bytes(), kept, ctx)

    import io

    from PIL import Image

    def pixels(data: bytes) -> np.ndarray:
        return np.asarray(Image.open(io.BytesIO(data)).convert("RGB")).astype(int)

    a, b, c = pixels(plain.data), pixels(enhanced.data), pixels(unrestored.data)
    face = detect_faces(a.astype(np.uint8))[0].box
    cx, cy = int((face.x1 + face.x2) / 2), int((face.y1 + face.y2) / 2)
    window = np.s_[cy - 15 : cy + 15, cx - 15 : cx + 15]
    # Blend 0: the reframed face, as the fuser made it (resampled once more).
    assert np.abs(c[window] - a[window]).mean() < 4.0
    # Blend 1: the tiny restorer's output (blue at half contrast), pasted where the face is.
    assert np.abs(b[window][..., :2] - a[window][..., :2]).mean() < 4.0
    assert np.abs(b[window][..., 2] - (a[window][..., 2] / 2 + 63.75)).mean() < 4.0
    assert 0.4 < b[window][..., 2].std() / a[window][..., 2].std() < 0.65
    # Away from the face the photo is untouched.
    assert np.array_equal(a[:40, :40], b[:40, :40])


def test_restorer_session_loads_once_per_file_on_the_job_device(tmp_path: Path) -> None:
    tiny = build_tiny_gfpgan(tmp_path, gain=0.5)  # a hash no other test loads
    key = ("gfpgan-1.4", "cpu", (providers_for("cpu"), tiny.sha256, 0))
    for _ in range(3):
        enhance_with_gfpgan(_crop(), model_dir=tmp_path, pins=tiny.pins)
    assert MODEL_CACHE.loads[key] == 1
