"""MTCNN face detector (Zhang et al. 2016) in plain torch, on the facenet-pytorch weights.

``detect_with_mtcnn`` → ``prepare_mtcnn`` (tensors, pyramid scales) → ``forward_pnet`` /
``forward_rnet`` / ``forward_onet`` (the only code that runs the nets) → ``normalize_mtcnn``
(``Face`` objects). Between the nets the cascade is tensor maths on the given device: box
regression, squaring, NMS, and area resampling of all crops of a stage at once (from a
summed-area table, so crops of any size and position are one batched gather).

Coordinates are continuous pixel coordinates: pixel ``(i, j)`` covers ``[j, j+1) x [i, i+1)``,
a box's width is ``x2 - x1``. Crops outside the image are padded black, as in the original
MTCNN (facenet-pytorch clips and stretches them instead).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import cv2
import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tasks.errors import InvalidInput
from tasks.models import MODEL_CACHE
from tasks.registry import ModelName, resolve
from tasks.types import Box, Face, RGBImage

OverlapMode = Literal["union", "min"]

DEFAULT_MIN_FACE_SIZE = 20
DEFAULT_THRESHOLDS: tuple[float, float, float] = (0.6, 0.7, 0.7)
PYRAMID_FACTOR = 0.709
PNET_CELL = 12  # the P-Net window, in pixels of a pyramid level
PNET_STRIDE = 2
RNET_SIZE = 24
ONET_SIZE = 48
NMS_PNET_SCALE = 0.5  # within one pyramid level (IoU)
NMS_PNET_ALL = 0.7  # across levels (IoU)
NMS_RNET = 0.7  # IoU
NMS_ONET = 0.7  # "Min" overlap
CROP_BATCH = 1024  # crops per R-Net / O-Net forward on a GPU (bounds memory on large images)
CPU_CROP_BATCH = 64
"""Crops per R-Net / O-Net forward on the CPU."""
MIN_CROP_BATCH = 8
"""The smallest padded crop batch (``crop_batches``)."""
NMS_BLOCK = 256
CHANNELS_LAST = torch.channels_last


ConvSpec = tuple[int, int, int, tuple[int, int] | None]
"""One conv layer: channels in, channels out, kernel, (kernel, stride) of a max-pool or None."""

PNET_CONVS: tuple[ConvSpec, ...] = ((3, 10, 3, (2, 2)), (10, 16, 3, None), (16, 32, 3, None))
RNET_CONVS: tuple[ConvSpec, ...] = ((3, 28, 3, (3, 2)), (28, 48, 3, (3, 2)), (48, 64, 2, None))
ONET_CONVS: tuple[ConvSpec, ...] = (
    (3, 32, 3, (3, 2)),
    (32, 64, 3, (3, 2)),
    (64, 64, 3, (2, 2)),
    (64, 128, 2, None),
)


class _ConvTrunk(nn.Module):
    """conv{i} → prelu{i} → pool{i} (ceil mode) layers, named as in the facenet-pytorch weights."""

    def __init__(self, convs: tuple[ConvSpec, ...]) -> None:
        super().__init__()
        self._layers: list[nn.Module] = []
        for index, (channels_in, channels_out, kernel, pool) in enumerate(convs, start=1):
            layers = [nn.Conv2d(channels_in, channels_out, kernel), nn.PReLU(channels_out)]
            if pool is not None:
                layers.append(nn.MaxPool2d(*pool, ceil_mode=True))
            for kind, layer in zip(("conv", "prelu", "pool"), layers, strict=False):
                self.add_module(f"{kind}{index}", layer)
            self._layers.extend(layers)

    def trunk(self, x: Tensor) -> Tensor:
        for layer in self._layers:
            x = layer(x)
        return x


def _flatten(x: Tensor) -> Tensor:
    """N x C x H x W → N x (W * H * C): the weights come from a transposed (Caffe) layout."""
    return x.permute(0, 3, 2, 1).reshape(x.shape[0], -1)


class PNet(_ConvTrunk):
    """Proposal net: fully convolutional, 12 x 12 window, stride 2."""

    def __init__(self) -> None:
        super().__init__(PNET_CONVS)
        self.conv4_1 = nn.Conv2d(32, 2, kernel_size=1)
        self.conv4_2 = nn.Conv2d(32, 4, kernel_size=1)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(box regression N x 4 x h x w, class probabilities N x 2 x h x w)."""
        x = self.trunk(x)
        return self.conv4_2(x), torch.softmax(self.conv4_1(x), dim=1)


