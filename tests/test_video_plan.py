"""The video face plan on synthetic detections: cuts, chunks, tracks, gap filling,
zero-phase smoothing, assignment with hysteresis and per-face mapping."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from tasks.errors import InvalidInput, NoFaceFound
from tasks.options import FaceMapping
from tasks.types import Box, Face
from tasks.video_plan import (
    Identities,
    Track,
    frame_signature,
    gaussian_smooth,
    jitter_px,
    plan_chunks,
    plan_faces,
    scene_cuts,
)


def face(x: float, y: float, size: float, noise: float = 0.0, seed: int = 0) -> Face:
    rng = np.random.default_rng(seed)
    marks = np.array(
        [[0.3, 0.35], [0.7, 0.35], [0.5, 0.55], [0.35, 0.75], [0.65, 0.75]], dtype=np.float32
    )
    placed = marks * size + [x, y] + rng.normal(0, noise, (5, 2))
    return Face(Box(x, y, x + size, y + size), 0.99, placed.astype(np.float32))


def test_cuts_are_found_where_the_picture_changes() -> None:
    dark = np.full((48, 64, 3), 20, np.uint8)
    light = np.full((48, 64, 3), 220, np.uint8)
    frames = [dark] * 5 + [light] * 4 + [dark]
    assert scene_cuts([frame_signature(f) for f in frames]) == [5, 9]
    # a slow change (a pan) is no cut
    ramp = [np.full((48, 64, 3), 100 + i, np.uint8) for i in range(10)]
    assert scene_cuts([frame_signature(f) for f in ramp]) == []


def test_chunks_are_about_the_target_length_and_move_to_a_nearby_cut() -> None:
    times = [i / 25 for i in range(25 * 31)]  # 31 s at 25 fps
    plain = plan_chunks(times, target_s=10.0)
    assert [(c.start, c.stop) for c in plain] == [(0, 250), (250, 500), (500, 775)]
    moved = plan_chunks(times, [240, 600], target_s=10.0, window_s=2.5)
    assert [(c.start, c.stop) for c in moved] == [(0, 240), (240, 490), (490, 775)]
    assert sum(c.frames for c in moved) == len(times)
    assert plan_chunks([], []) == []
    assert [(c.start, c.stop) for c in plan_chunks(times[:30])] == [(0, 30)]


def test_a_missed_detection_is_filled_and_smoothing_reduces_jitter() -> None:
    frames = [[face(100 + 2 * i, 80, 60, noise=1.5, seed=i)] for i in range(40)]
    for missing in (10, 11, 12):
        frames[missing] = []
    plan = plan_faces(frames, [], "largest")
    assert len(plan.tracks) == 1
    track = plan.tracks[0]
    assert track.filled == {10, 11, 12}
    assert all(len(swaps) == 1 for swaps in plan.frames)  # no frame flickers back
    assert track.jitter_after < 0.5 * track.jitter_before
    assert plan.switches == 0


def test_zero_phase_smoothing_does_not_lag_a_steady_motion() -> None:
    line = np.arange(30, dtype=np.float64)[:, None] * [2.0, 1.0]
    smooth = gaussian_smooth(line, 2.0)
    assert np.allclose(smooth, line)  # no delay, and the ends do not fold back
    assert jitter_px(line) == 0.0
    short = np.arange(6, dtype=np.float64)[:, None] * [3.0, 0.0]
    assert np.allclose(gaussian_smooth(short, 1.5), short)


def test_a_long_gap_or_a_cut_ends_a_track() -> None:
    frames = [[face(100, 80, 60)] for _ in range(30)]
    for missing in range(10, 22):  # 12 frames: longer than the gap limit
        frames[missing] = []
    plan = plan_faces(frames, [], "largest", max_gap=8)
    assert len(plan.tracks) == 2 and all(frames[i] == [] for i in range(10, 22))
    assert all(plan.frames[i] == [] for i in range(10, 22))
    cut = plan_faces([[face(100, 80, 60)] for _ in range(20)], [10], "largest")
    assert len(cut.tracks) == 2 and cut.switches == 0


def test_largest_switches_only_after_the_hysteresis() -> None:
    # two people; B is bigger for one frame (a lean), then for good from frame 20
    frames = []
    for i in range(40):
        a = face(50, 50, 80)
        b_size = 90 if i == 8 or i >= 20 else 70
        frames.append(sorted([a, face(300, 50, b_size)], key=lambda f: -f.box.area))
    plan = plan_faces(frames, [], "largest", hysteresis=5)
    chosen = [swaps[0].track for swaps in plan.frames]
    a_id = chosen[0]
    assert chosen[8] == a_id  # a one-frame lean does not flip the identity
    assert chosen[20:24] == [a_id] * 4 and chosen[25:] == [chosen[-1]] * 15
    assert chosen[-1] != a_id and plan.switches == 1


def test_all_swaps_every_track() -> None:
    frames = [[face(50, 50, 80), face(300, 50, 70)] for _ in range(12)]
    plan = plan_faces(frames, [], "all")
    assert all(len(s) == 2 for s in plan.frames) and plan.switches == 0


# --------------------------------------------------------------------------- mapping

A, B, C = np.array([1.0, 0.0, 0.0]), np.array([0.0, 1.0, 0.0]), np.array([0.0, 0.0, 1.0])


def _similarity(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


def crossing(frames: int = 40) -> tuple[list[list[Face]], list[tuple[float, float]]]:
    """Two people side by side who swap places: A left to right over the top, B right to
    left underneath (detections largest first); and where A is in each frame."""
    out, where_a = [], []
    for i in range(frames):
        s = i / (frames - 1)
        lift = 80 * np.sin(np.pi * s)
        a = face(40 + 300 * s, 120 - lift, 80)
        b = face(340 - 300 * s, 120 + lift, 78)
        out.append([a, b])
        where_a.append((a.box.x1, a.box.y1))
    return out, where_a


def _near(found: Face, where: tuple[float, float]) -> bool:
    """Whether a (smoothed) face is the one detected at ``where`` (the two are >= 40 px
    apart in every frame)."""
    return abs(found.box.x1 - where[0]) + abs(found.box.y1 - where[1]) < 10


def identities_of(
    where_a: list[tuple[float, float]], references: list[np.ndarray] | None = None
) -> Identities:
    """Tracks embed as A when they cover A's positions, else as B."""

    def embed(tracks: Sequence[Track]) -> list[np.ndarray]:
        return [
            A
            if all(
                i < len(where_a) and (f.box.x1, f.box.y1) == where_a[i]
                for i, f in t.detected.items()
            )
            else B
            for t in tracks
        ]

    return Identities(embed, _similarity, references or [])


