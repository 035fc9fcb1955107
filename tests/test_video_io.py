"""Video I/O on real files made by tests/videos.py: probe, limits, broken input, chunked
decode, segment encode and join (timestamps, audio, rotation, faststart, no re-encode)."""

from __future__ import annotations

import hashlib
import itertools
import struct
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest

from tasks import errors
from tasks.video_io import (
    SegmentEncoding,
    SegmentWriter,
    VideoInfo,
    VideoLimits,
    decode_runs,
    frame_timestamps,
    join_segments,
    probe_frames,
    probe_video,
    read_frames,
    read_frames_at,
    write_segment,
)
from tests.videos import FPS, Videos, scenes

# variant: container, codec, displayed size, rotation, frames, fps, VFR, audio (codec, channels)
EXPECTED: dict[str, tuple[str, str, tuple[int, int], int, int, float, bool, tuple | None]] = {
    "story": ("mp4", "h264", (480, 360), 0, 90, 15.0, False, ("aac", 2)),
    "vfr": ("mp4", "h264", (480, 360), 0, 90, 12.48, True, ("aac", 2)),
    "rotated": ("mov", "hevc", (360, 480), 90, 45, 15.0, False, ("aac", 1)),
    "webm": ("webm", "vp9", (479, 359), 0, 45, 15.0, False, ("opus", 2)),
    "mkv": ("mkv", "av1", (480, 360), 0, 30, 15.0, False, ("flac", 2)),
    "silent": ("mp4", "h264", (480, 360), 0, 30, 15.0, False, None),
    "trimmed": ("mp4", "h264", (480, 360), 0, 27, 15.0, False, ("aac", 2)),
}


@pytest.mark.parametrize("variant", list(EXPECTED))
def test_probe_reads_each_variant(videos: Videos, variant: str) -> None:
    container, codec, size, rotation, frames, fps, vfr, audio = EXPECTED[variant]
    path = getattr(videos, variant)
    info = probe_video(path)
    assert (info.container, info.video_codec) == (container, codec)
    assert (info.width, info.height, info.rotation) == (*size, rotation)
    assert info.frame_count == frames == len(frame_timestamps(path))
    assert info.fps == pytest.approx(fps, abs=0.05)
    assert info.variable_frame_rate is vfr
    assert info.duration_s == pytest.approx(frames / fps, abs=1 / fps)
    assert info.size_bytes == path.stat().st_size
    if audio is None:
        assert info.audio is None
    else:
        assert info.audio is not None
        assert (info.audio.codec, info.audio.channels) == audio
        delay = 0.4 if variant == "mkv" else 0.0
        assert info.audio.start_s == pytest.approx(delay, abs=1e-3)
        assert info.audio.end_s == pytest.approx(info.duration_s, abs=1 / fps)
    assert VideoInfo.model_validate_json(info.model_dump_json()) == info


@pytest.mark.parametrize(
    ("limits", "error", "code"),
    [
        ({"max_bytes": 10_000}, errors.VideoTooLarge, "video_too_large"),
        ({"max_duration_s": 5.0}, errors.VideoTooLong, "video_too_long"),
        ({"max_side": 400}, errors.VideoResolutionTooHigh, "video_resolution_too_high"),
        ({"max_fps": 12.0}, errors.VideoFrameRateTooHigh, "video_frame_rate_too_high"),
    ],
)
def test_limits_refuse_with_their_code(
    videos: Videos, limits: dict[str, float], error: type[errors.FaceFlowError], code: str
) -> None:
    with pytest.raises(error) as info:
        probe_video(videos.story, VideoLimits(**limits))  # type: ignore[arg-type]
    assert info.value.code == code and info.value.permanent
    assert code in errors.PERMANENT_CODES
    probe_video(videos.story, VideoLimits())  # the defaults (10 min, 1920 px, 60 fps, 500 MB)


@pytest.mark.parametrize(
    ("variant", "error"),
    [
        ("truncated", errors.InvalidVideo),
        ("truncated_no_index", errors.InvalidVideo),
        ("corrupt", errors.InvalidVideo),
        ("not_video", errors.UnsupportedVideo),
        ("unsupported_codec", errors.UnsupportedVideo),
        ("unsupported_container", errors.UnsupportedVideo),
    ],
)
def test_broken_or_unsupported_input_is_refused(
    videos: Videos, variant: str, error: type[errors.FaceFlowError]
) -> None:
    with pytest.raises(error) as info:
        probe_video(getattr(videos, variant))
    assert info.value.permanent and isinstance(info.value, errors.InvalidInput)
    assert "/" not in info.value.public_message  # no paths for API users


def test_an_empty_or_missing_file(tmp_path: Path) -> None:
    empty = tmp_path / "empty.mp4"
    empty.write_bytes(b"")
    with pytest.raises(errors.InvalidVideo):
        probe_video(empty)
    with pytest.raises(FileNotFoundError):  # storage's fault, not the input's
        probe_video(tmp_path / "missing.mp4")


