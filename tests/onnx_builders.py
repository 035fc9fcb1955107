"""Tiny ONNX stand-ins for the InsightFace models, with the real models' I/O signatures.

Each builder writes its file at the registry's expected path under ``model_dir`` and returns
the file's SHA-256 and the constants the tests need to predict the outputs:

* SCRFD (``buffalo_l/det_10g.onnx``): input ``input.1`` 1 x 3 x ? x ?; 9 outputs (scores,
  boxes, landmarks for strides 8/16/32, 2 anchors per location). Only stride 16, anchor 0,
  fires: a Gaussian-weighted sum of the *red* channel around each anchor, so a red square
  yields one detection centred on the anchor nearest the square's centre, with a box of
  ``2 * SCRFD_BOX_HALF * 16`` input pixels and landmarks at ``SCRFD_KPS_OFFSETS * 16``.
* ArcFace (``buffalo_l/w600k_r50.onnx``): ``input.1`` 1 x 3 x 112 x 112 → AveragePool 8 → Tanh →
  Flatten → MatMul (588 x 512) → ``683`` 1 x 512.
* inswapper (``inswapper_128.onnx``): ``target`` 1 x 3 x 128 x 128, ``source`` 1 x 512 →
  ``output`` = 0.5 * target + 0.5 * sigmoid(source @ colour), broadcast per channel; the last
  initializer is an unused 512 x 512 ``emap``, as in the real file.
* GFPGAN 1.4 (``gfpgan_1.4.onnx``, no registry pin: tests pin the file they build): ``input``
  1 x 3 x 512 x 512 in [-1, 1] → ``output`` = ``gain * GFPGAN_CHANNEL_GAINS * input``, same
  shape: at gain 1 red and green come back unchanged and blue at half contrast (so the face
  stays a face, and a wrong scaling or a swapped channel order shows); a larger gain leaves
  the range (the caller must clip). With ``out_size`` other than 512 it averages down
  instead, a wrong output shape.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import onnx
from onnx import TensorProto, helper, numpy_helper

from tasks.registry import REGISTRY, ModelName, expected_path

F32 = npt.NDArray[np.float32]
OPSET = 17

SCRFD_STRIDES = (8, 16, 32)
SCRFD_FIRING_STRIDE = 16
SCRFD_BOX_HALF = 2.0  # box half-size in stride units: 64 x 64 input pixels at stride 16
SCRFD_KPS_OFFSETS: F32 = np.array(
    [[-0.6, -0.5], [0.6, -0.5], [0.0, 0.1], [-0.5, 0.8], [0.5, 0.8]], dtype=np.float32
)
"""Landmark offsets from the anchor, stride units, in ``tasks.types.LANDMARK_NAMES`` order."""
SCRFD_SQUARE = 64  # side, in input pixels, of the red square the detector is tuned for
SCRFD_OUTPUT_NAMES = ("448", "471", "494", "451", "474", "497", "454", "477", "500")
_POOL = 4  # the firing branch averages 4 x 4 blocks before its Gaussian conv
_HALF_KERNEL = 16  # pooled pixels: the Gaussian spans +-64 input pixels
_SIGMA = 6.0  # pooled pixels (24 input pixels)
GFPGAN_CHANNEL_GAINS = (1.0, 1.0, 0.5)
_GAIN = 15.0
_THRESHOLD = 0.35


@dataclass(frozen=True, slots=True)
class TinyModel:
    """A built tiny model file and the pin that accepts it."""

    name: ModelName
    path: Path
    sha256: str

    @property
    def pins(self) -> dict[str, str]:
        return {self.name: self.sha256}


@dataclass(frozen=True, slots=True)
class TinyArcface(TinyModel):
    weights: F32  # (588, 512): pooled blob (1 x 3 x 14 x 14, flattened) → embedding


@dataclass(frozen=True, slots=True)
class TinyInswapper(TinyModel):
    emap: F32  # (512, 512)
    colour: F32  # (512, 3): latent → per-channel colour logits


def _save(name: ModelName, graph: onnx.GraphProto, model_dir: Path) -> tuple[Path, str]:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    path = expected_path(REGISTRY[name], model_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = model.SerializeToString()
    path.write_bytes(data)
    return path, hashlib.sha256(data).hexdigest()


def _init(name: str, array: npt.ArrayLike) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(array, dtype=np.float32), name)


def _gaussian_kernel() -> F32:
    """(2 x 3 x 2m x 2m) weights: a normalised Gaussian on the red channel, both anchors."""
    m = _HALF_KERNEL
    u = np.arange(2 * m, dtype=np.float32) + 0.5 - m
    g = np.exp(-(u**2) / (2 * _SIGMA**2))
    g2 = np.outer(g, g)
    g2 /= g2.sum()
    weights = np.zeros((2, 3, 2 * m, 2 * m), dtype=np.float32)
    weights[:, 0] = g2 * _GAIN
    return weights


def _head(
    prefix: str, source: str, channels: int, stride: int, bias: F32
) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto], str]:
    """Constant-per-anchor head: 1 x 1 conv (zero weights) at ``stride``, then rows per anchor."""
    weight = np.zeros((channels, 3, 1, 1), dtype=np.float32)
    inits = [_init(f"{prefix}_w", weight), _init(f"{prefix}_b", bias)]
    conv = helper.make_node(
        "Conv", [source, f"{prefix}_w", f"{prefix}_b"], [f"{prefix}_conv"], strides=[stride] * 2
    )
    return [conv], inits, f"{prefix}_conv"


def _rows(
    prefix: str, tensor: str, per_row: int, out: str
) -> tuple[list[onnx.NodeProto], onnx.TensorProto]:
    shape = numpy_helper.from_array(np.array([-1, per_row], dtype=np.int64), f"{prefix}_shape")
    nodes = [
        helper.make_node("Transpose", [tensor], [f"{prefix}_nhwc"], perm=[0, 2, 3, 1]),
        helper.make_node("Reshape", [f"{prefix}_nhwc", f"{prefix}_shape"], [out]),
    ]
    return nodes, shape


def build_tiny_scrfd(model_dir: Path, *, variant: int = 0) -> TinyModel:
    """A tiny SCRFD; ``variant`` changes an unused constant (a distinct file and hash)."""
    nodes: list[onnx.NodeProto] = []
    inits: list[onnx.TensorProto] = []
    outputs: dict[str, str] = {}
    for stride in SCRFD_STRIDES:
        if stride == SCRFD_FIRING_STRIDE:
            m = _HALF_KERNEL
            bias = np.array([-_GAIN * _THRESHOLD, -_GAIN * _THRESHOLD - 8.0], dtype=np.float32)
            inits += [_init("score16_w", _gaussian_kernel()), _init("score16_b", bias)]
            nodes += [
                helper.make_node(
                    "AveragePool",
                    ["input.1"],
                    ["pooled"],
                    kernel_shape=[_POOL] * 2,
                    strides=[_POOL] * 2,
                ),
                helper.make_node(
                    "Conv",
                    ["pooled", "score16_w", "score16_b"],
                    ["score16_conv"],
                    strides=[stride // _POOL] * 2,
                    pads=[m, m, m - 1, m - 1],
                ),
            ]
            logits = "score16_conv"
        else:
            low = np.full(2, -12.0 - 0.01 * variant, dtype=np.float32)
            head, head_inits, logits = _head(f"score{stride}", "input.1", 2, stride, low)
            nodes += head
            inits += head_inits
        nodes.append(helper.make_node("Sigmoid", [logits], [f"score{stride}_p"]))
        outputs[f"score{stride}"] = f"score{stride}_p"

        box_bias = np.full(8, SCRFD_BOX_HALF, dtype=np.float32)
        head, head_inits, boxes = _head(f"box{stride}", "input.1", 8, stride, box_bias)
        nodes += head
        inits += head_inits
        outputs[f"box{stride}"] = boxes

        kps_bias = np.tile(SCRFD_KPS_OFFSETS.reshape(-1), 2).astype(np.float32)
        head, head_inits, kps = _head(f"kps{stride}", "input.1", 20, stride, kps_bias)
        nodes += head
        inits += head_inits
        outputs[f"kps{stride}"] = kps

    graph_outputs = []
    order = [f"{kind}{s}" for kind in ("score", "box", "kps") for s in SCRFD_STRIDES]
    for key, out_name in zip(order, SCRFD_OUTPUT_NAMES, strict=True):
        per_row = {"score": 1, "box": 4, "kps": 10}[key.rstrip("0123456789")]
        row_nodes, shape = _rows(key, outputs[key], per_row, out_name)
        nodes += row_nodes
        inits.append(shape)
        graph_outputs.append(
            helper.make_tensor_value_info(out_name, TensorProto.FLOAT, ["n", per_row])
        )
    graph = helper.make_graph(
        nodes,
        "tiny_scrfd",
        [helper.make_tensor_value_info("input.1", TensorProto.FLOAT, [1, 3, "h", "w"])],
        graph_outputs,
        initializer=inits,
    )
    path, sha = _save("scrfd-10g", graph, model_dir)
    return TinyModel("scrfd-10g", path, sha)


def build_tiny_arcface(model_dir: Path, *, seed: int = 0) -> TinyArcface:
    """A tiny ArcFace: AveragePool 8 → Tanh → Flatten → MatMul to 512 (not normalised)."""
    weights = np.random.default_rng(seed).normal(size=(588, 512)).astype(np.float32)
    nodes = [
        helper.make_node(
            "AveragePool", ["input.1"], ["pooled"], kernel_shape=[8, 8], strides=[8, 8]
        ),
        helper.make_node("Tanh", ["pooled"], ["squashed"]),  # so the input scale matters
        helper.make_node("Flatten", ["squashed"], ["flat"], axis=1),
        helper.make_node("MatMul", ["flat", "fc_w"], ["683"]),
    ]
    graph = helper.make_graph(
        nodes,
        "tiny_arcface",
        [helper.make_tensor_value_info("input.1", TensorProto.FLOAT, [1, 3, 112, 112])],
        [helper.make_tensor_value_info("683", TensorProto.FLOAT, [1, 512])],
        initializer=[_init("fc_w", weights)],
    )
    path, sha = _save("arcface-w600k-r50", graph, model_dir)
    return TinyArcface("arcface-w600k-r50", path, sha, weights)


def build_tiny_inswapper(model_dir: Path, *, seed: int = 0) -> TinyInswapper:
    """A tiny inswapper: half target, half a colour from the source latent; emap last."""
    rng = np.random.default_rng(seed)
    colour = (rng.normal(size=(512, 3)) * 3.0).astype(np.float32)
    emap = rng.normal(size=(512, 512)).astype(np.float32)
    shape = numpy_helper.from_array(np.array([1, 3, 1, 1], dtype=np.int64), "colour_shape")
    nodes = [
        helper.make_node("MatMul", ["source", "colour_w"], ["logits"]),
        helper.make_node("Sigmoid", ["logits"], ["colour"]),
        helper.make_node("Reshape", ["colour", "colour_shape"], ["colour4"]),
        helper.make_node("Add", ["target", "colour4"], ["summed"]),
        helper.make_node("Mul", ["summed", "half"], ["output"]),
    ]
    graph = helper.make_graph(
        nodes,
        "tiny_inswapper",
        [
            helper.make_tensor_value_info("target", TensorProto.FLOAT, [1, 3, 128, 128]),
            helper.make_tensor_value_info("source", TensorProto.FLOAT, [1, 512]),
        ],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, [1, 3, 128, 128])],
        initializer=[_init("colour_w", colour), shape, _init("half", 0.5), _init("emap", emap)],
    )
    path, sha = _save("inswapper-128", graph, model_dir)
    return TinyInswapper("inswapper-128", path, sha, emap, colour)


def build_tiny_gfpgan(model_dir: Path, *, gain: float = 1.0, out_size: int = 512) -> TinyModel:
    """A tiny restorer: ``output = gain * channel gain * input`` (or a wrongly sized average)."""
    nodes = [helper.make_node("Mul", ["input", "gain"], ["output" if out_size == 512 else "m"])]
    if out_size != 512:
        k = 512 // out_size
        nodes.append(
            helper.make_node("AveragePool", ["m"], ["output"], kernel_shape=[k, k], strides=[k, k])
        )
    graph = helper.make_graph(
        nodes,
        "tiny_gfpgan",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, 3, 512, 512])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, [1, 3, out_size, out_size])],
        initializer=[_init("gain", gain * np.array(GFPGAN_CHANNEL_GAINS).reshape(1, 3, 1, 1))],
    )
    path, sha = _save("gfpgan-1.4", graph, model_dir)
    return TinyModel("gfpgan-1.4", path, sha)


def plant_square(
    width: int,
    height: int,
    center: tuple[float, float],
    side: float,
    colour: tuple[int, int, int] = (255, 0, 0),
) -> npt.NDArray[np.uint8]:
    """A dark RGB image with a ``side`` x ``side`` square of ``colour`` centred at ``center``."""
    image = np.full((height, width, 3), 30, dtype=np.uint8)
    cx, cy = center
    x0, x1 = round(cx - side / 2), round(cx + side / 2)
    y0, y1 = round(cy - side / 2), round(cy + side / 2)
    image[y0:y1, x0:x1] = colour
    return image
