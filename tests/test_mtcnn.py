"""MTCNN on real photos (and on none), its NMS and crop resampling on hand-made inputs."""

from __future__ import annotations

import itertools
import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tasks import mtcnn
from tasks.errors import InvalidInput
from tasks.models import MODEL_CACHE
from tasks.types import Face
from tests import samples, videos

ONE_FACE = {"astronaut": samples.astronaut_rgb, "grace_hopper": samples.grace_hopper_rgb}


def _as_tensor(boxes: list[list[float]]) -> torch.Tensor:
    return torch.tensor(boxes, dtype=torch.float32)


def _iou(face: Face, box: tuple[float, float, float, float]) -> float:
    mine = _as_tensor([[face.box.x1, face.box.y1, face.box.x2, face.box.y2]])
    return float(mtcnn.box_overlap(mine, _as_tensor([list(box)]))[0, 0])


def _assert_plausible_landmarks(face: Face) -> None:
    marks = face.landmarks
    assert marks.dtype == np.float32 and marks.shape == (5, 2)
    assert all(face.box.contains(float(x), float(y)) for x, y in marks)
    left_eye, right_eye, nose, mouth_left, mouth_right = marks
    assert left_eye[0] < right_eye[0]
    assert mouth_left[0] < mouth_right[0]
    assert max(left_eye[1], right_eye[1]) < nose[1] < min(mouth_left[1], mouth_right[1])


@pytest.mark.parametrize("name", sorted(ONE_FACE))
def test_one_face_with_plausible_landmarks(name: str) -> None:
    faces = mtcnn.detect_with_mtcnn(ONE_FACE[name]())
    assert len(faces) == 1
    assert faces[0].score > 0.9
    _assert_plausible_landmarks(faces[0])


def test_astronaut_face_is_where_the_face_is() -> None:
    # Eileen Collins' face in skimage's 512 x 512 astronaut: roughly x 170-270, y 40-170.
    (face,) = mtcnn.detect_with_mtcnn(samples.astronaut_rgb())
    assert _iou(face, (170, 40, 270, 170)) > 0.6
    assert 170 <= face.box.x1 < face.box.x2 <= 280 and 40 <= face.box.y1 < face.box.y2 <= 185


def test_group_photo_finds_the_six_people_best_score_first() -> None:
    faces = mtcnn.detect_with_mtcnn(samples.t1_rgb())
    assert len(faces) >= 5
    scores = [face.score for face in faces]
    assert scores == sorted(scores, reverse=True)
    for face in faces:
        assert face.score > 0.7
        assert all(face.box.contains(float(x), float(y), margin=2.0) for x, y in face.landmarks)
        assert 40 < face.box.width < 300  # people at a table, none tiny or huge


def test_a_batch_finds_what_each_image_finds_alone() -> None:
    """Batched detection (same-size images share P-Net forwards, R-Net and O-Net run on
    every image's crops at once) gives each image the faces it gives alone."""
    images = [
        samples.astronaut_rgb(),
        samples.t1_rgb(),
        samples.grace_hopper_rgb(),
        np.ascontiguousarray(samples.astronaut_rgb()[:, ::-1]),  # same size as the first
        np.zeros((64, 64, 3), np.uint8),
        np.zeros((8, 8, 3), np.uint8),  # too small for the pyramid: no work, no face
    ]
    alone = [mtcnn.detect_with_mtcnn(image) for image in images]
    together = mtcnn.detect_batch_with_mtcnn(images)
    assert [len(faces) for faces in together] == [len(faces) for faces in alone]
    assert len(alone[1]) >= 5 and len(alone[4]) == 0
    for batch_faces, single_faces in zip(together, alone, strict=True):
        for a, b in zip(batch_faces, single_faces, strict=True):
            box_a = (a.box.x1, a.box.y1, a.box.x2, a.box.y2)
            box_b = (b.box.x1, b.box.y1, b.box.x2, b.box.y2)
            assert np.allclose(box_a, box_b, atol=1e-3)
            assert a.score == pytest.approx(b.score, abs=1e-5)
            assert np.allclose(a.landmarks, b.landmarks, atol=1e-3)
    assert mtcnn.detect_batch_with_mtcnn([]) == []


def test_no_face_in_a_coffee_cup() -> None:
    assert mtcnn.detect_with_mtcnn(samples.no_face_rgb()) == []


@pytest.mark.parametrize("shape", [(240, 320, 3), (8, 8, 3), (11, 500, 3)])
def test_blank_and_tiny_images_have_no_face(shape: tuple[int, int, int]) -> None:
    assert mtcnn.detect_with_mtcnn(np.full(shape, 128, dtype=np.uint8)) == []