def _full_decode(path: Path) -> list[tuple[int | None, np.ndarray]]:
    with av.open(str(path)) as container:
        return [
            (f.pts, np.asarray(f.to_ndarray(format="rgb24"))) for f in container.decode(video=0)
        ]


@pytest.mark.parametrize("variant", ["story", "vfr", "rotated", "webm", "trimmed"])
def test_read_frames_gives_the_exact_frames_of_a_middle_range(videos: Videos, variant: str) -> None:
    path = getattr(videos, variant)
    timestamps = frame_timestamps(path)
    full = _full_decode(path)
    assert [pts for pts, _ in full] == timestamps  # presentation order
    start, stop = len(full) // 3, 2 * len(full) // 3 + 1
    frames = list(read_frames(path, start, stop, timestamps=timestamps))
    assert [f.index for f in frames] == list(range(start, stop))
    assert [f.pts for f in frames] == timestamps[start:stop]
    turn = -1 if variant == "rotated" else 0  # stored on its side, displayed turned 90° cw
    for frame in frames:
        assert np.array_equal(frame.image, np.rot90(full[frame.index][1], turn))
    assert [f.index for f in read_frames(path, len(full) - 2, len(full) + 5)] == [
        len(full) - 2,
        len(full) - 1,
    ]
    assert list(read_frames(path, 5, 5)) == []


@pytest.mark.parametrize("variant", ["rotated", "vfr"])
def test_read_frames_finds_every_start(videos: Videos, variant: str) -> None:
    """Open GOPs (leading frames before their keyframe) and irregular pts: a seek that
    lands late is retried earlier, so every start gives its own frames."""
    path = getattr(videos, variant)
    timestamps = frame_timestamps(path)
    for start in range(0, len(timestamps) - 2, 2):
        frames = read_frames(path, start, start + 2, timestamps=timestamps)
        assert [f.pts for f in frames] == timestamps[start : start + 2], start


@pytest.mark.parametrize("variant", ["story", "rotated", "vfr", "webm"])
def test_read_frames_at_gives_what_a_seek_per_frame_gives(videos: Videos, variant: str) -> None:
    """Scattered frames, read with the file opened once and the decoder run on inside a
    GOP (open GOPs and B-frames in the rotated HEVC), are those of one seek each."""
    path = getattr(videos, variant)
    info, (pts, keyframes) = probe_frames(path)
    assert info == probe_video(path) and pts == frame_timestamps(path)
    assert keyframes[0] == pts[0] and set(keyframes) <= set(pts)
    assert len(keyframes) > 1 or variant == "webm"  # the webm clip is one GOP
    indices = sorted({i for i in (0, 1, 5, 11, 12, 13, 25, 30, 44, len(pts) - 1) if i < len(pts)})
    one_by_one = [next(read_frames(path, i, i + 1, timestamps=pts)) for i in indices]
    for known in (keyframes, None):
        frames = list(read_frames_at(path, indices, timestamps=pts, keyframes=known))
        assert [f.index for f in frames] == indices
        for frame, alone in zip(frames, one_by_one, strict=True):
            assert frame.pts == alone.pts and np.array_equal(frame.image, alone.image)


def test_decode_runs_seek_only_past_a_keyframe() -> None:
    pts, keyframes = list(range(0, 100, 10)), [0, 50]
    assert decode_runs([9, 1, 3, 6, 4, 4], pts, keyframes) == [[1, 3, 4], [6, 9]]
    assert decode_runs([4, 5], pts, keyframes) == [[4], [5]]  # 5 is a keyframe: seek there
    assert decode_runs([1, 3], pts, None) == [[1], [3]]  # keyframes unknown: seek each
    assert decode_runs([10, -1], pts, keyframes) == []


def _boxes(path: Path) -> list[str]:
    """The top-level MP4 boxes in file order."""
    names, data, offset = [], path.read_bytes(), 0
    while offset + 8 <= len(data):
        size, kind = struct.unpack(">I4s", data[offset : offset + 8])
        if size == 1:
            size = struct.unpack(">Q", data[offset + 8 : offset + 16])[0]
        names.append(kind.decode("latin-1"))
        offset += size if size else len(data)
    return names


def _video_packets(path: Path) -> list[str]:
    with av.open(str(path)) as container:
        return [hashlib.sha1(bytes(p)).hexdigest() for p in container.demux(video=0) if p.size]


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return 99.0 if mse == 0 else 10 * np.log10(255.0**2 / mse)


def _render(path: Path, info: VideoInfo, out_dir: Path, cuts: list[int]) -> list[Path]:
    """Re-encode the source in chunks [cuts[i], cuts[i+1]) as the render stage will."""
    timestamps = frame_timestamps(path)
    segments = []
    for k, (start, stop) in enumerate(itertools.pairwise(cuts)):
        segment = out_dir / f"segment-{k}.mp4"
        end = timestamps[stop] if stop < len(timestamps) else info.end_pts
        frames = read_frames(path, start, stop, timestamps=timestamps)
        assert write_segment(frames, segment, info=info, end_pts=end) == stop - start
        segments.append(segment)
    return segments


