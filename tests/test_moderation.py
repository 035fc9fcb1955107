"""NSFW moderation: NudeNet's 320n detector from its wheel, on real package images.

The flagged image is skimage's ``colorwheel()`` (a synthetic HSV colour wheel that the
package ships): the 320n detector labels it ``BUTTOCKS_EXPOSED`` at 0.83, and keeps
flagging it resized from 128 to 1200 px and set into a photo. It was the one image with a
score over 0.5 for a blocked label among every image skimage, matplotlib and insightface
ship (whole images; crops of coffee, camera and logo reach 0.5-0.7). The sample photos
score at most 0.3 (the coffee cup, ``BUTTOCKS_EXPOSED``) on the blocked labels.
"""

from __future__ import annotations

import sys
from functools import cache
from typing import Any, cast

import cv2
import numpy as np
import pytest

from tasks import registry
from tasks.detect import detect_faces
from tasks.errors import ContentBlocked, ModelUnavailable
from tasks.models import MODEL_CACHE
from tasks.moderation import (
    MODEL,
    NudenetInput,
    detect_batch_with_nudenet,
    detect_with_nudenet,
    moderate_image,
    moderate_images,
    normalize_nudenet,
)
from tasks.onnx_runtime import CPU_PROVIDER, load_onnx_model
from tasks.options import NSFW_LABELS, FusionOptions, ModerationPolicy
from tasks.pipeline import (
    PipelineContext,
    moderate_inputs_stage,
    moderate_result_stage,
    warm_up,
)
from tasks.stages import fuse_images
from tests.samples import (
    astronaut_jpeg_bytes,
    astronaut_rgb,
    colorwheel_rgb,
    encode,
    grace_hopper_rgb,
    no_face_rgb,
    t1_rgb,
)

ENFORCE = ModerationPolicy()
REPORT = ModerationPolicy(mode="report")


def colorwheel() -> np.ndarray:
    return colorwheel_rgb()


@cache
def hopper_with_colorwheel() -> np.ndarray:
    """grace_hopper.jpg with the colour wheel (300 px) in its bottom-right corner."""
    image = grace_hopper_rgb().copy()
    image[-300:, -300:] = cv2.resize(colorwheel(), (300, 300), interpolation=cv2.INTER_AREA)
    return image


def _session_keys() -> list[tuple[str, str, tuple[Any, ...]]]:
    """The detector's keys in the model cache: an ONNX session's third part is
    ``(providers, sha256, intra-op threads)`` (``tasks.onnx_runtime.load_onnx_model``)."""
    loaded = MODEL_CACHE.keys()  # a copy, taken under the cache's lock
    keys = [k for k in loaded if k[0] == MODEL]
    return cast(list[tuple[str, str, tuple[Any, ...]]], keys)


def _iou(a: tuple[float, ...], b: tuple[float, ...]) -> float:
    w = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    h = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - w * h
    return w * h / union


def test_detector_comes_from_the_wheel_pinned_without_importing_nudenet() -> None:
    spec = registry.REGISTRY[MODEL]
    path = registry.resolve(MODEL)
    assert path.name == "320n.onnx" and "nudenet" in path.parts
    assert registry.sha256_file(path) == spec.sha256
    assert "AGPL-3.0" in spec.licence
    assert load_onnx_model(MODEL).input_size() == (320, 320)
    assert "nudenet" not in sys.modules


def test_sample_photos_pass_and_their_faces_are_what_it_sees() -> None:
    for image in (astronaut_rgb(), grace_hopper_rgb(), t1_rgb(), no_face_rgb()):
        verdict = moderate_image(image, "target", ENFORCE)
        assert verdict.flagged == (), verdict.summary()
        blocked = [d.score for d in verdict.detections if d.label in ENFORCE.blocked_labels]
        assert max(blocked, default=0.0) < 0.4
    # Its face boxes land on the faces our detector finds: the real model, fed right.
    image = astronaut_rgb()
    face = detect_faces(image)[0].box
    faces = [d for d in moderate_image(image, "source", ENFORCE).detections if "FACE" in d.label]
    assert faces and faces[0].score > 0.6
    box = faces[0].box
    assert _iou((box.x1, box.y1, box.x2, box.y2), (face.x1, face.y1, face.x2, face.y2)) > 0.4