def test_a_mapping_by_key_frame_number_follows_each_person_as_they_cross() -> None:
    frames, where_a = crossing()
    mapping = [FaceMapping(source=1, target=1), FaceMapping(source=0, target=0)]
    plan = plan_faces(frames, [], "largest", mapping=mapping, identities=identities_of(where_a))
    assert plan.key_frame == 0
    for index, swaps in enumerate(plan.frames):
        assert len(swaps) == 2
        # A (reading-order face 0 of the key frame) always gets source 0, wherever A is
        # now: past the middle, B comes first in reading order
        got = {_near(s.face, where_a[index]): s.source for s in swaps}
        assert got == {True: 0, False: 1}, index
    assert plan.switches == 0
    assert {plan.source_of(t.id) for t in plan.tracks} == {0, 1}


def test_a_mapping_recognises_a_person_after_a_cut_and_by_reference() -> None:
    frames, where_a = crossing()
    # after the cut only B comes back, on the left, then a stranger C beside them
    later = [[face(40, 120, 80)] for _ in range(10)] + [
        [face(40, 120, 80), face(300, 120, 70)] for _ in range(10)
    ]
    people = {id(f): B for frame in later for f in frame[:1]}
    people |= {id(frame[1]): C for frame in later if len(frame) > 1}

    def embed(tracks: Sequence[Track]) -> list[np.ndarray]:
        vectors = identities_of(where_a).embed(tracks)
        return [
            people.get(id(next(iter(t.detected.values()))), v)
            for t, v in zip(tracks, vectors, strict=True)
        ]

    mapping = [FaceMapping(source=0, target=0), FaceMapping(source=1, reference=0)]
    plan = plan_faces(
        frames + later,
        [20],
        "largest",
        mapping=mapping,
        identities=Identities(embed, _similarity, [B]),
    )
    sources_after_cut = [[s.source for s in plan.frames[i]] for i in range(40, 60)]
    assert sources_after_cut == [[1]] * 20  # B keeps source 1; C is nobody's: not swapped
    assert plan.switches == 0


def test_a_mapping_that_cannot_be_resolved_fails_with_a_clear_error() -> None:
    frames, where_a = crossing()
    single = [f[:1] for f in frames]
    with pytest.raises(InvalidInput, match="no frame of the video shows 2 faces"):
        plan_faces(
            single, [], "largest", mapping=[FaceMapping(source=0, target=1)],
            identities=identities_of(where_a),
        )  # fmt: skip
    with pytest.raises(NoFaceFound, match="reference image 0"):
        plan_faces(
            frames, [], "largest", mapping=[FaceMapping(source=0, reference=0)],
            identities=identities_of(where_a, [C]),
        )  # fmt: skip
    with pytest.raises(InvalidInput, match="same person"):
        plan_faces(
            frames, [], "largest",
            mapping=[FaceMapping(source=0, target=0), FaceMapping(source=1, reference=0)],
            identities=identities_of(where_a, [A]),
        )  # fmt: skip


def test_box_iou() -> None:
    a = Box(0, 0, 10, 10)
    assert a.iou(Box(5, 0, 15, 10)) == pytest.approx(50 / 150)
    assert a.iou(Box(20, 20, 30, 30)) == 0.0 == Box(0, 0, 0, 0).iou(Box(0, 0, 0, 0))
    assert a.iou(a) == 1.0
