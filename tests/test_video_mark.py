"""The watermark of video frames (``watermark.VIDEO``): read back after our H.264 encode
and after a re-encode at half its bitrate, by ``inspect_file`` (3 runs x 8 frames); never
found in unmarked clips; a chunk's storage name depends on the payload it carries."""

from __future__ import annotations

import uuid
from pathlib import Path

import numpy as np
import pytest

from faceflow.clips import pan_frames, reencode, write_clip
from tasks import watermark
from tasks.options import FusionOptions
from tasks.provenance import inspect_file
from tasks.video import chunk_name
from tasks.video_io import probe_video, read_frames
from tasks.video_plan import Chunk, FacePlan
from tests.videos import Videos

PAYLOAD = watermark.payload_for(str(uuid.uuid4()))


@pytest.fixture(scope="module")
def clip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 480x360 pan, every frame marked, encoded at CRF 18 as the render pass encodes."""
    path = tmp_path_factory.mktemp("marked") / "marked.mp4"
    write_clip([watermark.VIDEO.embed(f, PAYLOAD) for f in pan_frames(480, 360, 30)], path)
    return path


def test_every_frame_carries_the_payload_after_our_encode(clip: Path) -> None:
    frames = [f.image for f in read_frames(clip, 0, 30)]
    assert len(frames) == 30
    bits = np.asarray(PAYLOAD.bits())
    for index, frame in enumerate(frames):  # each frame on its own: (nearly) every bit
        scores = watermark.VIDEO.scores(frame)
        assert scores is not None and np.mean((scores > 0) == bits) >= 0.9, index
    assert watermark.read_video([frames[:8], frames[11:19], frames[22:]]) == PAYLOAD
    found = inspect_file(clip.read_bytes())
    assert found.media_type == "video/mp4" and found.watermark_checked
    assert found.watermark == PAYLOAD and found.made_here
    assert not found.manifest.present


def test_the_payload_survives_a_reencode_at_half_the_bitrate(clip: Path, tmp_path: Path) -> None:
    again = tmp_path / "again.mp4"
    reencode(clip, again, int(clip.stat().st_size * 8 / probe_video(clip).duration_s / 2))
    assert again.stat().st_size < clip.stat().st_size * 0.7
    assert inspect_file(again.read_bytes()).watermark == PAYLOAD
    from flows.video import video_marks

    assert video_marks(True, probe_video(clip)) == ["c2pa", "watermark"]


def test_unmarked_videos_read_as_unmarked(videos: Videos, tmp_path: Path) -> None:
    plain = tmp_path / "plain.mp4"
    write_clip(pan_frames(480, 360, 30), plain)
    for path in (plain, videos.story, videos.pair):
        found = inspect_file(path.read_bytes())
        assert found.watermark_checked and found.watermark is None, path
        assert not found.made_here
    for frame in pan_frames(1280, 720, 3):  # single frames, soft votes of many blocks
        assert watermark.read_video([[frame]]) is None


def test_quadrants_near_black_or_white_still_carry_their_bit() -> None:
    """Where a quadrant cannot move (a pixel would clip), the block's other quadrants
    take its share: a frame half black, half white reads back whole before any codec."""
    frame = np.zeros((360, 480, 3), np.uint8)
    frame[:, 240:] = 255
    marked = watermark.VIDEO.embed(frame, PAYLOAD)
    assert watermark.read_video([[marked]]) == PAYLOAD
    scores = watermark.VIDEO.scores(marked)
    assert scores is not None and bool(np.all((scores > 0) == np.asarray(PAYLOAD.bits())))


def test_the_step_shrinks_with_the_frame_and_a_720p_clip_reads_back(tmp_path: Path) -> None:
    code = watermark.VIDEO
    steps = [code.step_for(r, c) for r, c in ((16, 16), (22, 30), (30, 40), (45, 80), (67, 120))]
    assert steps[:2] == [12.0, 12.0] and 8.0 < steps[2] < 12.0 and steps[3:] == [8.0, 8.0]
    path = tmp_path / "720p.mp4"
    write_clip([code.embed(f, PAYLOAD) for f in pan_frames(1280, 720, 8)], path)
    assert inspect_file(path.read_bytes()).watermark == PAYLOAD


def test_a_frame_too_small_or_a_broken_video_is_not_checked(tmp_path: Path) -> None:
    small = np.zeros((120, 160, 3), np.uint8)
    assert watermark.VIDEO.embed(small, PAYLOAD) is small
    assert watermark.VIDEO.scores(small) is None
    tiny = tmp_path / "tiny.mp4"
    write_clip([small] * 4, tiny)
    found = inspect_file(tiny.read_bytes())
    assert not found.watermark_checked and found.watermark is None
    from flows.video import video_marks  # what a result of such frames says it carries

    assert video_marks(True, probe_video(tiny)) == ["c2pa"]
    assert video_marks(False, probe_video(tiny)) == []
    truncated = tiny.read_bytes()[:200]
    assert not inspect_file(truncated).watermark_checked


def test_a_chunk_marked_for_another_job_is_not_reused() -> None:
    chunk = Chunk(index=0, start=0, stop=2)
    plan = FacePlan(frames=[[], []], tracks=[], cuts=[])
    name = chunk_name("v" * 64, chunk, plan, [b"source"], FusionOptions(), PAYLOAD)
    other = watermark.payload_for(str(uuid.uuid4()))
    assert chunk_name("v" * 64, chunk, plan, [b"source"], FusionOptions(), other) != name
    assert chunk_name("v" * 64, chunk, plan, [b"source"], FusionOptions()) != name
    assert chunk_name("v" * 64, chunk, plan, [b"source"], FusionOptions(), PAYLOAD) == name
