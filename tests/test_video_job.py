"""A whole video through ``tasks.video.fuse_video`` in-process: the story clip (a pan over
t1.jpg's six faces, a cut to the astronaut whose face leaves and comes back, a cut to a
scene without a face) with grace_hopper as the source."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tasks.pipeline import PipelineContext
from tasks.video import fuse_video
from tasks.video_io import frame_timestamps, probe_video, read_frames
from tests import samples
from tests.videos import Videos, scenes


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
