"""Video I/O with PyAV: probe, frame timestamps, chunked decode, segment encode, join.

Torch-free (numpy and ``av`` only), so the webapi can probe an upload at submit. Every
function streams: memory is bounded by one chunk of frames (or one packet), never by the
length of the video.

Timestamps are kept exactly. A frame is known by its index in presentation order and by
its ``pts`` in the source video stream's ``time_base``; segments are written in that same
time base (the MP4 track's timescale is the time base's denominator), so a variable frame
rate survives untouched. Segments are H.264 (libx264) yuv420p without B-frames: decode
order is presentation order, so :func:`join_segments` concatenates their packets as they
are (no re-encode, no timestamp rewriting) and muxes the source's audio beside them.

The read functions (:func:`frame_timestamps`, :func:`read_frames`, :func:`read_frames_at`)
take a path or a :class:`ByteSource`: a video read in place, such as an S3 object read by
byte ranges (``blocks.storage.read_in_place``), so a part decoding one range of a long
upload fetches that range and the index, not the whole file.

Rotation: :func:`read_frames` yields upright pictures (the container's display matrix
applied), so segments and the joined result are stored upright with no rotation metadata.
Odd dimensions (possible in H.265, VP9 and AV1) cannot be stored in 4:2:0 H.264, whose
cropping unit is two pixels: the writer drops the last column and/or row, so the result is
at most one pixel narrower and shorter than the source (no invented pixels).
"""

from __future__ import annotations

import bisect
import heapq
import io
import itertools
import logging
from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from types import TracebackType
from typing import Annotated, Literal, NamedTuple, Protocol

import av
import av.error
import numpy as np
from av.audio.stream import AudioStream
from av.container import InputContainer
from av.packet import Packet
from av.video.stream import VideoStream
from pydantic import BaseModel, ConfigDict, Field

from tasks.errors import (
    InvalidVideo,
    UnsupportedVideo,
    VideoAssemblyFailed,
    VideoFrameRateTooHigh,
    VideoResolutionTooHigh,
    VideoTooLarge,
    VideoTooLong,
)
from tasks.options import VideoLimits
from tasks.types import RGBImage

__all__ = [
    "AUDIO_COPY_CODECS",
    "DEFAULT_ENCODING",
    "AudioInfo",
    "ByteSource",
    "ContainerName",
    "FrameScan",
    "SegmentEncoding",
    "SegmentWriter",
    "VideoCodec",
    "VideoFrame",
    "VideoInfo",
    "VideoLimits",
    "VideoSource",
    "X264Preset",
    "frame_timestamps",
    "join_segments",
    "probe_frames",
    "probe_video",
    "read_frames",
    "read_frames_at",
    "write_segment",
]

log = logging.getLogger(__name__)

ContainerName = Literal["mp4", "mov", "mkv", "webm"]
VideoCodec = Literal["h264", "hevc", "vp9", "av1"]

_DEMUXERS = frozenset({"mov,mp4,m4a,3gp,3g2,mj2", "matroska,webm"})
_VIDEO_CODECS: dict[str, VideoCodec] = {
    "h264": "h264",
    "hevc": "hevc",
    "vp9": "vp9",
    "libvpx-vp9": "vp9",
    "av1": "av1",
    "libdav1d": "av1",
    "libaom-av1": "av1",
}
AUDIO_COPY_CODECS = frozenset({"aac", "mp3", "opus", "alac", "ac3", "eac3"})
"""Audio codecs copied into the MP4 result as they are; any other is transcoded to AAC."""
AAC_BIT_RATE = 192_000
AAC_FRAME = 1024  # samples per AAC frame
_FIRST_FRAME_PACKETS = 64  # packets fed to the decoder before a video counts as undecodable
_TRUNCATION_SLACK_S = 1.0  # declared duration beyond the last packet that means truncation


class AudioInfo(NamedTuple):
    """The first audio stream: codec name, sample rate, channels, duration in seconds, and
    when it starts (seconds on the container's clock, the video's too)."""

    codec: str
    sample_rate: int
    channels: int
    duration_s: float
    start_s: float = 0.0

    @property
    def end_s(self) -> float:
        return self.start_s + self.duration_s