def test_colorwheel_is_flagged_at_any_size_with_boxes_in_image_pixels() -> None:
    for side in (128, 371, 1200):
        image = np.asarray(
            cv2.resize(colorwheel(), (side, side), interpolation=cv2.INTER_AREA), dtype=np.uint8
        )
        verdict = moderate_image(image, "target", ENFORCE)
        assert [d.label for d in verdict.flagged] == ["BUTTOCKS_EXPOSED"], verdict
        hit = verdict.flagged[0]
        assert hit.score > 0.7
        assert hit.box.x1 < 0.1 * side and hit.box.x2 > 0.9 * side  # the whole wheel
        assert hit.box.y1 < 0.1 * side and hit.box.y2 > 0.9 * side
    inset = moderate_image(hopper_with_colorwheel(), "target", ENFORCE).flagged
    assert len(inset) == 1 and inset[0].box.x1 > 150 and inset[0].box.y1 > 250


def test_thresholds_and_labels_come_from_the_policy() -> None:
    image = colorwheel()
    assert not moderate_image(image, "target", ModerationPolicy(threshold=0.95)).flagged
    per_label = ModerationPolicy(label_thresholds={"BUTTOCKS_EXPOSED": 0.95})
    assert not moderate_image(image, "target", per_label).flagged
    other_labels = ModerationPolicy(blocked_labels=("FEMALE_BREAST_EXPOSED",))
    assert not moderate_image(image, "target", other_labels).flagged
    # A lower threshold reports what the default floor (0.2) would hide.
    coffee = moderate_image(no_face_rgb(), "target", ModerationPolicy(threshold=0.25))
    assert [d.label for d in coffee.flagged] == ["BUTTOCKS_EXPOSED"]
    with pytest.raises(ValueError):
        ModerationPolicy(label_thresholds={"BUTTOCKS_EXPOSED": 1.5})
    with pytest.raises(ValueError):
        ModerationPolicy(blocked_labels=("NOT_A_LABEL",))  # type: ignore[arg-type]


def test_enforce_blocks_inputs_permanently_and_report_only_reports() -> None:
    images = {"source": astronaut_rgb(), "target": colorwheel()}
    with pytest.raises(ContentBlocked) as info:
        moderate_inputs_stage(images, PipelineContext(moderation=ENFORCE))
    assert info.value.code == "content_blocked" and info.value.permanent
    assert info.value.detail is not None and info.value.detail.startswith("target: BUTTOCKS")
    verdicts = moderate_inputs_stage(images, PipelineContext(moderation=REPORT))
    assert [v.role for v in verdicts] == ["source", "target"]
    assert not verdicts[0].flagged and verdicts[1].flagged
    off = PipelineContext(moderation=ModerationPolicy(mode="off"))
    assert moderate_inputs_stage(images, off) == ()
    assert moderate_result_stage(colorwheel(), off) == ()
    no_inputs = PipelineContext(moderation=ModerationPolicy(check_inputs=False))
    assert moderate_inputs_stage(images, no_inputs) == ()
    with pytest.raises(ContentBlocked) as info:
        moderate_result_stage(colorwheel(), no_inputs)
    assert info.value.detail is not None and info.value.detail.startswith("result: ")


def test_pipeline_checks_inputs_before_detection_and_the_result_after_blending() -> None:
    source, target = astronaut_jpeg_bytes(), encode(hopper_with_colorwheel(), "PNG")
    loads = MODEL_CACHE.total_loads("mtcnn-pnet")
    with pytest.raises(ContentBlocked):
        fuse_images(source, encode(colorwheel(), "PNG"))  # no face in it: never looked for
    assert MODEL_CACHE.total_loads("mtcnn-pnet") == loads
    result_only = PipelineContext(moderation=ModerationPolicy(check_inputs=False))
    with pytest.raises(ContentBlocked) as info:
        fuse_images(source, target, FusionOptions(), result_only)
    assert info.value.detail is not None and info.value.detail.startswith("result: ")

    reported = fuse_images(source, target, FusionOptions(), PipelineContext(moderation=REPORT))
    assert reported.faces_replaced == 1
    assert [f.split(":")[0] for f in reported.moderation_flags] == ["target", "result"]
    assert all("BUTTOCKS_EXPOSED" in f for f in reported.moderation_flags)
    assert {"moderate_inputs", "moderate_result"} <= set(reported.timings_ms)

    clean = fuse_images(source, encode(grace_hopper_rgb(), "PNG"))
    assert clean.moderation_flags == () and clean.faces_replaced == 1


