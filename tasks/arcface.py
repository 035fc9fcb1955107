"""ArcFace identity embedding (InsightFace ``buffalo_l/w600k_r50.onnx``) on onnxruntime.

``embed_with_arcface`` → ``prepare_arcface`` (RGB, ``(x - 127.5) / 127.5``, NCHW) →
``forward_arcface`` (the only code that runs the session) → ``normalize_arcface`` (L2 norm).
The crop must be aligned to the ArcFace 112 template (``tasks.align.align_face(image, face,
112)``); a square crop of another size is resized to the model's input first.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import cv2
import numpy as np
import numpy.typing as npt

from tasks.errors import InvalidInput
from tasks.onnx_runtime import OnnxModel, check_rgb, load_onnx_model, to_nchw
from tasks.registry import ModelName
from tasks.types import RGBImage

MODEL: ModelName = "arcface-w600k-r50"
INPUT_MEAN = 127.5
INPUT_STD = 127.5
EMBEDDING_SIZE = 512

F32 = npt.NDArray[np.float32]


def prepare_arcface(crop: RGBImage, input_size: tuple[int, int]) -> F32:
    """The 1 x 3 x H x W blob of an aligned square crop."""
    check_rgb(crop, "aligned face crop")
    height, width = crop.shape[:2]
    if height != width:
        raise InvalidInput("The aligned face crop must be square.", detail=f"shape {crop.shape}")
    if (width, height) != input_size:
        shrink = width > input_size[0]
        interpolation = cv2.INTER_AREA if shrink else cv2.INTER_LINEAR
        crop = np.asarray(cv2.resize(crop, input_size, interpolation=interpolation), np.uint8)
    return to_nchw(crop, INPUT_MEAN, INPUT_STD)


def forward_arcface(model: OnnxModel, blob: F32) -> F32:
    """Run the recogniser: the raw 1 x 512 embedding."""
    (out,) = model.session.run([model.output_names[0]], {model.input_names[0]: blob})
    return np.asarray(out, dtype=np.float32)


def normalize_arcface(raw: F32) -> F32:
    """The L2-normalised embedding, shape (512,)."""
    vector = raw.reshape(-1).astype(np.float32)
    norm = float(np.linalg.norm(vector))
    if not np.isfinite(norm) or norm < 1e-12:
        raise InvalidInput("No identity could be computed from the source face.")
    return vector / np.float32(norm)


def embed_with_arcface(
    aligned_crop_112: RGBImage,
    *,
    device: str = "cpu",
    model_dir: str | Path | None = None,
    pins: Mapping[str, str] | None = None,
) -> F32:
    """Unit-norm (512,) float32 identity embedding of an ArcFace-aligned RGB crop."""
    model = load_onnx_model(MODEL, device=device, model_dir=model_dir, pins=pins)
    blob = prepare_arcface(aligned_crop_112, model.input_size())
    return normalize_arcface(forward_arcface(model, blob))