@pytest.mark.parametrize(
    ("variant", "audio_out"),
    [
        ("story", "aac"),
        ("vfr", "aac"),
        ("rotated", "aac"),
        ("webm", "opus"),
        ("mkv", "aac"),  # FLAC does not go into MP4: transcoded
        ("silent", None),
        ("trimmed", "aac"),
    ],
)
def test_segments_join_into_the_source_timeline(
    videos: Videos, tmp_path: Path, variant: str, audio_out: str | None
) -> None:
    source = getattr(videos, variant)
    info = probe_video(source)
    n = info.frame_count
    segments = _render(source, info, tmp_path, [0, n // 3, n // 3 + 7, n])
    out = tmp_path / "result.mp4"
    result = join_segments(segments, source, out)

    assert (result.container, result.video_codec, result.rotation) == ("mp4", "h264", 0)
    assert (result.width, result.height) == (
        info.width - info.width % 2,
        info.height - info.height % 2,
    )
    assert result.frame_count == n
    in_seconds = [p * info.time_base for p in frame_timestamps(source)]
    assert [p * result.time_base for p in frame_timestamps(out)] == in_seconds  # exactly
    assert result.end_pts * result.time_base == info.end_pts * info.time_base
    assert result.variable_frame_rate is info.variable_frame_rate
    if audio_out is None:
        assert result.audio is None
    else:
        assert result.audio is not None and info.audio is not None
        assert result.audio.codec == audio_out
        assert result.audio.end_s == pytest.approx(info.audio.end_s, abs=1 / info.fps)
        # a transcode's AAC priming frame may come before a late start
        slack = 1 / info.fps + (1024 / info.audio.sample_rate if variant == "mkv" else 0)
        assert result.audio.start_s == pytest.approx(info.audio.start_s, abs=slack)
    boxes = _boxes(out)
    assert boxes.index("moov") < boxes.index("mdat")  # +faststart
    # No re-encode: the result's video packets are the segments' packets, byte for byte.
    assert _video_packets(out) == [h for s in segments for h in _video_packets(s)]
    with av.open(str(out)) as container:
        assert container.streams.video[0].codec_context.pix_fmt == "yuv420p"
    # Upright and faithful: the result looks like the source as displayed.
    for index in (0, n // 2, n - 1):
        (want,) = read_frames(source, index, index + 1)
        (got,) = read_frames(out, index, index + 1)
        assert got.pts * result.time_base == want.pts * info.time_base
        assert _psnr(got.image, want.image[: result.height, : result.width]) > 30


def test_join_refuses_a_missing_segment(videos: Videos, tmp_path: Path) -> None:
    info = probe_video(videos.silent)
    segments = _render(videos.silent, info, tmp_path, [0, 10, 20, 30])
    with pytest.raises(errors.VideoAssemblyFailed) as caught:
        join_segments([segments[0], segments[2]], videos.silent, tmp_path / "out.mp4")
    assert caught.value.code == "video_assembly_failed" and not caught.value.permanent
    assert "20 frames, source 30" in str(caught.value)
    assert not (tmp_path / "out.mp4").exists()  # no result that does not match
    with pytest.raises(errors.VideoAssemblyFailed):  # out of order
        join_segments([segments[1], segments[0], segments[2]], videos.silent, tmp_path / "o.mp4")


def test_join_refuses_segments_of_other_encoder_settings(videos: Videos, tmp_path: Path) -> None:
    info = probe_video(videos.silent)
    timestamps = frame_timestamps(videos.silent)
    first, second = tmp_path / "a.mp4", tmp_path / "b.mp4"
    write_segment(read_frames(videos.silent, 0, 15), first, info=info, end_pts=timestamps[15])
    write_segment(
        read_frames(videos.silent, 15, 30),
        second,
        info=info,
        end_pts=info.end_pts,
        encoding=SegmentEncoding(preset="ultrafast"),  # no CABAC: other stream headers
    )
    with pytest.raises(errors.VideoAssemblyFailed, match="encoder settings"):
        join_segments([first, second], videos.silent, tmp_path / "out.mp4")


def test_segment_writer_refuses_disorder_and_leaves_no_partial(
    videos: Videos, tmp_path: Path
) -> None:
    info = probe_video(videos.story)
    image = np.zeros((info.height, info.width, 3), np.uint8)
    path = tmp_path / "partial.mp4"
    with (
        pytest.raises(ValueError, match="does not follow"),
        SegmentWriter(path, info=info, end_pts=info.end_pts) as writer,
    ):
        writer.write(image, 2048)
        writer.write(image, 1024)
    assert not path.exists()


def test_the_story_has_its_scenes(videos: Videos) -> None:
    story = scenes(FPS)
    assert story.frame_count == probe_video(videos.story).frame_count
    assert story.astronaut.start in story.cuts and story.face_out.start > story.astronaut.start
    assert len(story.face_out) >= FPS // 2 and story.face_out.stop < story.astronaut.stop
    assert Fraction(story.frame_count, FPS) == 6