def test_min_face_size_drops_small_faces() -> None:
    image = samples.astronaut_rgb()
    assert len(mtcnn.detect_with_mtcnn(image, min_face_size=60)) == 1
    assert mtcnn.detect_with_mtcnn(image, min_face_size=200) == []


@pytest.mark.parametrize(
    "image",
    [
        np.zeros((64, 64), dtype=np.uint8),
        np.zeros((64, 64, 4), dtype=np.uint8),
        np.zeros((64, 64, 3), dtype=np.float32),
    ],
)
def test_non_rgb_input_is_invalid(image: np.ndarray) -> None:
    with pytest.raises(InvalidInput):
        mtcnn.detect_with_mtcnn(image)


def test_bad_options_are_invalid() -> None:
    image = samples.astronaut_rgb()
    with pytest.raises(InvalidInput):
        mtcnn.detect_with_mtcnn(image, min_face_size=8)
    with pytest.raises(InvalidInput):
        mtcnn.detect_with_mtcnn(image, thresholds=(0.6, 0.7, 1.5))


def test_weights_load_once() -> None:
    mtcnn.detect_with_mtcnn(samples.grace_hopper_rgb())
    loads = MODEL_CACHE.total_loads("mtcnn")
    assert loads >= 1 and ("mtcnn", "cpu", None) in MODEL_CACHE
    nets = mtcnn.load_mtcnn("cpu")
    for _ in range(3):
        mtcnn.detect_with_mtcnn(samples.astronaut_rgb())
    assert MODEL_CACHE.total_loads("mtcnn") == loads
    assert mtcnn.load_mtcnn("cpu") is nets
    assert not any(p.requires_grad for p in nets.onet.parameters())


def test_box_overlap_known_values() -> None:
    a = _as_tensor([[0, 0, 10, 10]])
    b = _as_tensor([[5, 0, 15, 10], [2, 2, 7, 7], [20, 20, 30, 30], [0, 0, 10, 10]])
    iou = mtcnn.box_overlap(a, b)[0].tolist()
    assert iou == pytest.approx([50 / 150, 25 / 100, 0.0, 1.0])
    inter_over_min = mtcnn.box_overlap(a, b, "min")[0].tolist()
    assert inter_over_min == pytest.approx([0.5, 1.0, 0.0, 1.0])


def test_nms_keeps_the_best_of_overlapping_boxes() -> None:
    boxes = _as_tensor([[1, 0, 11, 10], [0, 0, 10, 10], [20, 20, 30, 30], [40, 40, 45, 45]])
    scores = torch.tensor([0.8, 0.9, 0.7, 0.95])
    # boxes 0 and 1: IoU 90 / 110 = 0.82
    assert mtcnn.nms(boxes, scores, 0.7).tolist() == [3, 1, 2]
    assert mtcnn.nms(boxes, scores, 0.85).tolist() == [3, 1, 0, 2]


def test_nms_is_greedy_not_transitive() -> None:
    # A suppresses B; B would suppress C, but B is gone, and C barely touches A: C stays.
    boxes = _as_tensor([[0, 0, 10, 10], [3, 0, 13, 10], [6, 0, 16, 10]])
    scores = torch.tensor([0.9, 0.8, 0.7])
    # IoU(A, B) = 70 / 130 = 0.54, IoU(B, C) = 0.54, IoU(A, C) = 40 / 160 = 0.25
    assert mtcnn.nms(boxes, scores, 0.5).tolist() == [0, 2]
    assert mtcnn.nms(boxes, scores, 0.2).tolist() == [0]


def test_nms_min_mode_drops_a_box_inside_a_better_one() -> None:
    boxes = _as_tensor([[0, 0, 20, 20], [5, 5, 10, 10]])
    scores = torch.tensor([0.9, 0.8])
    assert mtcnn.nms(boxes, scores, 0.7).tolist() == [0, 1]  # IoU 25 / 400
    assert mtcnn.nms(boxes, scores, 0.7, mode="min").tolist() == [0]  # 25 / 25


def _greedy_reference(boxes: torch.Tensor, scores: torch.Tensor, threshold: float) -> list[int]:
    order = [int(i) for i in torch.argsort(scores, descending=True, stable=True)]
    overlap = mtcnn.box_overlap(boxes, boxes)
    kept: list[int] = []
    for i in order:
        if all(overlap[k, i] <= threshold for k in kept):
            kept.append(i)
    return kept


