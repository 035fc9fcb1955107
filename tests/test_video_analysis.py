"""A video's analysis in frame ranges (``tasks.video_analysis``): the ranges, their stored
form, and the plan made from them against the plan of one pass, on the story clip (90
frames, three scenes) with grace_hopper as the source."""

from __future__ import annotations

import io
import itertools
from collections.abc import Iterator
from dataclasses import astuple

import numpy as np
import pytest

from tasks.options import FusionOptions
from tasks.pipeline import PipelineContext
from tasks.types import Box, Face
from tasks.video import (
    FRAME_GROUP,
    analyse_and_plan,
    analyse_range,
    chunk_name,
    frame_groups,
    frame_ranges,
    plan_video,
    probe_and_moderate,
)
from tasks.video_analysis import Analysis, analysis_ranges, decode, encode, merged, range_name
from tests import samples
from tests.videos import Videos, scenes


def test_frames_come_in_full_groups_each_as_soon_as_it_is_read() -> None:
    read: list[int] = []

    def frames(n: int) -> Iterator[int]:
        for i in range(n):
            read.append(i)
            yield i

    groups = frame_groups(frames(2 * FRAME_GROUP + 3))
    assert next(groups) == list(range(FRAME_GROUP)) and len(read) == FRAME_GROUP
    assert [len(g) for g in groups] == [FRAME_GROUP, 3]
    assert list(frame_groups(frames(FRAME_GROUP))) == [list(range(FRAME_GROUP))]
    assert list(frame_groups([])) == []


def test_ranges_cover_the_video_in_order_at_multiples_of_the_batch() -> None:
    times = [i / 15 for i in range(241)]  # 16 s at 15 fps
    ranges = analysis_ranges(times, 2.0, 8)
    assert ranges[0][0] == 0 and ranges[-1][1] == 241
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    assert all(start % 8 == 0 for start, _ in ranges)
    assert len(ranges) == 8  # about 2 s each
    assert analysis_ranges(times[:5], 2.0, 8) == [(0, 5)]
    assert analysis_ranges([], 2.0, 8) == []


def a_face(shift: float) -> Face:
    marks = (np.arange(10, dtype=np.float32).reshape(5, 2) + np.float32(shift)) / np.float32(3)
    return Face(Box(1.25 + shift, 2.5, 40.1, 60.7), 0.9871234567, marks)


def test_a_range_comes_back_as_it_was_stored() -> None:
    signature = np.linspace(0, 1, 48, dtype=np.float32)
    stored = Analysis([[a_face(0), a_face(1)], [], [a_face(2)]], [signature] * 3)
    back = decode(encode(stored))
    assert [len(f) for f in back.faces] == [2, 0, 1]
    for ours, theirs in zip(stored.faces[0] + stored.faces[2], back.faces[0] + back.faces[2],
                            strict=True):  # fmt: skip
        assert astuple(ours.box) == astuple(theirs.box) and ours.score == theirs.score
        assert theirs.landmarks.dtype == np.float32
        assert np.array_equal(ours.landmarks, theirs.landmarks)
    assert all(np.array_equal(signature, s) for s in back.signatures)
    assert decode(encode(Analysis())).faces == []


def test_a_stored_range_holding_objects_is_refused_not_unpickled() -> None:
    out = io.BytesIO()
    np.savez(out, counts=np.array([object()], dtype=object))
    with pytest.raises(ValueError, match="pickle"):
        decode(out.getvalue())


def test_a_range_is_named_by_what_its_analysis_depends_on() -> None:
    name = range_name("v", 0, 32, "scrfd", 640, {"scrfd": "abc"})
    assert name.startswith("analysis-000000-000032-") and name.endswith(".npz")
    assert name == range_name("v", 0, 32, "scrfd", 640, {"scrfd": "abc"})
    others = [
        range_name("w", 0, 32, "scrfd", 640, {"scrfd": "abc"}),
        range_name("v", 0, 40, "scrfd", 640, {"scrfd": "abc"}),
        range_name("v", 0, 32, "mtcnn", 640, {"scrfd": "abc"}),
        range_name("v", 0, 32, "scrfd", 320, {"scrfd": "abc"}),
        range_name("v", 0, 32, "scrfd", 640, {"scrfd": "def"}),
    ]
    assert name not in others and len(set(others)) == len(others)


def test_the_plan_of_a_video_analysed_in_ranges_is_the_plan_of_one_pass(
    videos: Videos,
) -> None:
    ctx, options = PipelineContext(), FusionOptions()
    probed = probe_and_moderate([samples.grace_hopper_jpeg_bytes()], videos.story, ctx)
    counted: list[int] = []  # the progress: frames analysed, told a batch at a time
    one = analyse_and_plan(videos.story, probed, options, ctx, 2.0, analysed=counted.append)
    frames = len(probed.pts)
    assert sum(counted) == frames and set(counted[:-1]) == {FRAME_GROUP}

    ranges = frame_ranges(probed, 2.0)
    assert len(ranges) >= 3 and all(start % FRAME_GROUP == 0 for start, _ in ranges)
    cuts = set(scenes().cuts)
    assert not cuts & {start for start, _ in ranges}  # a cut inside a range, not at its edge
    counted.clear()
    stored = [
        encode(analyse_range(videos.story, probed, a, b, options, ctx, counted.append))
        for a, b in ranges
    ]  # as the range parts store them
    assert sum(counted) == frames
    analysis = merged([decode(data) for data in reversed(stored)][::-1])
    ranged = plan_video(videos.story, probed, analysis, options, ctx, 2.0)

    found = probed.source_faces  # detected once, by the check before the analysis
    assert len(found) == 1 and all(
        a is b for plan in (one, ranged) for a, b in zip(plan.sources, found, strict=True)
    )  # the plans took them, not a second detection
    assert ranged.cuts == one.cuts and cuts <= set(one.cuts)
    assert ranged.chunks == one.chunks
    assert ranged.plan.switches == one.plan.switches
    assert [t.id for t in ranged.plan.tracks] == [t.id for t in one.plan.tracks]
    assert sum(map(len, one.plan.frames)) > 0
    for ours, theirs in zip(one.plan.frames, ranged.plan.frames, strict=True):
        assert [(s.track, s.source, astuple(s.face.box)) for s in ours] == [
            (s.track, s.source, astuple(s.face.box)) for s in theirs
        ]
        assert all(
            np.array_equal(a.face.landmarks, b.face.landmarks)
            for a, b in zip(ours, theirs, strict=True)
        )
    source = [samples.grace_hopper_jpeg_bytes()]
    for chunk in one.chunks:  # what names a rendered chunk: the same, so it is reused
        assert chunk_name("d", chunk, one.plan, source, options) == chunk_name(
            "d", chunk, ranged.plan, source, options
        )
