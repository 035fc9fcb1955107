"""ONNX Runtime sessions for the optional InsightFace models, loaded once per process.

The ``insightface`` package is never imported: its model files are run here directly.
``load_onnx_model`` verifies the file through ``tasks.registry.resolve`` and caches one
session in ``tasks.models.MODEL_CACHE`` under ``(model name, device, (providers, sha256,
intra-op threads))``: the SHA-256 of the verified file is part of the key, so a re-pinned
or replaced file gets a fresh session while the same bytes from any directory share one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import onnxruntime as ort

from tasks.errors import InvalidInput, ModelUnavailable
from tasks.models import MODEL_CACHE
from tasks.registry import REGISTRY, ModelName, pinned_hash, resolve
from tasks.types import RGBImage

CPU_PROVIDER = "CPUExecutionProvider"
CUDA_PROVIDER = "CUDAExecutionProvider"

Dim = int | str | None


@dataclass(frozen=True, slots=True)
class OnnxModel:
    """A loaded ONNX model: its verified file, the session and the graph's I/O signature."""

    name: ModelName
    path: Path
    sha256: str
    device: str
    providers: tuple[str, ...]  # the providers the session actually uses, in priority order
    session: ort.InferenceSession
    input_names: tuple[str, ...]
    input_shapes: tuple[tuple[Dim, ...], ...]
    output_names: tuple[str, ...]
    output_shapes: tuple[tuple[Dim, ...], ...]

    def input_size(self) -> tuple[int, int]:
        """(width, height) of the first NCHW input: the graph's if fixed, else the registry's."""
        shape = self.input_shapes[0]
        if len(shape) == 4 and isinstance(shape[2], int) and isinstance(shape[3], int):
            return shape[3], shape[2]
        default = REGISTRY[self.name].input_size
        if default is None:
            raise ModelUnavailable(
                "A model file is not the expected model.",
                detail=f"{self.path.name} has a dynamic input size {shape}",
            )
        return default


def available_providers() -> tuple[str, ...]:
    """Execution providers this onnxruntime build offers."""
    return tuple(ort.get_available_providers())


def providers_for(device: str) -> tuple[str, ...]:
    """CUDA then CPU for a ``cuda`` device when onnxruntime has CUDA, else CPU only."""
    if device.startswith("cuda") and CUDA_PROVIDER in available_providers():
        return (CUDA_PROVIDER, CPU_PROVIDER)
    return (CPU_PROVIDER,)


def _device_index(device: str) -> int:
    _, _, index = device.partition(":")
    return int(index) if index.isdigit() else 0


def create_session(
    path: Path, providers: Sequence[str], device: str, threads: int = 0
) -> ort.InferenceSession:
    """An ``InferenceSession`` on ``providers`` with ``threads`` intra-op threads on the CPU
    (0: onnxruntime's default, one per core); ``ModelUnavailable`` if the file will not load."""
    options = ort.SessionOptions()
    options.log_severity_level = 3  # unused initializers (inswapper's emap) are expected
    options.intra_op_num_threads = max(0, threads)
    # The pipeline calls its sessions between torch stages: intra-op threads that spin
    # after a run take a core from the torch work that follows (moderation → detect).
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    provider_options: list[dict[str, Any]] = [
        {"device_id": _device_index(device)} if p == CUDA_PROVIDER else {} for p in providers
    ]
    try:
        return ort.InferenceSession(
            str(path),
            sess_options=options,
            providers=list(providers),
            provider_options=provider_options,
        )
    except Exception as exc:  # onnxruntime raises its own Fail / InvalidGraph / RuntimeError
        raise ModelUnavailable(
            "A model file could not be loaded.",
            detail=f"onnxruntime refused {path.name}: {type(exc).__name__}: {exc}",
        ) from exc


def _signature(args: Sequence[Any]) -> tuple[tuple[str, ...], tuple[tuple[Dim, ...], ...]]:
    names = tuple(str(a.name) for a in args)
    shapes = tuple(tuple(a.shape) for a in args)
    return names, shapes


def load_onnx_model(
    name: ModelName,
    *,
    device: str = "cpu",
    model_dir: str | Path | None = None,
    pins: Mapping[str, str] | None = None,
    threads: int = 0,
) -> OnnxModel:
    """The verified, cached session of ``name`` (loaded on the first call only) with
    ``threads`` intra-op threads on the CPU (0: onnxruntime's default; each count is its
    own session)."""
    if REGISTRY[name].runtime != "onnx":
        raise ValueError(f"{name} is not an ONNX model")
    path = resolve(name, directory=model_dir, pins=pins)
    sha256 = pinned_hash(name, pins)
    assert sha256 is not None  # resolve refuses an unpinned model
    wanted = providers_for(device)

    def load() -> OnnxModel:
        session = create_session(path, wanted, device, threads)
        input_names, input_shapes = _signature(session.get_inputs())
        output_names, output_shapes = _signature(session.get_outputs())
        return OnnxModel(
            name=name,
            path=path,
            sha256=sha256,
            device=device,
            providers=tuple(session.get_providers()),
            session=session,
            input_names=input_names,
            input_shapes=input_shapes,
            output_names=output_names,
            output_shapes=output_shapes,
        )

    return MODEL_CACHE.get((name, device, (wanted, sha256, threads)), load)


def last_initializer(path: Path) -> npt.NDArray[np.float32]:
    """The graph's last initializer as an array (inswapper keeps its ``emap`` there)."""
    import onnx
    from onnx import numpy_helper

    try:
        graph = onnx.load(str(path)).graph
    except Exception as exc:
        raise ModelUnavailable(
            "A model file could not be loaded.",
            detail=f"onnx could not parse {path.name}: {type(exc).__name__}",
        ) from exc
    if not graph.initializer:
        raise ModelUnavailable(
            "A model file is not the expected model.", detail=f"{path.name} has no initializers"
        )
    return np.asarray(numpy_helper.to_array(graph.initializer[-1]), dtype=np.float32)


def check_rgb(image: RGBImage, what: str, size: int | None = None) -> None:
    """``InvalidInput`` unless ``image`` is H x W x 3 uint8 (and ``size`` x ``size`` if given)."""
    if not isinstance(image, np.ndarray) or image.dtype != np.uint8:
        raise InvalidInput(f"The {what} must be an RGB uint8 image.")
    if image.ndim != 3 or image.shape[2] != 3 or image.shape[0] < 1 or image.shape[1] < 1:
        raise InvalidInput(f"The {what} must be an RGB uint8 image.", detail=f"shape {image.shape}")
    if size is not None and image.shape[:2] != (size, size):
        raise InvalidInput(
            f"The {what} must be {size} x {size} pixels.", detail=f"shape {image.shape}"
        )


def to_nchw(image: RGBImage, mean: float, std: float) -> npt.NDArray[np.float32]:
    """A 1 x 3 x H x W float32 blob ``(image - mean) / std``, channels in RGB order."""
    blob = (image.astype(np.float32) - np.float32(mean)) / np.float32(std)
    return np.ascontiguousarray(blob.transpose(2, 0, 1)[np.newaxis])