def test_nms_matches_plain_greedy_across_blocks() -> None:
    generator = torch.Generator().manual_seed(7)
    n = 3 * mtcnn.NMS_BLOCK + 17
    corner = torch.rand(n, 2, generator=generator) * 200
    size = 10 + torch.rand(n, 1, generator=generator) * 40
    boxes = torch.cat([corner, corner + size], dim=1)
    scores = torch.rand(n, generator=generator)
    kept = mtcnn.nms(boxes, scores, 0.4).tolist()
    assert kept == _greedy_reference(boxes, scores, 0.4)
    assert 20 < len(kept) < n


def test_nms_of_nothing() -> None:
    assert mtcnn.nms(torch.zeros((0, 4)), torch.zeros(0), 0.5).tolist() == []


def test_area_resample_matches_torch_area_and_pads_black() -> None:
    image = samples.astronaut_rgb()
    table = mtcnn.summed_area_table(image)
    boxes = _as_tensor([[100, 40, 196, 136], [16, 0, 496, 480]])
    crops = mtcnn.area_resample(table, boxes, 24, 24)
    assert crops.shape == (2, 3, 24, 24) and crops.dtype == torch.float32
    pixels = torch.from_numpy(image.copy()).permute(2, 0, 1)[None].float()
    for crop, (x1, y1, x2, y2) in zip(crops, boxes.int().tolist(), strict=True):
        expected = F.interpolate(pixels[:, :, y1:y2, x1:x2], size=(24, 24), mode="area")[0]
        assert torch.allclose(crop, (expected - 127.5) * 0.0078125, atol=1e-4)
    # A box hanging off the top-left corner: the outside part is black (-127.5 / 128).
    (outside,) = mtcnn.area_resample(table, _as_tensor([[-24, -24, 24, 24]]), 2, 2)
    assert torch.allclose(outside[:, 0, 0], torch.full((3,), -0.99609375))
    inside = (pixels[0, :, :24, :24].mean(dim=(1, 2)) - 127.5) * 0.0078125
    assert torch.allclose(outside[:, 1, 1], inside, atol=1e-5)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_crop_batches_cover_every_crop_in_a_few_shapes(device: str) -> None:
    most = mtcnn.CPU_CROP_BATCH if device == "cpu" else mtcnn.CROP_BATCH
    allowed = {mtcnn.MIN_CROP_BATCH << k for k in range(12) if mtcnn.MIN_CROP_BATCH << k <= most}
    seen: set[int] = set()
    for count in range(1, 3 * most + 2):
        batches = mtcnn.crop_batches(count, device)
        assert [b[0] for b in batches] == [0, *(b[1] for b in batches[:-1])]
        assert batches[-1][1] == count
        assert all(stop - start <= padded for start, stop, padded in batches)
        seen |= {padded for _, _, padded in batches}
    assert seen == allowed
    assert mtcnn.crop_batches(0, device) == []


def test_padded_crop_batches_give_each_crop_its_own_output() -> None:
    """``_run_batched`` (padded batches of at most ``CPU_CROP_BATCH``) gives what one
    forward over all the crops gives."""
    nets = mtcnn.load_mtcnn("cpu")
    crops = torch.rand(
        (mtcnn.CPU_CROP_BATCH + 5, 3, 24, 24), generator=torch.Generator().manual_seed(3)
    )
    crops = crops * 2 - 1
    with torch.inference_mode():
        whole = nets.rnet(crops.contiguous(memory_format=mtcnn.CHANNELS_LAST))
        batched = mtcnn._run_batched(nets.rnet, crops)
    assert [t.shape for t in batched] == [t.shape for t in whole]
    for a, b in zip(batched, whole, strict=True):
        assert torch.allclose(a, b, atol=1e-5)


