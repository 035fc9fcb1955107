"""InsightFace ``inswapper_128.onnx`` face swap on onnxruntime.

``swap_with_inswapper`` → ``prepare_inswapper`` (target blob in [0, 1] RGB; source latent =
unit ArcFace embedding @ ``emap``, normalised again) → ``forward_inswapper`` (the only code
that runs the session) → ``normalize_inswapper`` (1 x 3 x 128 x 128 in [0, 1] → RGB uint8).
``emap`` is the graph's last initializer, read once per file (as InsightFace reads it). The
target crop is aligned to the 128-based ArcFace framing (``tasks.align.align_face(image,
face, 128)``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from tasks.errors import InvalidInput, ModelUnavailable
from tasks.models import MODEL_CACHE
from tasks.onnx_runtime import OnnxModel, check_rgb, last_initializer, load_onnx_model, to_nchw
from tasks.registry import ModelName
from tasks.types import RGBImage

MODEL: ModelName = "inswapper-128"
CROP_SIZE = 128
INPUT_STD = 255.0

F32 = npt.NDArray[np.float32]


@dataclass(frozen=True, slots=True)
class InswapperInput:
    """What the swapper is fed."""

    target: F32  # 1 x 3 x 128 x 128, RGB in [0, 1]
    latent: F32  # 1 x 512, unit norm


def load_emap(model: OnnxModel) -> F32:
    """The 512 x 512 embedding map of a loaded swapper (cached per file hash)."""
    emap = MODEL_CACHE.get(
        (f"{MODEL}:emap", "host", model.sha256), lambda: last_initializer(model.path)
    )
    if emap.ndim != 2 or emap.shape[0] != emap.shape[1]:
        raise ModelUnavailable(
            "The swapper model is not the expected model.",
            detail=f"last initializer of {model.path.name} has shape {emap.shape}",
        )
    return emap


def source_latent(embedding: npt.ArrayLike, emap: F32) -> F32:
    """The 1 x D latent: unit ``embedding`` @ ``emap``, normalised to unit length."""
    vector = np.asarray(embedding, dtype=np.float32).reshape(1, -1)
    if vector.shape[1] != emap.shape[0]:
        raise InvalidInput(
            "The source identity embedding has the wrong size.",
            detail=f"{vector.shape[1]} values, expected {emap.shape[0]}",
        )
    norm = float(np.linalg.norm(vector))
    if not np.isfinite(norm) or norm < 1e-12:
        raise InvalidInput("The source identity embedding is empty.")
    latent = (vector / np.float32(norm)) @ emap
    latent_norm = float(np.linalg.norm(latent))
    if not np.isfinite(latent_norm) or latent_norm < 1e-12:
        raise InvalidInput("The source identity embedding is empty.")
    return (latent / np.float32(latent_norm)).astype(np.float32)


def prepare_inswapper(
    target_crop: RGBImage, source_embedding: npt.ArrayLike, emap: F32
) -> InswapperInput:
    """The target blob and the source latent."""
    check_rgb(target_crop, "target face crop", CROP_SIZE)
    return InswapperInput(
        target=to_nchw(target_crop, 0.0, INPUT_STD),
        latent=source_latent(source_embedding, emap),
    )


def forward_inswapper(model: OnnxModel, prepared: InswapperInput) -> F32:
    """Run the swapper: the raw 1 x 3 x 128 x 128 prediction."""
    target_name, source_name = model.input_names[:2]
    (out,) = model.session.run(
        [model.output_names[0]], {target_name: prepared.target, source_name: prepared.latent}
    )
    return np.asarray(out, dtype=np.float32)


def normalize_inswapper(pred: F32) -> RGBImage:
    """The swapped crop as a 128 x 128 x 3 RGB uint8 image."""
    if pred.ndim != 4 or pred.shape[:2] != (1, 3):
        raise ModelUnavailable(
            "The swapper model is not the expected model.", detail=f"output shape {pred.shape}"
        )
    image = np.clip(pred[0].transpose(1, 2, 0) * 255.0, 0.0, 255.0)
    return np.ascontiguousarray(np.rint(image).astype(np.uint8))


def swap_with_inswapper(
    target_crop_128: RGBImage,
    source_embedding: npt.ArrayLike,
    *,
    device: str = "cpu",
    model_dir: str | Path | None = None,
    pins: Mapping[str, str] | None = None,
) -> RGBImage:
    """The target crop with the source identity (an ArcFace embedding), 128 x 128 x 3 RGB."""
    check_rgb(target_crop_128, "target face crop", CROP_SIZE)
    model = load_onnx_model(MODEL, device=device, model_dir=model_dir, pins=pins)
    if len(model.input_names) != 2:
        raise ModelUnavailable(
            "The swapper model is not the expected model.",
            detail=f"{len(model.input_names)} inputs, expected target and source",
        )
    prepared = prepare_inswapper(target_crop_128, source_embedding, load_emap(model))
    return normalize_inswapper(forward_inswapper(model, prepared))