class RNet(_ConvTrunk):
    """Refinement net on 24 x 24 crops."""

    def __init__(self) -> None:
        super().__init__(RNET_CONVS)
        self.dense4 = nn.Linear(576, 128)
        self.prelu4 = nn.PReLU(128)
        self.dense5_1 = nn.Linear(128, 2)
        self.dense5_2 = nn.Linear(128, 4)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(box regression N x 4, class probabilities N x 2)."""
        x = self.prelu4(self.dense4(_flatten(self.trunk(x))))
        return self.dense5_2(x), torch.softmax(self.dense5_1(x), dim=1)


class ONet(_ConvTrunk):
    """Output net on 48 x 48 crops: score, box regression and 5 landmarks."""

    def __init__(self) -> None:
        super().__init__(ONET_CONVS)
        self.dense5 = nn.Linear(1152, 256)
        self.prelu5 = nn.PReLU(256)
        self.dense6_1 = nn.Linear(256, 2)
        self.dense6_2 = nn.Linear(256, 4)
        self.dense6_3 = nn.Linear(256, 10)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(box regression N x 4, landmarks N x 10 (5 x then 5 y), class probabilities N x 2)."""
        x = self.prelu5(self.dense5(_flatten(self.trunk(x))))
        return self.dense6_2(x), self.dense6_3(x), torch.softmax(self.dense6_1(x), dim=1)


@dataclass(frozen=True, slots=True)
class MTCNNNets:
    """The three MTCNN nets, loaded on one device, in eval mode."""

    pnet: PNet
    rnet: RNet
    onet: ONet
    device: str


def _load_net(net: nn.Module, model: ModelName, device: str) -> None:
    state = torch.load(resolve(model), map_location="cpu", weights_only=True)
    net.load_state_dict(state)
    # channels_last: about 3x faster convolutions and ceil-mode pooling on CPU (measured).
    net.to(device=device, dtype=torch.float32)
    net.to(memory_format=CHANNELS_LAST)  # type: ignore[call-overload]
    net.eval().requires_grad_(False)


def _load_nets(device: str) -> MTCNNNets:
    pnet, rnet, onet = PNet(), RNet(), ONet()
    _load_net(pnet, "mtcnn-pnet", device)
    _load_net(rnet, "mtcnn-rnet", device)
    _load_net(onet, "mtcnn-onet", device)
    return MTCNNNets(pnet, rnet, onet, device)


def load_mtcnn(device: str) -> MTCNNNets:
    """The MTCNN nets on ``device``, loaded (and SHA-256 verified) once per process."""
    return MODEL_CACHE.get(("mtcnn", device, None), lambda: _load_nets(device))


@dataclass(frozen=True, slots=True)
class MTCNNInput:
    """An image ready for the cascade."""

    pixels: Tensor  # 1 x 3 x H x W float32, normalised to about [-1, 1]
    integral: Tensor  # (H + 1) x (W + 1) x 3 float64 summed-area table of the 0..255 pixels
    scales: tuple[float, ...]  # pyramid scales, largest first
    width: int
    height: int


def pyramid_scales(
    height: int, width: int, min_face_size: int, factor: float = PYRAMID_FACTOR
) -> tuple[float, ...]:
    """Scales at which a ``min_face_size`` face fills the 12-pixel P-Net window, and smaller."""
    scale = PNET_CELL / min_face_size
    side = min(height, width) * scale
    scales: list[float] = []
    while side >= PNET_CELL:
        scales.append(scale)
        scale *= factor
        side *= factor
    return tuple(scales)