def test_video_frames_reach_rnet_and_onet_in_a_bounded_set_of_batch_shapes() -> None:
    """However many crops a frame group gives, R-Net and O-Net see at most the shapes of
    ``crop_batches`` (oneDNN keeps memory per shape: a shape per crop count made a video
    worker's memory grow with the number of frames)."""
    nets = mtcnn.load_mtcnn("cpu")
    counts: set[int] = set()
    shapes: set[tuple[int, ...]] = set()

    def record(net: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        shapes.add(tuple(args[0].shape))

    frames = list(itertools.islice(videos.story_frames(), 0, 48, 3))
    real_crops = mtcnn._crops

    def crops_counted(*args: object) -> torch.Tensor:
        crops = real_crops(*args)  # type: ignore[arg-type]
        counts.add(int(crops.shape[0]))
        return crops

    hooks = [net.register_forward_pre_hook(record) for net in (nets.rnet, nets.onet)]
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(mtcnn, "_crops", crops_counted)
            for i in range(0, len(frames), 2):
                mtcnn.detect_batch_with_mtcnn(frames[i : i + 2])
    finally:
        for hook in hooks:
            hook.remove()
    assert len(counts) > 8  # the frames gave many different crop counts...
    batch_sizes = {shape[0] for shape in shapes}
    assert batch_sizes <= {8, 16, 32, 64}  # ...and the nets saw only these batch sizes
    assert shapes <= {(n, 3, s, s) for n in batch_sizes for s in (mtcnn.RNET_SIZE, mtcnn.ONET_SIZE)}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_finds_the_same_faces_as_cpu() -> None:
    image = samples.t1_rgb()
    cpu = mtcnn.detect_with_mtcnn(image, device="cpu")
    gpu = mtcnn.detect_with_mtcnn(image, device="cuda")
    assert len(gpu) == len(cpu)
    for a, b in zip(cpu, gpu, strict=True):
        assert _iou(b, (a.box.x1, a.box.y1, a.box.x2, a.box.y2)) > 0.95
        assert np.abs(a.landmarks - b.landmarks).max() < 2.0


def test_on_the_cpu_a_long_batch_goes_through_mtcnn_in_short_batches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``detect_faces_batch`` hands MTCNN at most ``CPU_MTCNN_BATCH`` images at a time on
    the CPU (one batch of all was slower there) and keeps every image's faces in order."""
    from tasks import detect

    sizes: list[int] = []
    real = mtcnn.detect_batch_with_mtcnn

    def counted(images: list[np.ndarray], **kwargs: object) -> list[list[Face]]:
        sizes.append(len(images))
        return real(images, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(mtcnn, "detect_batch_with_mtcnn", counted)
    monkeypatch.setattr(detect, "CPU_MTCNN_BATCH", 2)
    images = [samples.astronaut_rgb(), samples.no_face_rgb(), samples.t1_rgb()] * 2 + [
        samples.grace_hopper_rgb()
    ]
    found = detect.detect_faces_batch(images, device="cpu")
    assert sizes == [2, 2, 2, 1]
    assert [len(faces) for faces in found] == [
        len(detect.detect_faces(image, device="cpu")) for image in images
    ]
    assert [len(f) for f in found[:3]] == [1, 0, len(found[2])] and len(found[2]) >= 5


def test_batches_in_flight_together_keep_every_image_in_its_place(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With ``threads`` = 2 two MTCNN batches run at once (each waits for the other to
    start) and the faces come back in the images' order, as with one at a time."""
    from tasks import detect

    real = mtcnn.detect_batch_with_mtcnn
    inside = threading.Barrier(2, timeout=10)
    met: list[bool] = []

    def together(images: list[np.ndarray], **kwargs: object) -> list[list[Face]]:
        try:
            inside.wait()
            met.append(True)
        except threading.BrokenBarrierError:
            met.append(False)
        return real(images, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(detect, "CPU_MTCNN_BATCH", 2)
    images = [
        samples.astronaut_rgb(),
        samples.no_face_rgb(),
        samples.t1_rgb(),
        samples.grace_hopper_rgb(),
    ]
    alone = detect.detect_faces_batch(images, device="cpu")
    monkeypatch.setattr(mtcnn, "detect_batch_with_mtcnn", together)
    found = detect.detect_faces_batch(images, device="cpu", threads=2)
    assert met == [True, True]
    assert [[f.box for f in faces] for faces in found] == [
        [f.box for f in faces] for faces in alone
    ]


def test_a_jobs_source_and_target_are_detected_at_once_on_two_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``detect_stage`` with ``model_threads`` = 2 (the CPU default on two cores): the
    source and the target go through MTCNN in two calls that run at the same time."""
    from tasks import pipeline
    from tasks.options import FusionOptions

    real = mtcnn.detect_batch_with_mtcnn
    inside = threading.Barrier(2, timeout=10)
    sizes: list[int] = []

    def together(images: list[np.ndarray], **kwargs: object) -> list[list[Face]]:
        sizes.append(len(images))
        inside.wait()  # BrokenBarrierError unless the other call runs at the same time
        return real(images, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(mtcnn, "detect_batch_with_mtcnn", together)
    ctx = pipeline.PipelineContext(device="cpu", model_threads=2)
    found = pipeline.detect_stage(
        samples.astronaut_rgb(), samples.grace_hopper_rgb(), FusionOptions(), ctx
    )
    assert sizes == [1, 1]
    assert found.source_count == 1 and found.target_count == 1
