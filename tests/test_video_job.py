"""A whole video through ``tasks.video.fuse_video`` in-process: the story clip (a pan over
t1.jpg's six faces, a cut to the astronaut whose face leaves and comes back, a cut to a
scene without a face) with grace_hopper as the source."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from tasks.identity import CHIP_SIZE, embed_with_dlib, similarity
from tasks.images import decode_image
from tasks.options import FaceMapping, FusionOptions
from tasks.pipeline import PipelineContext, embed_faces
from tasks.types import Face
from tasks.video import (
    Analysis,
    Samples,
    analyse,
    fuse_video,
    identity_similarities,
    sources_of,
)
from tasks.video_io import frame_timestamps, probe_video, read_frames
from tasks.video_plan import plan_faces, scene_cuts
from tests import samples
from tests.videos import Videos, pair_sprites, scenes, story_frames, t1_face_jpeg


def test_a_video_is_fused_frame_for_frame_with_its_timing_and_audio(
    videos: Videos, tmp_path: Path
) -> None:
    story = videos.story
    chunks = tmp_path / "chunks"
    source_photo = samples.grace_hopper_jpeg_bytes()
    result = fuse_video(
        [source_photo], story, tmp_path / "out.mp4", ctx=PipelineContext(), chunk_dir=chunks,
        chunk_s=2.0,
    )  # fmt: skip
    assert result.chunks == result.chunks_rendered == 3  # 2 s chunks, ends at the cuts
    source = probe_video(story)
    assert result.info.frame_count == source.frame_count
    assert frame_timestamps(result.path) == frame_timestamps(story)  # every frame's pts kept
    assert result.info.audio is not None and source.audio is not None
    assert abs(result.info.audio.duration_s - source.audio.duration_s) <= 1 / source.fps
    story_scenes = scenes()
    assert set(story_scenes.cuts) <= set(result.cuts)
    assert result.frame_failures == {} and result.moderation_flags == []

    swapped_frames = [i for i, boxes in enumerate(result.swapped) if boxes]
    assert set(story_scenes.pan) <= set(swapped_frames)  # no pan frame flickers back
    assert not set(story_scenes.no_face) & set(swapped_frames)
    assert not set(story_scenes.face_out) & set(swapped_frames)
    before = read_frames(story, 0, source.frame_count)
    after = read_frames(result.path, 0, source.frame_count)
    for index, (a, b) in enumerate(zip(before, after, strict=True)):
        diff = np.abs(a.image.astype(int) - b.image.astype(int))
        if result.swapped[index]:
            box = result.swapped[index][0]
            y0, y1 = int(box.y1 + 0.3 * box.height), int(box.y2 - 0.1 * box.height)
            x0, x1 = int(box.x1 + 0.2 * box.width), int(box.x2 - 0.2 * box.width)
            assert diff[y0:y1, x0:x1].mean() > 6.0, index  # the face was replaced
        else:
            assert diff.mean() < 3.0, index  # re-encoded only
    swapped_tracks = [t for t in result.tracks if t.swapped_frames]
    assert all(t.similarity_mean is not None for t in swapped_tracks)
    assert all(t.jitter_after_px <= t.jitter_before_px for t in swapped_tracks)

    # A second attempt (the first one's worker killed after two chunks) renders only the
    # chunk that is missing, and gives the same video.
    kept = sorted(chunks.iterdir())
    assert len(kept) == 3
    kept[2].unlink()
    again = fuse_video(
        [source_photo], story, tmp_path / "again.mp4", ctx=PipelineContext(), chunk_dir=chunks,
        chunk_s=2.0,
    )  # fmt: skip
    assert (again.chunks, again.chunks_rendered) == (3, 1)
    assert frame_timestamps(again.path) == frame_timestamps(story)
    assert [t.swapped_frames for t in again.tracks] == [t.swapped_frames for t in result.tracks]


def test_the_identity_samples_keep_a_chip_per_face_not_the_frame() -> None:
    """A swapped track's identity samples are kept as the fused face's dlib chip (tracks
    come with the video's shots: whole frames would grow with its length), and give the
    similarity that the frame and face give."""
    frames = list(itertools.islice(story_frames(), 0, 24))
    ctx = PipelineContext()
    options = FusionOptions()
    analysis = analyse(frames, options, ctx, Analysis())
    plan = plan_faces(analysis.faces, scene_cuts(analysis.signatures), options.face)
    kept = Samples(plan, moderated=[], pins=ctx.pins)
    for index, frame in enumerate(frames):
        kept.keep(index, frame)
    items = [item for checks in kept.checks.values() for item in checks]
    assert 1 <= len(items) <= 6 * len(kept.checks)
    assert all(chip.shape == (CHIP_SIZE, CHIP_SIZE, 3) for chip, _ in items)
    assert kept.results == {}
    (source,) = sources_of([samples.grace_hopper_rgb()], options, ctx)
    found = identity_similarities(kept.checks, [source], ctx)
    wanted = sorted(kept.wanted.items())
    pairs = [
        (frames[i], s.face) for i, tracks in wanted for s in plan.frames[i] if s.track in tracks
    ]
    direct = embed_with_dlib(pairs, pins=ctx.pins)
    (source_vector,) = embed_with_dlib([(source.image, source.face)], pins=ctx.pins)
    expected = [similarity(v, source_vector) for v in direct]
    assert sorted(v for sims in found.values() for v in sims) == pytest.approx(sorted(expected))


def test_two_mapped_people_keep_their_sources_as_they_swap_places(
    videos: Videos, tmp_path: Path
) -> None:
    """The pair clip (the astronaut and Grace Hopper cross and swap places) with two
    sources: one mapped by the key frame's face number (0: the astronaut, on the left at
    first), one by a reference photo of Grace Hopper (mirrored). Every frame swaps both,
    each with its own source, and no identity switches."""
    reference = samples.encode(np.ascontiguousarray(samples.grace_hopper_rgb()[:, ::-1]))
    sources = [t1_face_jpeg(0), t1_face_jpeg(1)]
    mapping = (FaceMapping(source=0, target=0), FaceMapping(source=1, reference=0))
    ctx = PipelineContext()
    result = fuse_video(
        sources, videos.pair, tmp_path / "out.mp4", FusionOptions(mapping=mapping), ctx,
        references=[reference],
    )  # fmt: skip
    assert result.switches == 0 and result.frame_failures == {}
    person = {0: "astronaut", 1: "grace_hopper"}
    for index, (boxes, chosen, where) in enumerate(
        zip(result.swapped, result.swapped_sources, pair_sprites(), strict=True)
    ):
        assert sorted(chosen) == [0, 1], index  # both people, in every frame
        for box, source in zip(boxes, chosen, strict=True):
            centre = ((box.x1 + box.x2) / 2, (box.y1 + box.y2) / 2)
            assert where[person[source]].holds(*centre), (index, source)
    assert sorted(t.source or 0 for t in result.tracks if t.swapped_frames) == [0, 1]

    # The fused faces look like their own source more than like the other one.
    fused = {f.index: f.image for f in read_frames(result.path, 0, result.info.frame_count)}
    source_faces = sources_of([decode_image(s) for s in sources], FusionOptions(), ctx)
    own, other = [], []
    for index in (0, 22, 44):
        for box, source in zip(result.swapped[index], result.swapped_sources[index], strict=True):
            face = Face(box, 1.0, np.zeros((5, 2), np.float32))
            [vector] = embed_faces([(fused[index], face)], ctx)
            mine, theirs = (embed_faces([(s.image, s.face)], ctx)[0] for s in (
                source_faces[source], source_faces[1 - source]))  # fmt: skip
            own.append(similarity(vector, mine))
            other.append(similarity(vector, theirs))
    print("similarity to own source", np.round(own, 3), "to the other", np.round(other, 3))
    assert all(a > b for a, b in zip(own, other, strict=True))