class VideoInfo(BaseModel):
    """What a probe learns about a video (its first video stream and first audio stream)."""

    model_config = ConfigDict(frozen=True)

    container: ContainerName
    video_codec: VideoCodec
    width: int  # as displayed (rotation applied)
    height: int
    rotation: int  # degrees clockwise the stored picture turns for display: 0, 90, 180, 270
    frame_count: int
    duration_s: float  # of the video stream: first pts to the end of the last frame
    fps: float  # average: frame_count / duration_s
    variable_frame_rate: bool
    time_base: Fraction  # of the video stream; every pts below is in it
    first_pts: int
    end_pts: int  # where the last frame ends (its pts plus its duration)
    audio: AudioInfo | None
    size_bytes: int


@dataclass(frozen=True, slots=True)
class VideoFrame:
    """One decoded frame: its index in presentation order, its pts, its upright RGB image."""

    index: int
    pts: int
    image: RGBImage


class FrameScan(NamedTuple):
    """Every video frame's pts in presentation order, and the pts of the keyframes (the
    frames a decode can start at), in the video stream's time base."""

    pts: list[int]
    keyframes: list[int]


@dataclass(slots=True)
class _Scan:
    pts: list[int]  # sorted
    keyframes: list[int]  # sorted
    end_pts: int
    audio_start: int | None
    audio_end: int | None
    rotation_ccw: int | None  # of the first decoded frame; None when nothing was decoded
    discarded: int  # video packets before the start an edit list sets (not frames)


class ByteSource(Protocol):
    """A video read in place rather than from a file (``blocks.ranged.RangedSource``: an
    S3 object read by ranges): its name for messages, and a new seekable binary file
    (position 0) at each ``open``. Its read errors pass through as they are."""

    @property
    def name(self) -> str: ...

    def open(self) -> io.IOBase: ...


VideoSource = str | Path | ByteSource
"""What the read functions take: a file's path, or a :class:`ByteSource`."""
_Source = Path | ByteSource


def _source(source: VideoSource) -> _Source:
    return Path(source) if isinstance(source, str) else source


def _invalid(path: _Source, exc: BaseException) -> InvalidVideo:
    return InvalidVideo(detail=f"{path.name}: {type(exc).__name__}: {exc}")


@contextmanager
def _open(source: _Source) -> Iterator[InputContainer]:
    """An open container, mapping FFmpeg's refusals to ``InvalidVideo`` (a missing file
    stays an ``OSError``, a source's read error its own: storage's fault, not the
    input's); closed, with the source's file, on leaving."""
    with ExitStack() as stack:
        if isinstance(source, Path):
            if not source.is_file():
                raise FileNotFoundError(source)
            file: str | io.IOBase = str(source)
        else:
            file = stack.enter_context(source.open())
        try:
            container = stack.enter_context(av.open(file, mode="r"))
        except av.error.FFmpegError as exc:
            raise _invalid(source, exc) from exc
        yield container


def _video_stream(container: InputContainer, path: _Source) -> VideoStream:
    if not container.streams.video:
        raise InvalidVideo("The file holds no video stream.", detail=path.name)
    return container.streams.video[0]


def _container_name(container: InputContainer, path: Path) -> ContainerName:
    if container.format.name not in _DEMUXERS:
        raise UnsupportedVideo(detail=f"{path.name}: container {container.format.name}")
    if container.format.name == "matroska,webm":
        with path.open("rb") as fh:
            return "webm" if b"webm" in fh.read(64) else "mkv"  # the EBML header's DocType
    brand = container.metadata.get("major_brand", "")
    return "mov" if brand.strip() == "qt" else "mp4"


def _codec_name(stream: VideoStream, path: Path) -> VideoCodec:
    name = stream.codec_context.name
    if name not in _VIDEO_CODECS:
        raise UnsupportedVideo(detail=f"{path.name}: video codec {name}")
    return _VIDEO_CODECS[name]


