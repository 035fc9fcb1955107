"""The video face plan on synthetic detections: cuts, chunks, tracks, gap filling,
zero-phase smoothing and assignment with hysteresis."""

from __future__ import annotations

import numpy as np

from tasks.types import Box, Face
from tasks.video_plan import (
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
    marks = marks * size + [x, y] + rng.normal(0, noise, (5, 2))
    return Face(Box(x, y, x + size, y + size), 0.99, marks.astype(np.float32))


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


def test_all_swaps_every_track_and_mapping_goes_by_reference() -> None:
    frames = [[face(50, 50, 80), face(300, 50, 70)] for _ in range(12)]
    assert all(len(s) == 2 for s in plan_faces(frames, [], "all").frames)
    identities = {0: np.array([1.0, 0.0]), 1: np.array([0.0, 1.0])}

    def embed(track: object) -> np.ndarray:
        first = next(iter(track.faces.values()))  # type: ignore[attr-defined]
        return identities[0] if first.box.x1 < 200 else identities[1]

    plan = plan_faces(
        frames, [], "largest", references=[(1, identities[1]), (0, identities[0])], embed=embed
    )
    sources = {(s.face.box.x1 < 200, s.source) for swaps in plan.frames for s in swaps}
    assert sources == {(True, 0), (False, 1)}