def test_one_batch_finds_what_each_image_gives_alone() -> None:
    images = [astronaut_rgb(), hopper_with_colorwheel(), no_face_rgb(), t1_rgb(), colorwheel()]
    batched = detect_batch_with_nudenet(images)
    assert len(batched) == len(images) and detect_batch_with_nudenet([]) == []
    assert any(found for found in batched)
    for image, found in zip(images, batched, strict=True):
        alone = detect_with_nudenet(image)
        assert [d.label for d in found] == [d.label for d in alone]
        for a, b in zip(found, alone, strict=True):
            assert a.score == pytest.approx(b.score, abs=1e-4)
            corners = [(a.box.x1, b.box.x1), (a.box.y1, b.box.y1), (a.box.x2, b.box.x2)]
            assert all(abs(u - v) < 0.05 for u, v in [*corners, (a.box.y2, b.box.y2)])
    verdicts = moderate_images({"source": astronaut_rgb(), "target": colorwheel()}, ENFORCE)
    assert [v.role for v in verdicts] == ["source", "target"]
    assert verdicts[1] == moderate_image(colorwheel(), "target", ENFORCE)
    assert not verdicts[0].flagged and verdicts[1].flagged


def test_the_session_runs_on_the_cpu_and_loads_once() -> None:
    warm_up(PipelineContext())
    keys = _session_keys()
    assert keys and all(k[1] == "cpu" and k[2][0] == (CPU_PROVIDER,) for k in keys)
    before = MODEL_CACHE.total_loads(MODEL)
    for _ in range(3):
        detect_with_nudenet(astronaut_rgb())
    assert MODEL_CACHE.total_loads(MODEL) == before


def test_a_jobs_inputs_are_moderated_in_two_calls_at_once_on_one_thread_each(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A single job on the CPU (``calls=ctx.model_threads``): its source and target go
    through NudeNet in two calls that run at the same time, on a session of
    ``ctx.call_threads`` intra-op threads, with the verdicts of one batch."""
    import threading

    from tasks import moderation

    images = {"source": astronaut_rgb(), "target": colorwheel()}
    ctx = PipelineContext(moderation=REPORT, model_threads=2, call_threads=1)
    alone = moderate_inputs_stage(images, ctx)
    real = moderation.detect_batch_with_nudenet
    inside = threading.Barrier(2, timeout=10)
    calls: list[tuple[int, int]] = []

    def together(
        pictures: list[np.ndarray], **kwargs: object
    ) -> list[list[moderation.NsfwDetection]]:
        calls.append((len(pictures), int(kwargs["threads"])))  # type: ignore[call-overload]
        inside.wait()  # BrokenBarrierError unless the other call runs at the same time
        return real(pictures, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(moderation, "detect_batch_with_nudenet", together)
    verdicts = moderate_inputs_stage(images, ctx, calls=ctx.model_threads)
    assert calls == [(1, 1), (1, 1)]
    assert [v.role for v in verdicts] == ["source", "target"]
    for split, batched in zip(verdicts, alone, strict=True):
        assert [d.label for d in split.detections] == [d.label for d in batched.detections]
        assert [d.score for d in split.detections] == pytest.approx(
            [d.score for d in batched.detections], abs=1e-4
        )
    assert verdicts[1].flagged and not verdicts[0].flagged
    assert any(k[2][2] == 1 for k in _session_keys())
    assert moderate_images({}, REPORT, calls=2) == ()


def test_a_wrong_model_or_pin_is_model_unavailable() -> None:
    with pytest.raises(ModelUnavailable):
        detect_with_nudenet(astronaut_rgb(), pins={MODEL: "0" * 64})
    prepared = NudenetInput(np.zeros((1, 3, 320, 320), np.float32), 1.0, 1.0, 320, 320)
    with pytest.raises(ModelUnavailable):
        normalize_nudenet(np.zeros((1, 4 + len(NSFW_LABELS) + 1, 10), np.float32), prepared)
    assert normalize_nudenet(np.zeros((1, 4 + len(NSFW_LABELS), 10), np.float32), prepared) == []
