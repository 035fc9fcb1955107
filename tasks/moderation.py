"""NSFW moderation with NudeNet's 320n detector (YOLOv8n, ONNX) on onnxruntime, on the CPU.

``moderate_images`` → ``detect_batch_with_nudenet`` → ``prepare_nudenet`` (fit into the
top-left of a black 320 x 320 canvas, RGB / 255, as NudeNet pads right/bottom to a square
and resizes) → ``forward_nudenet`` (the only code that runs the session: every image of a
call in one batch, as the graph's batch dimension is dynamic) → ``normalize_nudenet`` (YOLOv8 head:
rows of centre x, centre y, width, height and one score per label; keep the best label of
each row at or above ``REPORT_FLOOR``, greedy NMS, map back to the image). The file comes
from the ``nudenet`` wheel (``tasks.registry``); the package itself is never imported.

``moderate_images`` compares the detections with a ``ModerationPolicy`` (blocked labels and
their thresholds); ``enforce`` raises ``ContentBlocked`` (permanent) when the policy's mode
is ``enforce`` and any image was flagged. The session always runs on the CPU provider, so
the check costs no GPU work and runs before the face detector.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np
import numpy.typing as npt

from tasks.batch import in_chunks
from tasks.errors import ContentBlocked, ModelUnavailable
from tasks.onnx_runtime import OnnxModel, check_rgb, load_onnx_model, to_nchw
from tasks.options import NSFW_LABELS, ModerationPolicy, NsfwLabel
from tasks.registry import ModelName
from tasks.scrfd import letterbox_size, nms
from tasks.types import Box, RGBImage

MODEL: ModelName = "nudenet-320n"
MODERATION_DEVICE = "cpu"
REPORT_FLOOR = 0.2
"""Lowest score a detection is reported with (NudeNet's own floor)."""
NMS_THRESHOLD = 0.45

F32 = npt.NDArray[np.float32]


@dataclass(frozen=True, slots=True)
class NsfwDetection:
    """One region the detector labelled, in the image's pixel coordinates."""

    label: NsfwLabel
    score: float
    box: Box


@dataclass(frozen=True, slots=True)
class ModerationVerdict:
    """What the check found in one image (``role``: source, target or result)."""

    role: str
    detections: tuple[NsfwDetection, ...]
    flagged: tuple[NsfwDetection, ...]  # blocked labels at or above their threshold

    def summary(self) -> str:
        """``role: LABEL 0.83, ...`` of the flagged detections (no coordinates)."""
        hits = ", ".join(f"{d.label} {d.score:.2f}" for d in self.flagged) or "nothing flagged"
        return f"{self.role}: {hits}"


@dataclass(frozen=True, slots=True)
class NudenetInput:
    """A letterboxed blob and how to map detections back to the original image."""

    blob: F32  # 1 x 3 x 320 x 320, RGB in [0, 1]
    scale_x: float  # input pixels per original pixel
    scale_y: float
    image_width: int
    image_height: int


def prepare_nudenet(image: RGBImage, input_size: tuple[int, int]) -> NudenetInput:
    """Resize keeping the aspect ratio into the top-left of a black canvas; RGB / 255."""
    check_rgb(image, "image")
    height, width = image.shape[:2]
    new_w, new_h = letterbox_size(width, height, input_size)
    shrink = new_w < width / 2  # large images: area averaging, not aliased sampling
    resized = cv2.resize(
        image, (new_w, new_h), interpolation=cv2.INTER_AREA if shrink else cv2.INTER_LINEAR
    )
    canvas = np.zeros((input_size[1], input_size[0], 3), dtype=np.uint8)
    canvas[:new_h, :new_w] = resized
    return NudenetInput(
        blob=to_nchw(canvas, 0.0, 255.0),
        scale_x=new_w / width,
        scale_y=new_h / height,
        image_width=width,
        image_height=height,
    )


def forward_nudenet(model: OnnxModel, blob: F32) -> F32:
    """Run the detector on an N x 3 x 320 x 320 blob: the raw N x (4 + labels) x rows
    prediction."""
    (out,) = model.session.run([model.output_names[0]], {model.input_names[0]: blob})
    return np.asarray(out, dtype=np.float32)


def normalize_nudenet(
    pred: F32, prepared: NudenetInput, *, floor: float = REPORT_FLOOR
) -> list[NsfwDetection]:
    """Detections in the original image's coordinates, best score first."""
    if pred.ndim != 3 or pred.shape[:2] != (1, 4 + len(NSFW_LABELS)):
        raise ModelUnavailable(
            "The moderation model is not the expected model.", detail=f"output shape {pred.shape}"
        )
    rows = pred[0].T  # (rows, 4 + labels)
    label_scores = rows[:, 4:]
    best = label_scores.argmax(axis=1)
    scores = label_scores[np.arange(len(rows)), best]
    hit = scores >= floor
    if not hit.any():
        return []
    cx, cy, w, h = rows[hit, :4].T
    boxes = np.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], axis=1)
    kept_scores, kept_labels = scores[hit], best[hit]
    scale = np.array([prepared.scale_x, prepared.scale_y] * 2, dtype=np.float32)
    limit = np.array([prepared.image_width, prepared.image_height] * 2, dtype=np.float32)
    found = []
    for i in nms(boxes, kept_scores, NMS_THRESHOLD):
        corners = np.clip(boxes[i] / scale, 0.0, limit)
        found.append(
            NsfwDetection(
                label=NSFW_LABELS[int(kept_labels[i])],  # type: ignore[arg-type]
                score=float(kept_scores[i]),
                box=Box(*(float(v) for v in corners)),
            )
        )
    return found