def _upright(image: RGBImage, rotation_ccw: int) -> RGBImage:
    """Apply a display matrix's rotation (counter-clockwise degrees, as PyAV reports it)."""
    quarter_turns = round(rotation_ccw / 90) % 4
    return np.ascontiguousarray(np.rot90(image, quarter_turns)) if quarter_turns else image


def _scan(container: InputContainer, path: _Source, *, decode_first: bool) -> _Scan:
    """Demux every packet once (no decode, except the first frame when asked): the video
    pts in presentation order, where the video ends, the audio's extent."""
    video = _video_stream(container, path)
    audio = container.streams.audio[0] if container.streams.audio else None
    streams = [video] if audio is None else [video, audio]
    pts: list[int] = []
    keyframes: list[int] = []
    end = 0
    audio_start: int | None = None
    audio_end: int | None = None
    rotation: int | None = None
    fed = discarded = 0
    try:
        for packet in container.demux(streams):
            if packet.size == 0:
                continue  # a demuxer's flush packet
            if packet.stream.index == video.index:
                if packet.pts is None:
                    raise InvalidVideo("A video frame has no timestamp.", detail=path.name)
                if decode_first and rotation is None and fed < _FIRST_FRAME_PACKETS:
                    fed += 1  # the decoder drops the frames of discarded packets itself
                    for frame in video.decode(packet):
                        rotation = frame.rotation
                        break
                if packet.is_discard:
                    discarded += 1  # before the start an edit list sets: decoded, never shown
                    continue
                pts.append(packet.pts)
                if packet.is_keyframe:
                    keyframes.append(packet.pts)
                end = max(end, packet.pts + (packet.duration or 0))
            elif packet.pts is not None and not packet.is_discard:
                start = packet.pts
                audio_start = start if audio_start is None else min(audio_start, start)
                stop = start + (packet.duration or 0)
                audio_end = stop if audio_end is None else max(audio_end, stop)
        if decode_first and rotation is None and pts:
            for frame in video.decode(None):  # a short clip may sit in the decoder's delay
                rotation = frame.rotation
                break
    except av.error.FFmpegError as exc:
        raise _invalid(path, exc) from exc
    if not pts:
        raise InvalidVideo("The video holds no frames.", detail=path.name)
    pts.sort()
    if len(set(pts)) != len(pts):
        raise InvalidVideo("Two video frames share a timestamp.", detail=path.name)
    if end <= pts[-1]:  # the last frame carries no duration: give it the one before
        end = pts[-1] + (pts[-1] - pts[-2] if len(pts) > 1 else 1)
    keyframes.sort()
    return _Scan(pts, keyframes, end, audio_start, audio_end, rotation, discarded)


def _is_variable(pts: list[int], time_base: Fraction) -> bool:
    """Whether the frame intervals differ by more than a tick and a millisecond (a constant
    rate that the time base cannot express exactly, e.g. 29.97 fps in ms, stays constant)."""
    if len(pts) < 3:
        return False
    deltas = np.diff(np.asarray(pts, dtype=np.int64))
    spread = int(deltas.max() - deltas.min())
    return spread > 1 and spread * time_base > Fraction(1, 1000)


def probe_video(path: str | Path, limits: VideoLimits | None = None) -> VideoInfo:
    """Open, validate and measure a video; the frame count is exact (every packet is
    demuxed, only the first frame decoded). Raises ``VideoTooLarge``, ``UnsupportedVideo``,
    ``InvalidVideo`` (unreadable, corrupt, truncated, undecodable),
    ``VideoResolutionTooHigh``, ``VideoTooLong`` or ``VideoFrameRateTooHigh``."""
    return probe_frames(path, limits)[0]