def _normalise(pixels: Tensor) -> Tensor:
    return (pixels - 127.5) * 0.0078125


def summed_area_table(image: RGBImage, device: str = "cpu") -> Tensor:
    """The (H + 1) x (W + 1) x C float64 table ``S[y, x] = image[:y, :x].sum()`` of an image,
    on ``device``. OpenCV's integral is exact (sums of 8-bit values in float64) and about
    eight times faster than two torch cumsums on the CPU."""
    return torch.from_numpy(cv2.integral(image, sdepth=cv2.CV_64F)).to(device)


def prepare_mtcnn(
    image: RGBImage, *, device: str = "cpu", min_face_size: int = DEFAULT_MIN_FACE_SIZE
) -> MTCNNInput:
    """The image on ``device`` (normalised, and as a summed-area table) and its pyramid scales.

    ``InvalidInput`` if the image is not H x W x 3 uint8 or ``min_face_size`` is below 12.
    """
    if not isinstance(image, np.ndarray) or image.ndim != 3 or image.shape[2] != 3:
        raise InvalidInput("The image must be H x W x 3 RGB.")
    if image.dtype != np.uint8:
        raise InvalidInput("The image must be 8-bit RGB.", detail=f"dtype {image.dtype}")
    if min_face_size < PNET_CELL:
        raise InvalidInput(
            f"min_face_size must be at least {PNET_CELL} pixels.", detail=f"got {min_face_size}"
        )
    height, width = int(image.shape[0]), int(image.shape[1])
    contiguous = np.array(image, dtype=np.uint8, order="C")
    pixels = torch.from_numpy(contiguous).to(device)
    scales = pyramid_scales(height, width, min_face_size) if height and width else ()
    normalised = _normalise(pixels.permute(2, 0, 1).to(torch.float32)).unsqueeze(0).contiguous()
    return MTCNNInput(normalised, summed_area_table(contiguous, device), scales, width, height)


def forward_pnet(pnet: PNet, level: Tensor) -> tuple[Tensor, Tensor]:
    """P-Net on one pyramid level of N images (N x 3 x h x w): regression N x 4 x h' x w',
    face probability N x h' x w'."""
    reg, prob = pnet(level.contiguous(memory_format=CHANNELS_LAST))
    return reg, prob[:, 1]


def crop_batches(count: int, device: str) -> list[tuple[int, int, int]]:
    """How ``count`` crops go through R-Net or O-Net on ``device``: ``(start, stop, padded)``
    per forward, ``padded`` rows (``stop - start`` crops, then zeros). A forward takes at
    most ``CPU_CROP_BATCH`` crops on the CPU (``CROP_BATCH`` on a GPU); one with fewer is
    padded up to a power of two of at least ``MIN_CROP_BATCH``. So a net only ever sees a
    handful of batch shapes, however many crops the frames of a video give: oneDNN keeps a
    primitive and its scratch memory per shape, and a shape per crop count made a worker's
    memory grow with the video's length (948 MB after 1 minute, 1147 MB after 5)."""
    most = CPU_CROP_BATCH if torch.device(device).type == "cpu" else CROP_BATCH
    return [
        (start, min(start + most, count), min(most, _padded(min(most, count - start))))
        for start in range(0, count, most)
    ]


def _padded(rows: int) -> int:
    return max(MIN_CROP_BATCH, 1 << (rows - 1).bit_length())


def _run_batched(net: nn.Module, crops: Tensor) -> list[Tensor]:
    """``net`` on ``crops`` in the batches ``crop_batches`` gives, outputs concatenated
    (the padding rows dropped: every row's output depends on its own crop only)."""
    outputs = []
    for start, stop, padded in crop_batches(int(crops.shape[0]), str(crops.device)):
        batch = crops[start:stop]
        if padded > stop - start:
            batch = F.pad(batch, (0, 0, 0, 0, 0, 0, 0, padded - (stop - start)))
        rows = stop - start
        outputs.append([out[:rows] for out in net(batch.contiguous(memory_format=CHANNELS_LAST))])
    return [torch.cat(parts) for parts in zip(*outputs, strict=True)]