def detect_batch_with_nudenet(
    images: Sequence[RGBImage],
    *,
    model_dir: str | Path | None = None,
    pins: Mapping[str, str] | None = None,
    floor: float = REPORT_FLOOR,
    threads: int = 0,
) -> list[list[NsfwDetection]]:
    """``detect_with_nudenet`` of several images in one forward (one batch), on a session
    with ``threads`` intra-op threads (0: onnxruntime's default, one per core)."""
    for image in images:
        check_rgb(image, "image")
    if not images:
        return []
    model = load_onnx_model(
        MODEL, device=MODERATION_DEVICE, model_dir=model_dir, pins=pins, threads=threads
    )
    prepared = [prepare_nudenet(image, model.input_size()) for image in images]
    pred = forward_nudenet(model, np.concatenate([p.blob for p in prepared]))
    return [
        normalize_nudenet(pred[i : i + 1], item, floor=floor) for i, item in enumerate(prepared)
    ]


def detect_with_nudenet(
    image: RGBImage,
    *,
    model_dir: str | Path | None = None,
    pins: Mapping[str, str] | None = None,
    floor: float = REPORT_FLOOR,
) -> list[NsfwDetection]:
    """Every region of ``image`` (RGB uint8) NudeNet labels with at least ``floor``."""
    return detect_batch_with_nudenet([image], model_dir=model_dir, pins=pins, floor=floor)[0]


def moderate_images(
    images: Mapping[str, RGBImage],
    policy: ModerationPolicy,
    *,
    model_dir: str | Path | None = None,
    pins: Mapping[str, str] | None = None,
    calls: int = 1,
    threads: int = 0,
) -> tuple[ModerationVerdict, ...]:
    """A verdict per image (role → image, in order): its detections and those of them the
    policy flags. The images go through the detector in ``calls`` batches at once (one
    batch when 1), on a session with ``threads`` intra-op threads (0: one per core)."""
    floor = min([REPORT_FLOOR, policy.threshold, *policy.label_thresholds.values()])
    found = in_chunks(
        lambda chunk: detect_batch_with_nudenet(
            chunk, model_dir=model_dir, pins=pins, floor=floor, threads=threads
        ),
        list(images.values()),
        threads=calls,
    )
    return tuple(
        ModerationVerdict(
            role,
            tuple(detections),
            tuple(
                d
                for d in detections
                if d.label in policy.blocked_labels and d.score >= policy.threshold_for(d.label)
            ),
        )
        for role, detections in zip(images, found, strict=True)
    )


def moderate_image(
    image: RGBImage,
    role: str,
    policy: ModerationPolicy,
    *,
    model_dir: str | Path | None = None,
    pins: Mapping[str, str] | None = None,
) -> ModerationVerdict:
    """The detections in ``image`` and those of them the policy flags."""
    (verdict,) = moderate_images({role: image}, policy, model_dir=model_dir, pins=pins)
    return verdict


def enforce(verdicts: Sequence[ModerationVerdict], policy: ModerationPolicy) -> None:
    """``ContentBlocked`` when the policy enforces and any verdict flagged something."""
    flagged = [v for v in verdicts if v.flagged]
    if flagged and policy.mode == "enforce":
        raise ContentBlocked(detail="; ".join(v.summary() for v in flagged))


def warm_up_moderation(
    *,
    model_dir: str | Path | None = None,
    pins: Mapping[str, str] | None = None,
    threads: int = 0,
) -> None:
    """Load the detector (its session with ``threads`` intra-op threads) and run it once on
    a grey image."""
    detect_batch_with_nudenet(
        [np.full((64, 64, 3), 128, dtype=np.uint8)], model_dir=model_dir, pins=pins, threads=threads
    )