def probe_frames(
    path: str | Path, limits: VideoLimits | None = None
) -> tuple[VideoInfo, FrameScan]:
    """``probe_video`` and, from the same demux pass, ``frame_timestamps`` and the
    keyframes (``read_frames_at``)."""
    path = Path(path)
    limits = limits or VideoLimits()
    size = path.stat().st_size
    if size > limits.max_bytes:
        raise VideoTooLarge(detail=f"{size} bytes > {limits.max_bytes}")
    with _open(path) as container:
        name = _container_name(container, path)
        video = _video_stream(container, path)
        codec = _codec_name(video, path)
        coded_w, coded_h = video.codec_context.width, video.codec_context.height
        if coded_w <= 0 or coded_h <= 0:
            raise InvalidVideo("The video has no picture size.", detail=path.name)
        if max(coded_w, coded_h) > limits.max_side:
            raise VideoResolutionTooHigh(detail=f"{coded_w}x{coded_h} > {limits.max_side}")
        if container.duration is not None and container.duration / av.time_base > (
            limits.max_duration_s + _TRUNCATION_SLACK_S
        ):  # the header's word, before reading everything; the packets confirm below
            raise VideoTooLong(detail=f"{container.duration / av.time_base:.1f} s")
        time_base = video.time_base
        if time_base is None:
            raise InvalidVideo("The video stream has no time base.", detail=path.name)
        declared_frames = video.frames
        scan = _scan(container, path, decode_first=True)
        audio_stream = container.streams.audio[0] if container.streams.audio else None
        audio = _audio_info(audio_stream, scan)
        declared_s = None if container.duration is None else container.duration / av.time_base
    if scan.rotation_ccw is None:
        raise InvalidVideo("No video frame could be decoded.", detail=path.name)
    count = len(scan.pts)
    if declared_frames and count + scan.discarded < declared_frames:
        raise InvalidVideo("The video is truncated.", detail=f"{count} of {declared_frames} frames")
    duration = float((scan.end_pts - scan.pts[0]) * time_base)
    start_s = float(scan.pts[0] * time_base)
    media_end = max(duration + start_s, audio.end_s if audio else 0.0)
    if declared_s is not None and declared_s - media_end > _TRUNCATION_SLACK_S:
        raise InvalidVideo(
            "The video is truncated.", detail=f"{media_end:.2f} s of {declared_s:.2f} s"
        )
    if duration > limits.max_duration_s:
        raise VideoTooLong(detail=f"{duration:.1f} s > {limits.max_duration_s} s")
    fps = count / duration
    if fps > limits.max_fps:
        raise VideoFrameRateTooHigh(detail=f"{fps:.2f} fps > {limits.max_fps}")
    rotation = (-scan.rotation_ccw) % 360
    rotation = 90 * round(rotation / 90) % 360
    width, height = (coded_h, coded_w) if rotation in (90, 270) else (coded_w, coded_h)
    info = VideoInfo(
        container=name,
        video_codec=codec,
        width=width,
        height=height,
        rotation=rotation,
        frame_count=count,
        duration_s=duration,
        fps=fps,
        variable_frame_rate=_is_variable(scan.pts, time_base),
        time_base=time_base,
        first_pts=scan.pts[0],
        end_pts=scan.end_pts,
        audio=audio,
        size_bytes=size,
    )
    return info, FrameScan(scan.pts, scan.keyframes)


def _audio_info(stream: AudioStream | None, scan: _Scan) -> AudioInfo | None:
    if stream is None or scan.audio_start is None or scan.audio_end is None:
        return None
    assert stream.time_base is not None
    start = max(scan.audio_start, 0)  # AAC's priming samples sit before zero
    return AudioInfo(
        codec=stream.codec_context.name,
        sample_rate=stream.codec_context.sample_rate,
        channels=stream.codec_context.channels,
        duration_s=float((scan.audio_end - start) * stream.time_base),
        start_s=float(start * stream.time_base),
    )


def frame_timestamps(source: VideoSource) -> list[int]:
    """The pts of every video frame in presentation order, in the video stream's time base
    (demux only, no decode)."""
    path = _source(source)
    with _open(path) as container:
        return _scan(container, path, decode_first=False).pts


