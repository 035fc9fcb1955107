"""SCRFD face detector (InsightFace ``buffalo_l/det_10g.onnx``) on onnxruntime.

``detect_with_scrfd`` → ``prepare_scrfd`` (letterbox, normalise) → ``forward_scrfd`` (the only
code that runs the session) → ``normalize_scrfd`` (decode anchors, threshold, NMS, map back).
The pre- and post-processing follow InsightFace's ``model_zoo/scrfd.py``: the image is resized
keeping its aspect ratio into the top-left of the input and padded black right/bottom, fed as
RGB ``(x - 127.5) / 128``; the outputs are scores, box distances and landmark distances for
strides 8/16/32 (in that order, 3 + 3 + 3), 2 anchors per location, distances in stride units.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np
import numpy.typing as npt

from tasks.errors import ModelUnavailable
from tasks.onnx_runtime import OnnxModel, check_rgb, load_onnx_model, to_nchw
from tasks.registry import ModelName
from tasks.types import Box, Face, RGBImage

MODEL: ModelName = "scrfd-10g"
INPUT_MEAN = 127.5
INPUT_STD = 128.0
DEFAULT_SCORE_THRESHOLD = 0.5
NMS_THRESHOLD = 0.4
NUM_LANDMARKS = 5

F32 = npt.NDArray[np.float32]


@dataclass(frozen=True, slots=True)
class ScrfdLayout:
    """How the outputs are arranged: strides, anchors per location, whether kps are present."""

    strides: tuple[int, ...]
    num_anchors: int
    has_kps: bool


def layout_for(num_outputs: int) -> ScrfdLayout:
    """The output layout InsightFace infers from the output count (6, 9, 10 or 15)."""
    layouts = {
        6: ScrfdLayout((8, 16, 32), 2, False),
        9: ScrfdLayout((8, 16, 32), 2, True),
        10: ScrfdLayout((8, 16, 32, 64, 128), 1, False),
        15: ScrfdLayout((8, 16, 32, 64, 128), 1, True),
    }
    if num_outputs not in layouts:
        raise ModelUnavailable(
            "The detector model is not an SCRFD model.", detail=f"{num_outputs} outputs"
        )
    return layouts[num_outputs]


@dataclass(frozen=True, slots=True)
class ScrfdInput:
    """A letterboxed, normalised image and how to map detections back to the original."""

    blob: F32  # 1 x 3 x H x W, RGB, (x - 127.5) / 128
    scale_x: float  # input pixels per original pixel, horizontally
    scale_y: float
    image_width: int
    image_height: int


def letterbox_size(width: int, height: int, input_size: tuple[int, int]) -> tuple[int, int]:
    """(width, height) of the image resized to fit ``input_size`` keeping its aspect ratio."""
    in_w, in_h = input_size
    if height * in_w > in_h * width:  # taller than the input: fit the height
        return max(1, (width * in_h) // height), in_h
    return in_w, max(1, (height * in_w) // width)


def prepare_scrfd(image: RGBImage, input_size: tuple[int, int]) -> ScrfdInput:
    """Resize into the top-left of a black ``input_size`` canvas and normalise."""
    check_rgb(image, "image")
    height, width = image.shape[:2]
    new_w, new_h = letterbox_size(width, height, input_size)
    canvas = np.zeros((input_size[1], input_size[0], 3), dtype=np.uint8)
    canvas[:new_h, :new_w] = cv2.resize(image, (new_w, new_h), interpolation=cv2.INTER_LINEAR)
    return ScrfdInput(
        blob=to_nchw(canvas, INPUT_MEAN, INPUT_STD),
        scale_x=new_w / width,
        scale_y=new_h / height,
        image_width=width,
        image_height=height,
    )


def forward_scrfd(model: OnnxModel, blob: F32) -> list[F32]:
    """Run the detector: its raw outputs, in graph order."""
    outputs = model.session.run(list(model.output_names), {model.input_names[0]: blob})
    return [np.asarray(o, dtype=np.float32) for o in outputs]


def anchor_centers(height: int, width: int, stride: int, num_anchors: int) -> F32:
    """(height * width * num_anchors, 2) anchor centres (x, y), location-major."""
    ys, xs = np.mgrid[:height, :width]
    centers = np.stack([xs, ys], axis=-1).reshape(-1, 2).astype(np.float32) * stride
    return np.repeat(centers, num_anchors, axis=0)


def distance2bbox(points: F32, distance: F32) -> F32:
    """Boxes (x1, y1, x2, y2) from centres and (left, top, right, bottom) distances."""
    return np.concatenate([points - distance[:, :2], points + distance[:, 2:4]], axis=1)


def distance2kps(points: F32, distance: F32) -> F32:
    """Landmarks (N, K, 2) from centres and (dx, dy) offsets per landmark."""
    offsets = distance.reshape(len(distance), distance.shape[1] // 2, 2)
    return offsets + points[:, np.newaxis, :]


def nms(boxes: F32, scores: F32, threshold: float) -> list[int]:
    """Indices kept by greedy non-maximum suppression (IoU above ``threshold`` is dropped)."""
    x1, y1, x2, y2 = boxes.T
    areas = np.maximum(0.0, x2 - x1) * np.maximum(0.0, y2 - y1)
    order = np.argsort(-scores, kind="stable")
    keep: list[int] = []
    while order.size:
        i = int(order[0])
        keep.append(i)
        rest = order[1:]
        w = np.maximum(0.0, np.minimum(x2[i], x2[rest]) - np.maximum(x1[i], x1[rest]))
        h = np.maximum(0.0, np.minimum(y2[i], y2[rest]) - np.maximum(y1[i], y1[rest]))
        inter = w * h
        iou = inter / np.maximum(areas[i] + areas[rest] - inter, 1e-9)
        order = rest[iou <= threshold]
    return keep


def decode_scrfd(
    outputs: Sequence[F32], input_size: tuple[int, int], score_threshold: float
) -> tuple[F32, F32, F32]:
    """Scores (N,), boxes (N, 4) and landmarks (N, 5, 2) above the threshold, input pixels."""
    layout = layout_for(len(outputs))
    if not layout.has_kps:
        raise ModelUnavailable(
            "The detector model does not predict landmarks.", detail=f"{len(outputs)} outputs"
        )
    fmc = len(layout.strides)
    in_w, in_h = input_size
    scores_all, boxes_all, kps_all = [], [], []
    for idx, stride in enumerate(layout.strides):
        count = (in_h // stride) * (in_w // stride) * layout.num_anchors
        scores = outputs[idx].reshape(-1)
        boxes = outputs[idx + fmc].reshape(-1, 4) * stride
        kps = outputs[idx + 2 * fmc].reshape(-1, 2 * NUM_LANDMARKS) * stride
        if not len(scores) == len(boxes) == len(kps) == count:
            raise ModelUnavailable(
                "The detector model's outputs do not match the SCRFD layout.",
                detail=f"stride {stride}: {len(scores)}/{len(boxes)}/{len(kps)} rows, "
                f"expected {count}",
            )
        centers = anchor_centers(in_h // stride, in_w // stride, stride, layout.num_anchors)
        hit = scores >= score_threshold
        scores_all.append(scores[hit])
        boxes_all.append(distance2bbox(centers[hit], boxes[hit]))
        kps_all.append(distance2kps(centers[hit], kps[hit]))
    return np.concatenate(scores_all), np.concatenate(boxes_all), np.concatenate(kps_all)


def normalize_scrfd(
    outputs: Sequence[F32],
    prepared: ScrfdInput,
    *,
    score_threshold: float = DEFAULT_SCORE_THRESHOLD,
    nms_threshold: float = NMS_THRESHOLD,
) -> list[Face]:
    """Faces in the original image's pixel coordinates, best score first."""
    in_h, in_w = prepared.blob.shape[2:]
    scores, boxes, kps = decode_scrfd(outputs, (in_w, in_h), score_threshold)
    keep = nms(boxes, scores, nms_threshold)
    scale = np.array([prepared.scale_x, prepared.scale_y], dtype=np.float32)
    limit = np.array([prepared.image_width, prepared.image_height], dtype=np.float32)
    faces = []
    for i in keep:
        corners = np.clip(boxes[i].reshape(2, 2) / scale, 0.0, limit)
        landmarks = (kps[i] / scale).astype(np.float32)
        box = Box(*(float(v) for v in corners.reshape(-1)))
        if box.area > 0:
            faces.append(Face(box=box, score=float(scores[i]), landmarks=landmarks))
    return faces


def detect_with_scrfd(
    image: RGBImage,
    *,
    device: str = "cpu",
    model_dir: str | Path | None = None,
    pins: Mapping[str, str] | None = None,
    score_threshold: float = DEFAULT_SCORE_THRESHOLD,
) -> list[Face]:
    """Faces in ``image`` (RGB uint8) found by SCRFD, best score first; [] when none."""
    check_rgb(image, "image")
    model = load_onnx_model(MODEL, device=device, model_dir=model_dir, pins=pins)
    prepared = prepare_scrfd(image, model.input_size())  # det_10g: dynamic H/W → 640
    outputs = forward_scrfd(model, prepared.blob)
    return normalize_scrfd(outputs, prepared, score_threshold=score_threshold)