def forward_rnet(rnet: RNet, crops: Tensor) -> tuple[Tensor, Tensor]:
    """R-Net on N x 3 x 24 x 24 crops: regression N x 4, face probability N."""
    reg, prob = _run_batched(rnet, crops)
    return reg, prob[:, 1]


def forward_onet(onet: ONet, crops: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """O-Net on N x 3 x 48 x 48 crops: regression N x 4, landmarks N x 10, face probability N."""
    reg, marks, prob = _run_batched(onet, crops)
    return reg, marks, prob[:, 1]


def box_overlap(a: Tensor, b: Tensor, mode: OverlapMode = "union") -> Tensor:
    """Pairwise overlap (len(a) x len(b)) of x1, y1, x2, y2 boxes: IoU or intersection / min."""
    area_a = (a[:, 2] - a[:, 0]).clamp(min=0) * (a[:, 3] - a[:, 1]).clamp(min=0)
    area_b = (b[:, 2] - b[:, 0]).clamp(min=0) * (b[:, 3] - b[:, 1]).clamp(min=0)
    w = torch.minimum(a[:, None, 2], b[None, :, 2]) - torch.maximum(a[:, None, 0], b[None, :, 0])
    h = torch.minimum(a[:, None, 3], b[None, :, 3]) - torch.maximum(a[:, None, 1], b[None, :, 1])
    inter = w.clamp(min=0) * h.clamp(min=0)
    if mode == "min":
        denominator = torch.minimum(area_a[:, None], area_b[None, :])
    else:
        denominator = area_a[:, None] + area_b[None, :] - inter
    return inter / denominator.clamp(min=torch.finfo(inter.dtype).tiny)


def nms(boxes: Tensor, scores: Tensor, threshold: float, mode: OverlapMode = "union") -> Tensor:
    """Greedy non-maximum suppression; indices of the kept boxes, best score first.

    A box is dropped when its overlap with a kept, better-scored box exceeds ``threshold``.
    Exact greedy result, computed block by block: a block is first checked against the boxes
    kept so far, then resolved internally by iterating ``keep = alive & ~any(kept earlier box
    overlaps)`` to its (unique) fixed point, so memory stays O(kept x block).
    """
    order = torch.argsort(scores, descending=True, stable=True)
    ordered = boxes[order]
    kept: list[Tensor] = []
    kept_boxes = ordered[:0]
    for start in range(0, ordered.shape[0], NMS_BLOCK):
        block = ordered[start : start + NMS_BLOCK]
        alive = torch.ones(block.shape[0], dtype=torch.bool, device=boxes.device)
        if kept_boxes.shape[0]:
            alive = ~(box_overlap(kept_boxes, block, mode) > threshold).any(0)
        inner = (box_overlap(block, block, mode) > threshold).triu(1) & alive[:, None]
        keep = alive
        while True:
            updated = alive & ~(inner & keep[:, None]).any(0)
            if torch.equal(updated, keep):
                break
            keep = updated
        index = torch.nonzero(keep).squeeze(1)
        kept.append(index + start)
        kept_boxes = torch.cat([kept_boxes, block[index]])
    if not kept:
        return order[:0]
    return order[torch.cat(kept)]


def apply_regression(boxes: Tensor, reg: Tensor) -> Tensor:
    """Boxes (N x 4) moved by regression offsets (N x 4, fractions of width and height)."""
    size = (boxes[:, 2:4] - boxes[:, 0:2]).repeat(1, 2)
    return boxes + reg * size


def square(boxes: Tensor) -> Tensor:
    """The square boxes (side = longer side) with the same centres."""
    centre = (boxes[:, 0:2] + boxes[:, 2:4]) * 0.5
    half = (boxes[:, 2:4] - boxes[:, 0:2]).amax(dim=1, keepdim=True) * 0.5
    return torch.cat([centre - half, centre + half], dim=1)


def area_resample(integral: Tensor, boxes: Tensor, height: int, width: int) -> Tensor:
    """Resample every box to ``height`` x ``width``: N x 3 x h x w, normalised, channels_last.

    Each output pixel is the exact mean of the image over its (fractional) cell, read from the
    summed-area table ``integral``; reads past the border are clamped, which pads with black.
    """
    rows, cols = integral.shape[0] - 1, integral.shape[1] - 1
    box = boxes.to(integral.dtype)
    ty = torch.linspace(0.0, 1.0, height + 1, dtype=box.dtype, device=box.device)
    tx = torch.linspace(0.0, 1.0, width + 1, dtype=box.dtype, device=box.device)
    ys = (box[:, 1:2] + (box[:, 3:4] - box[:, 1:2]) * ty).clamp(0, rows)
    xs = (box[:, 0:1] + (box[:, 2:3] - box[:, 0:1]) * tx).clamp(0, cols)
    y0 = ys.floor().clamp(max=rows - 1)
    x0 = xs.floor().clamp(max=cols - 1)
    fy, fx = (ys - y0)[:, :, None, None], (xs - x0)[:, None, :, None]
    # The four table entries around each point, read as rows of the flattened table (four
    # one-dimensional gathers instead of six two-dimensional ones: the same values).
    stride = cols + 1
    at = (y0.long() * stride)[:, :, None] + x0.long()[:, None, :]  # N x (h + 1) x (w + 1)
    flat = integral.reshape(-1, integral.shape[2])
    top_left, top_right = flat[at], flat[at + 1]
    bottom_left, bottom_right = flat[at + stride], flat[at + stride + 1]
    # The summed-area table of a piecewise-constant image is bilinear inside each pixel.
    top = top_left + (top_right - top_left) * fx
    bottom = bottom_left + (bottom_right - bottom_left) * fx
    table = top + (bottom - top) * fy  # N x (h + 1) x (w + 1) x 3
    sums = table[:, 1:, 1:] - table[:, :-1, 1:] - table[:, 1:, :-1] + table[:, :-1, :-1]
    cell = (box[:, 2] - box[:, 0]) * (box[:, 3] - box[:, 1]) / (height * width)
    means = sums / cell.clamp(min=1e-12)[:, None, None, None]
    return _normalise(means.to(torch.float32)).permute(0, 3, 1, 2)


def _valid(boxes: Tensor) -> Tensor:
    return (boxes[:, 2] > boxes[:, 0]) & (boxes[:, 3] > boxes[:, 1])


def _level_boxes(
    prepared: MTCNNInput, level_h: int, level_w: int, reg: Tensor, prob: Tensor, threshold: float
) -> Tensor | None:
    """One image's P-Net candidates at one pyramid level, after the level's NMS."""
    iy, ix = torch.nonzero(prob >= threshold, as_tuple=True)
    if iy.numel() == 0:
        return None
    cell = torch.stack([ix, iy], dim=1).to(torch.float32) * PNET_STRIDE
    to_image = torch.tensor(
        [prepared.width / level_w, prepared.height / level_h], device=cell.device
    )
    boxes = torch.cat([cell * to_image, (cell + PNET_CELL) * to_image], dim=1)
    score = prob[iy, ix]
    offsets = reg[:, iy, ix].T
    pick = nms(boxes, score, NMS_PNET_SCALE)
    return torch.cat([boxes[pick], score[pick, None], offsets[pick]], dim=1)


def _merge_levels(prepared: MTCNNInput, found: list[Tensor]) -> Tensor:
    """Candidates of every level → NMS across levels, regressed, squared boxes N x 5."""
    if not found:
        return prepared.pixels.new_zeros((0, 5))
    candidates = torch.cat(found)
    pick = nms(candidates[:, :4], candidates[:, 4], NMS_PNET_ALL)
    candidates = candidates[pick]
    boxes = square(apply_regression(candidates[:, :4], candidates[:, 5:9]))
    result = torch.cat([boxes, candidates[:, 4:5]], dim=1)
    return result[_valid(result)]


def propose_pnet(nets: MTCNNNets, prepared: Sequence[MTCNNInput], threshold: float) -> list[Tensor]:
    """Stage 1: P-Net over each image's pyramid; squared candidate boxes N x 5
    (x1, y1, x2, y2, score) per image. Images of the same size share one forward per
    pyramid level (stacked on the batch dimension)."""
    found: list[list[Tensor]] = [[] for _ in prepared]
    by_size: dict[tuple[int, int], list[int]] = {}
    for index, item in enumerate(prepared):
        by_size.setdefault((item.height, item.width), []).append(index)
    for (height, width), indices in by_size.items():
        group = [prepared[i] for i in indices]
        pixels = group[0].pixels if len(group) == 1 else torch.cat([g.pixels for g in group])
        for scale in group[0].scales:
            level_h, level_w = math.ceil(height * scale), math.ceil(width * scale)
            # The pyramid is made as facenet-pytorch makes it (torch "area" = adaptive
            # average pooling); an exact fractional-area pyramid let through one more weak
            # false positive (0.87) on skimage's astronaut, as cv2.INTER_AREA does.
            level = F.interpolate(pixels, size=(level_h, level_w), mode="area")
            regs, probs = forward_pnet(nets.pnet, level)
            for row, index in enumerate(indices):
                boxes = _level_boxes(
                    prepared[index], level_h, level_w, regs[row], probs[row], threshold
                )
                if boxes is not None:
                    found[index].append(boxes)
    return [_merge_levels(item, boxes) for item, boxes in zip(prepared, found, strict=True)]


def _crops(prepared: Sequence[MTCNNInput], candidates: Sequence[Tensor], size: int) -> Tensor:
    """Every image's candidate crops resampled to ``size``, concatenated in image order."""
    return torch.cat(
        [
            area_resample(item.integral, boxes[:, :4], size, size)
            for item, boxes in zip(prepared, candidates, strict=True)
        ]
    )


def _split(values: Sequence[Tensor], candidates: Sequence[Tensor]) -> list[list[Tensor]]:
    """Per-image slices of batched net outputs (in ``_crops`` order)."""
    counts = [int(c.shape[0]) for c in candidates]
    parts = [torch.split(v, counts) for v in values]
    return [[part[i] for part in parts] for i in range(len(counts))]


def refine_rnet(
    nets: MTCNNNets, prepared: Sequence[MTCNNInput], candidates: list[Tensor], threshold: float
) -> list[Tensor]:
    """Stage 2: R-Net on the 24 x 24 crops of every image in one batch; kept, regressed,
    squared boxes N x 5 per image."""
    if sum(int(c.shape[0]) for c in candidates) == 0:
        return candidates
    reg, score = forward_rnet(nets.rnet, _crops(prepared, candidates, RNET_SIZE))
    refined = []
    for boxes_in, (reg_i, score_i) in zip(
        candidates, _split([reg, score], candidates), strict=True
    ):
        passed = score_i > threshold
        boxes, score_p, reg_p = boxes_in[passed, :4], score_i[passed], reg_i[passed]
        pick = nms(boxes, score_p, NMS_RNET)
        result = torch.cat(
            [square(apply_regression(boxes[pick], reg_p[pick])), score_p[pick, None]], dim=1
        )
        refined.append(result[_valid(result)])
    return refined


def output_onet(
    nets: MTCNNNets, prepared: Sequence[MTCNNInput], candidates: list[Tensor], threshold: float
) -> list[tuple[Tensor, Tensor, Tensor]]:
    """Stage 3: O-Net on the 48 x 48 crops of every image in one batch; per image boxes
    N x 4, scores N, landmarks N x 5 x 2 (pixels)."""
    if sum(int(c.shape[0]) for c in candidates) == 0:
        return [(c[:, :4], c[:, 4], c.new_zeros((0, 5, 2))) for c in candidates]
    reg, marks, score = forward_onet(nets.onet, _crops(prepared, candidates, ONET_SIZE))
    outputs = []
    for boxes_in, (reg_i, marks_i, score_i) in zip(
        candidates, _split([reg, marks, score], candidates), strict=True
    ):
        passed = score_i > threshold
        boxes, score_p = boxes_in[passed, :4], score_i[passed]
        reg_p, marks_p = reg_i[passed], marks_i[passed]
        size = boxes[:, 2:4] - boxes[:, 0:2]
        landmarks = (
            boxes[:, None, 0:2]
            + torch.stack([marks_p[:, :5], marks_p[:, 5:]], dim=2) * size[:, None]
        )
        boxes = apply_regression(boxes, reg_p)
        pick = nms(boxes, score_p, NMS_ONET, mode="min")
        outputs.append((boxes[pick], score_p[pick], landmarks[pick]))
    return outputs


def normalize_mtcnn(
    boxes: Tensor, scores: Tensor, landmarks: Tensor, *, width: int, height: int
) -> list[Face]:
    """``Face`` objects, best score first; boxes clipped to the image."""
    order = torch.argsort(scores, descending=True, stable=True)
    box_array = boxes[order].double().cpu().numpy()
    box_array[:, [0, 2]] = box_array[:, [0, 2]].clip(0, width)
    box_array[:, [1, 3]] = box_array[:, [1, 3]].clip(0, height)
    score_array = scores[order].double().cpu().numpy()
    mark_array = landmarks[order].cpu().numpy().astype(np.float32)
    return [
        Face(Box(*(float(v) for v in b)), float(s), np.ascontiguousarray(m))
        for b, s, m in zip(box_array, score_array, mark_array, strict=True)
        if b[2] > b[0] and b[3] > b[1]
    ]


def detect_with_mtcnn(
    image: RGBImage,
    *,
    device: str = "cpu",
    min_face_size: int = DEFAULT_MIN_FACE_SIZE,
    thresholds: tuple[float, float, float] = DEFAULT_THRESHOLDS,
) -> list[Face]:
    """Faces in ``image`` (H x W x 3 uint8 RGB) with boxes, scores and 5 landmarks, best first."""
    return detect_batch_with_mtcnn(
        [image], device=device, min_face_size=min_face_size, thresholds=thresholds
    )[0]


def detect_batch_with_mtcnn(
    images: Sequence[RGBImage],
    *,
    device: str = "cpu",
    min_face_size: int = DEFAULT_MIN_FACE_SIZE,
    thresholds: tuple[float, float, float] = DEFAULT_THRESHOLDS,
) -> list[list[Face]]:
    """``detect_with_mtcnn`` of several images at once: P-Net shares a forward per pyramid
    level among images of the same size, R-Net and O-Net run on the crops of every image
    in one batch. The faces found are those each image gives alone."""
    if len(thresholds) != 3 or not all(0.0 <= t <= 1.0 for t in thresholds):
        raise InvalidInput("MTCNN needs three thresholds in [0, 1].", detail=f"got {thresholds}")
    if not images:
        return []
    with torch.inference_mode():
        prepared = [
            prepare_mtcnn(image, device=device, min_face_size=min_face_size) for image in images
        ]
        work = [i for i, item in enumerate(prepared) if item.scales]
        faces: list[list[Face]] = [[] for _ in images]
        if not work:
            return faces
        nets = load_mtcnn(device)
        active = [prepared[i] for i in work]
        candidates = propose_pnet(nets, active, thresholds[0])
        candidates = refine_rnet(nets, active, candidates, thresholds[1])
        outputs = output_onet(nets, active, candidates, thresholds[2])
        for index, item, (boxes, scores, landmarks) in zip(work, active, outputs, strict=True):
            faces[index] = normalize_mtcnn(
                boxes, scores, landmarks, width=item.width, height=item.height
            )
        return faces