def read_frames(
    source: VideoSource,
    start: int,
    stop: int,
    *,
    timestamps: list[int] | None = None,
) -> Iterator[VideoFrame]:
    """Decode frames ``[start, stop)`` (indices in presentation order) as upright RGB.

    Seeks to the keyframe at or before ``start`` and decodes forward, one frame in memory at
    a time. ``timestamps`` (from :func:`frame_timestamps`) saves a demux pass per call.
    """
    path = _source(source)
    pts = timestamps if timestamps is not None else frame_timestamps(path)
    start, stop = max(start, 0), min(stop, len(pts))
    if start >= stop:
        return
    yield from _decode_wanted(path, pts[0], [{p: start + i for i, p in enumerate(pts[start:stop])}])


def read_frames_at(
    source: VideoSource,
    indices: Iterable[int],
    *,
    timestamps: list[int],
    keyframes: list[int] | None = None,
) -> Iterator[VideoFrame]:
    """Decode the frames at ``indices`` (presentation order; in increasing order, each
    once) as upright RGB, the file opened once. With the video's ``keyframes``
    (``probe_frames``) the decoder runs on from one wanted frame to the next when no
    keyframe lies between them (a seek would start it at the same keyframe again) and
    seeks otherwise; without them it seeks to each frame."""
    path = _source(source)
    runs = decode_runs(indices, timestamps, keyframes)
    if not runs:
        return
    yield from _decode_wanted(
        path, timestamps[0], ({timestamps[i]: i for i in run} for run in runs)
    )


def _decode_wanted(
    path: _Source, origin: int, runs: Iterable[dict[int, int]]
) -> Iterator[VideoFrame]:
    """Each run's frames (``_decode_range``: pts → index) in turn, the file opened once
    and decoded on FFmpeg's threads; FFmpeg's refusals are ``InvalidVideo``."""
    with _open(path) as container:
        video = _video_stream(container, path)
        video.thread_type = "AUTO"
        try:
            for wanted in runs:
                yield from _decode_range(container, video, origin, wanted, path)
        except av.error.FFmpegError as exc:
            raise _invalid(path, exc) from exc


def decode_runs(
    indices: Iterable[int], timestamps: list[int], keyframes: list[int] | None
) -> list[list[int]]:
    """``indices`` (sorted, each once, those of a frame) in runs that one seek each
    decodes: the next wanted frame joins the run when no keyframe lies after the last one
    up to it, so seeking there would restart the decoder at the keyframe it came from."""
    wanted = sorted({i for i in indices if 0 <= i < len(timestamps)})
    runs: list[list[int]] = [[i] for i in wanted[:1]]
    for before, index in itertools.pairwise(wanted):
        at = bisect.bisect_right(keyframes, timestamps[before]) if keyframes else 0
        if keyframes and (at == len(keyframes) or keyframes[at] > timestamps[index]):
            runs[-1].append(index)
        else:
            runs.append([index])
    return runs


def _seek_targets(first: int, origin: int, time_base: Fraction) -> Iterator[int]:
    """Where to seek for a frame at ``first``: there, then ever earlier (1, 4, 16 ... s), then
    the start (a demuxer whose index holds decode times may land one keyframe late)."""
    back = max(1, round(1 / time_base))
    target = first
    while target > origin:
        yield target
        target = max(origin, first - back)
        back *= 4
    yield origin


def _decode_range(
    container: InputContainer,
    video: VideoStream,
    origin: int,
    wanted: dict[int, int],
    path: _Source,
) -> Iterator[VideoFrame]:
    """The frames whose pts ``wanted`` maps to their index, in order, decoded from the
    keyframe before the first (``origin``: the video's first pts); the frames between
    them are decoded but not converted."""
    first, last = min(wanted), max(wanted)
    assert video.time_base is not None
    for target in _seek_targets(first, origin, video.time_base):
        container.seek(target, stream=video, backward=True)
        emitted = 0
        for frame in container.decode(video):
            if frame.pts is None:
                raise InvalidVideo("A decoded frame has no timestamp.", detail=path.name)
            if frame.pts < first:
                continue
            if emitted == 0 and frame.pts > first:
                break  # landed after ``first``: seek earlier
            index = wanted.get(frame.pts)
            if index is None:
                if frame.pts > last:
                    break
                continue
            yield VideoFrame(index=index, pts=frame.pts, image=_rgb(frame))
            emitted += 1
            if emitted == len(wanted):
                return
        if emitted:
            raise InvalidVideo(
                "The video ended early.", detail=f"{path.name}: {emitted} of {len(wanted)}"
            )
        log.info("seek to pts %s in %s landed late; seeking earlier", first, path)
    raise InvalidVideo("The frames could not be decoded.", detail=f"{path.name} @ {first}")


def _rgb(frame: av.VideoFrame) -> RGBImage:
    """A decoded frame as upright RGB (the frame's own colour range honoured)."""
    rgb = frame.to_ndarray(format="rgb24", src_color_range=frame.color_range or None)
    return _upright(np.asarray(rgb, dtype=np.uint8), frame.rotation)


X264Preset = Literal[
    "ultrafast", "superfast", "veryfast", "faster", "fast", "medium", "slow", "slower"
]


class SegmentEncoding(BaseModel):
    """How segments are encoded (libx264). Every segment of a video must share it: the
    join copies their packets under one set of stream headers."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    crf: Annotated[int, Field(ge=0, le=51, description="x264 constant rate factor.")] = 18
    preset: X264Preset = "veryfast"


DEFAULT_ENCODING = SegmentEncoding()


def _even(n: int) -> int:
    return n - (n % 2)


class SegmentWriter:
    """Encode upright RGB frames with their source pts into an H.264 yuv420p MP4 segment.

    The segment's time base is the source's (``info.time_base``) and every frame keeps its
    pts, so a variable frame rate survives. Each frame lasts until the next frame's pts;
    the last one until ``end_pts`` (the pts of the frame after the segment, or
    ``info.end_pts`` for the last segment). No B-frames, so packets come out in
    presentation order and segments concatenate without rewriting a timestamp.
    Frames of odd width or height lose their last column/row (4:2:0 needs even sizes).
    """

    def __init__(
        self,
        path: str | Path,
        *,
        info: VideoInfo,
        end_pts: int,
        encoding: SegmentEncoding = DEFAULT_ENCODING,
    ) -> None:
        self.path = Path(path)
        self.width, self.height = _even(info.width), _even(info.height)
        self.time_base = info.time_base
        self.end_pts = end_pts
        self.frames_written = 0
        self._last_pts: int | None = None
        self._durations: dict[int, int] = {}
        self._pending: list[Packet] = []
        self._source_size = (info.height, info.width)
        self._closed = False
        self._container = av.open(
            str(self.path),
            mode="w",
            format="mp4",
            options={
                "video_track_timescale": str(self.time_base.denominator),
                "movie_timescale": str(self.time_base.denominator),
            },
        )
        rate = Fraction(info.fps).limit_denominator(1001)
        self._stream = self._container.add_stream(
            "libx264",
            rate=rate,
            options={"crf": str(encoding.crf), "preset": encoding.preset, "bf": "0"},
        )
        ctx = self._stream.codec_context
        ctx.width, ctx.height = self.width, self.height
        ctx.pix_fmt = "yuv420p"
        ctx.time_base = self.time_base
        ctx.color_range = 1  # AVCOL_RANGE_MPEG (limited)
        ctx.colorspace = ctx.color_primaries = ctx.color_trc = 1  # BT.709

    def write(self, image: RGBImage, pts: int) -> None:
        """Encode one upright RGB frame shown from ``pts`` on (pts strictly increasing)."""
        if self._last_pts is not None:
            if pts <= self._last_pts:
                raise ValueError(f"pts {pts} does not follow {self._last_pts}")
            self._durations[self._last_pts] = pts - self._last_pts
        self._last_pts = pts
        if image.shape[:2] not in (self._source_size, (self.height, self.width)):
            raise ValueError(f"frame {image.shape} is not {self._source_size} as displayed")
        rgb = np.ascontiguousarray(image[: self.height, : self.width])
        frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
        frame = frame.reformat(format="yuv420p", dst_colorspace="ITU709", dst_color_range="MPEG")
        frame.pts = pts
        frame.time_base = self.time_base
        self._mux(self._stream.encode(frame))
        self.frames_written += 1

    def _mux(self, packets: Iterable[Packet]) -> None:
        """Mux packets once their duration (the gap to the next frame) is known."""
        self._pending.extend(packets)
        while self._pending and self._pending[0].pts in self._durations:
            packet = self._pending.pop(0)
            assert packet.pts is not None
            packet.duration = self._durations.pop(packet.pts)
            self._container.mux(packet)

    def close(self) -> None:
        """Flush the encoder and finish the file."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._last_pts is not None:
                if self.end_pts <= self._last_pts:
                    raise ValueError(f"end_pts {self.end_pts} <= last pts {self._last_pts}")
                self._durations[self._last_pts] = self.end_pts - self._last_pts
            self._mux(self._stream.encode(None))
            if self._pending:
                raise RuntimeError(f"{len(self._pending)} packets without a frame duration")
        finally:
            self._container.close()

    def __enter__(self) -> SegmentWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            self.close()
        finally:
            if exc_type is not None:
                self.path.unlink(missing_ok=True)  # never leave half a segment behind


def write_segment(
    frames: Iterable[VideoFrame],
    path: str | Path,
    *,
    info: VideoInfo,
    end_pts: int,
    encoding: SegmentEncoding = DEFAULT_ENCODING,
) -> int:
    """Encode ``frames`` (upright RGB, source pts) into an MP4 segment; returns the count.
    See :class:`SegmentWriter`."""
    with SegmentWriter(path, info=info, end_pts=end_pts, encoding=encoding) as writer:
        for frame in frames:
            writer.write(frame.image, frame.pts)
    return writer.frames_written


def _key(packet: Packet) -> Fraction:
    """A packet's decode time in seconds, to interleave streams."""
    assert packet.time_base is not None
    ts = packet.dts if packet.dts is not None else packet.pts
    return Fraction(ts or 0) * packet.time_base


def _segment_packets(segments: list[Path]) -> Iterator[Packet]:
    """The video packets of every segment in order, checking that they fit together."""
    extradata: bytes | None = None
    last_dts: int | None = None
    for segment in segments:
        with _open(segment) as container:
            stream = _video_stream(container, segment)
            data = bytes(stream.codec_context.extradata or b"")
            if extradata is None:
                extradata = data
            elif data != extradata:
                raise VideoAssemblyFailed(detail=f"{segment.name}: other encoder settings")
            first = True
            for packet in container.demux(stream):
                if packet.size == 0:
                    continue
                if first and not packet.is_keyframe:
                    raise VideoAssemblyFailed(detail=f"{segment.name}: no keyframe first")
                first = False
                if last_dts is not None and packet.dts is not None and packet.dts <= last_dts:
                    raise VideoAssemblyFailed(detail=f"{segment.name}: overlaps the one before")
                last_dts = packet.dts
                yield packet


def _copied_audio(container: InputContainer, stream: AudioStream) -> Iterator[Packet]:
    for packet in container.demux(stream):
        if packet.size and packet.dts is not None:
            yield packet


def _transcoded_audio(
    container: InputContainer, stream: AudioStream, out: AudioStream
) -> Iterator[Packet]:
    """Decode the source's audio and encode it as AAC, one frame at a time."""
    resampler = av.AudioResampler(
        format="fltp",
        layout=out.codec_context.layout,
        rate=out.codec_context.sample_rate,
        frame_size=out.codec_context.frame_size or 1024,
    )
    for packet in container.demux(stream):
        for frame in packet.decode():
            for chunk in resampler.resample(frame):  # type: ignore[arg-type]
                yield from out.encode(chunk)
    for chunk in resampler.resample(None):
        yield from out.encode(chunk)
    yield from out.encode(None)


def join_segments(
    segments: Iterable[str | Path],
    source: str | Path,
    out: str | Path,
    *,
    source_info: VideoInfo | None = None,
) -> VideoInfo:
    """Concatenate segments without re-encoding into ``out`` (MP4, ``+faststart``) with the
    source's audio (copied when MP4 takes its codec, else AAC), then check the result: the
    source's frame count, and its video and audio durations within one frame. Raises
    ``VideoAssemblyFailed`` when the result does not match. Returns the result's info."""
    parts = [Path(s) for s in segments]
    source, out = Path(source), Path(out)
    if not parts:
        raise VideoAssemblyFailed(detail="no segments")
    expected = source_info or probe_video(source, _UNLIMITED)
    try:
        _mux_join(parts, source, out, expected.time_base)
        result = probe_video(out, _UNLIMITED)
        _check_join(result, expected, out)
    except BaseException:
        out.unlink(missing_ok=True)  # never leave a result that does not match its source
        raise
    return result


def _mux_join(parts: list[Path], source: Path, out: Path, time_base: Fraction) -> None:
    """Write the segments' video packets and the source's audio, interleaved by time."""
    with ExitStack() as stack:
        output = stack.enter_context(
            av.open(
                str(out),
                mode="w",
                format="mp4",
                options={
                    "movflags": "+faststart",
                    "video_track_timescale": str(time_base.denominator),
                    "movie_timescale": str(time_base.denominator),  # exact edit lists
                },
            )
        )
        with _open(parts[0]) as first:
            out_video = output.add_stream_from_template(_video_stream(first, parts[0]))
        streams: list[Iterator[Packet]] = [_retarget(_segment_packets(parts), out_video)]
        src = stack.enter_context(_open(source))
        if src.streams.audio:
            streams.append(_audio_packets(src, src.streams.audio[0], output))
        try:
            for packet in heapq.merge(*streams, key=_key):
                output.mux(packet)
        except av.error.FFmpegError as exc:
            raise VideoAssemblyFailed(detail=f"{out.name}: {exc}") from exc


def _retarget(packets: Iterator[Packet], stream: VideoStream | AudioStream) -> Iterator[Packet]:
    for packet in packets:
        packet.stream = stream
        yield packet


def _audio_packets(
    container: InputContainer, stream: AudioStream, output: av.container.OutputContainer
) -> Iterator[Packet]:
    if stream.codec_context.name in AUDIO_COPY_CODECS:
        out_audio = output.add_stream_from_template(stream)
        return _retarget(_copied_audio(container, stream), out_audio)
    ctx = stream.codec_context
    aac = output.add_stream("aac", rate=ctx.sample_rate)
    # AAC takes mono, stereo and 5.1 here; other multichannel layouts are mixed to 5.1
    aac.codec_context.layout = ctx.layout.name if ctx.layout.nb_channels <= 2 else "5.1"
    aac.codec_context.bit_rate = AAC_BIT_RATE
    aac.codec_context.time_base = Fraction(1, ctx.sample_rate)
    return _transcoded_audio(container, stream, aac)


_UNLIMITED = VideoLimits(max_bytes=1 << 62, max_duration_s=1e12, max_side=1 << 30, max_fps=1e9)


def _check_join(result: VideoInfo, expected: VideoInfo, out: Path) -> None:
    frame = 1.0 / expected.fps
    problems = []
    if result.frame_count != expected.frame_count:
        problems.append(f"{result.frame_count} frames, source {expected.frame_count}")
    if abs(result.duration_s - expected.duration_s) > frame:
        problems.append(f"video {result.duration_s:.3f} s, source {expected.duration_s:.3f} s")
    if (result.audio is None) != (expected.audio is None):
        problems.append("audio lost" if result.audio is None else "audio appeared")
    elif result.audio and expected.audio:
        got, want = result.audio, expected.audio
        # An AAC encoder's priming frame may sit before a delayed start: a transcode's
        # duration may differ by that frame, its end may not.
        slack = frame + (0.0 if got.codec == want.codec else AAC_FRAME / want.sample_rate)
        if abs(got.end_s - want.end_s) > frame or abs(got.duration_s - want.duration_s) > slack:
            problems.append(
                f"audio {got.start_s:.3f}-{got.end_s:.3f} s, "
                f"source {want.start_s:.3f}-{want.end_s:.3f} s"
            )
    if problems:
        raise VideoAssemblyFailed(detail=f"{out.name}: " + "; ".join(problems))
