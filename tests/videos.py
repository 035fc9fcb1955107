"""Small test videos made from package photos (no network, no system ffmpeg).

The story clip (``story_frames``), in scenes at ``fps`` frames per second:

- ``pan``: a slow pan and zoom over insightface's ``t1.jpg`` (six faces);
- ``astronaut``: a hard cut to skimage's astronaut; the window slides right until her face
  leaves the frame (``face_out``) and slides back until it is whole again;
- ``no_face``: skimage's coffee cup, no face at all.

``Videos(directory)`` writes each variant on first use and caches it (one per test session
through the ``videos`` fixture): the story as MP4/H.264 with a sine-tone AAC track, the
story thrice with a keyframe a second (``long``), a variable-frame-rate MP4, a
phone-style MOV/H.265 whose display matrix turns it 90°, the pair clip (``pair_frames``:
the astronaut and Grace Hopper swap places), a WebM (VP9, odd size, Opus), an MKV (AV1,
FLAC starting late), a silent MP4, a trimmed MP4 (an edit list hides its first frames),
and broken files: truncated with and without the index, a corrupt index, not a video, an
unsupported codec and container.
"""

from __future__ import annotations

import itertools
import math
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass
from fractions import Fraction
from functools import cached_property
from pathlib import Path

import av
import numpy as np
from av.audio.stream import AudioStream
from av.video.stream import VideoStream
from PIL import Image

from tasks.types import RGBImage
from tests import samples

os.environ.setdefault("SVT_LOG", "1")  # SVT-AV1: errors only (it prints its banner otherwise)

WIDTH, HEIGHT, FPS = 480, 360, 15
SCENE_S = 2  # seconds per scene
TONE_HZ = 440.0
AUDIO_RATE = 44_100


@dataclass(frozen=True, slots=True)
class Scenes:
    """Frame index ranges ``[start, stop)`` of the story's scenes at a frame rate."""

    pan: range
    astronaut: range
    face_out: range  # inside ``astronaut``: the astronaut's face is wholly outside the frame
    no_face: range

    @property
    def frame_count(self) -> int:
        return self.no_face.stop

    @property
    def cuts(self) -> tuple[int, ...]:
        """The first frame of each scene after the first (hard cuts)."""
        return (self.astronaut.start, self.no_face.start)


def scenes(fps: int = FPS) -> Scenes:
    n = SCENE_S * fps
    slide = _astronaut_offsets(n)
    out = [i for i, dx in enumerate(slide) if dx >= _FACE_GONE]
    return Scenes(
        pan=range(0, n),
        astronaut=range(n, 2 * n),
        face_out=range(n + out[0], n + out[-1] + 1),
        no_face=range(2 * n, 3 * n),
    )


def _resize(image: RGBImage, width: int, height: int) -> RGBImage:
    return np.asarray(Image.fromarray(image).resize((width, height), Image.Resampling.BILINEAR))


def _window(image: RGBImage, cx: float, cy: float, w: float, width: int, height: int) -> RGBImage:
    """The ``width`` x ``height`` view of a window ``w`` wide centred on (cx, cy)."""
    h = w * height / width
    x0 = round(min(max(cx - w / 2, 0), image.shape[1] - w))
    y0 = round(min(max(cy - h / 2, 0), image.shape[0] - h))
    return _resize(image[y0 : y0 + int(h), x0 : x0 + int(w)], width, height)


# The astronaut scene slides a window over [astronaut | coffee cup]: at offset dx (in the
# strip's pixels, window as wide as the astronaut) her face (x 160-290 of 512) is gone once
# dx passes 290.
_FACE_GONE = 300


def _astronaut_offsets(n: int) -> list[int]:
    """Window offsets: out to 400 px (face gone) and back to 0 over ``n`` frames."""
    return [round(400 * math.sin(math.pi * i / max(n - 1, 1))) for i in range(n)]


def story_frames(width: int = WIDTH, height: int = HEIGHT, fps: int = FPS) -> Iterator[RGBImage]:
    """The story's frames, upright, ``width`` x ``height``."""
    n = SCENE_S * fps
    full = samples.t1_rgb()
    t1 = _resize(full, full.shape[1] * 3 // 5, full.shape[0] * 3 // 5)  # fewer pixels to scale
    th, tw = t1.shape[:2]
    for i in range(n):  # pan left to right while zooming in from 90 % to 55 % of the width
        s = i / max(n - 1, 1)
        w = tw * (0.9 - 0.35 * s)
        yield _window(t1, tw * (0.3 + 0.4 * s), th * 0.45, w, width, height)
    astronaut = samples.astronaut_rgb()
    cup = _resize(samples.no_face_rgb(), 512, 512)
    strip = np.concatenate([astronaut, cup], axis=1)
    for dx in _astronaut_offsets(n):
        yield _window(strip, dx + 256, 256, 512, width, height)
    cup_full = samples.no_face_rgb()
    ch, cw = cup_full.shape[:2]
    for i in range(n):
        yield _window(cup_full, cw / 2, ch / 2, cw * (1.0 - 0.2 * i / max(n - 1, 1)), width, height)


# The pair clip: two people who swap places. The astronaut goes left to right over the
# top, Grace Hopper right to left underneath; their sprites never overlap.
PAIR_FRAMES = 45
PAIR_SPRITE = (118, 150)  # width, height
_PAIR_CROPS = {"astronaut": (128, 0, 320, 250), "grace_hopper": (70, 0, 458, 480)}


@dataclass(frozen=True, slots=True)
class Sprite:
    """Where one person's picture is in a frame of the pair clip: (x1, y1, x2, y2)."""

    x1: int
    y1: int
    x2: int
    y2: int

    def holds(self, x: float, y: float) -> bool:
        """Whether the point (x, y) is inside."""
        return self.x1 <= x < self.x2 and self.y1 <= y < self.y2


def pair_sprites(frames: int = PAIR_FRAMES) -> list[dict[str, Sprite]]:
    """Per frame of the pair clip, where each person is (``astronaut``, ``grace_hopper``):
    side by side at first (the astronaut on the left), swapped at the end."""
    w, h = PAIR_SPRITE
    out = []
    for i in range(frames):
        s = i / max(frames - 1, 1)
        lift = round(105 * math.sin(math.pi * s))
        ax, gx = round(20 + 322 * s), round(342 - 322 * s)
        out.append(
            {
                "astronaut": Sprite(ax, 105 - lift, ax + w, 105 - lift + h),
                "grace_hopper": Sprite(gx, 105 + lift, gx + w, 105 + lift + h),
            }
        )
    return out


def pair_frames(frames: int = PAIR_FRAMES) -> Iterator[RGBImage]:
    """The pair clip's frames (480x360) on a grey gradient."""
    w, h = PAIR_SPRITE
    photos = {"astronaut": samples.astronaut_rgb(), "grace_hopper": samples.grace_hopper_rgb()}
    sprites = {}
    for name, (x1, y1, x2, y2) in _PAIR_CROPS.items():
        sprites[name] = _resize(photos[name][y1:y2, x1:x2], w, h)
    ramp = np.linspace(90, 150, WIDTH, dtype=np.uint8)
    background = np.repeat(np.tile(ramp[None, :, None], (HEIGHT, 1, 1)), 3, axis=2)
    for where in pair_sprites(frames):
        frame = background.copy()
        for name, box in where.items():
            frame[box.y1 : box.y2, box.x1 : box.x2] = sprites[name]
        yield frame


def t1_face_jpeg(index: int) -> bytes:
    """A photo of one person of ``t1.jpg`` (0: the leftmost, 1: the third from the left):
    a source face distinct from the pair clip's people."""
    x1, y1, x2, y2 = ((0, 180, 240, 480), (400, 180, 640, 480))[index]
    return samples.encode(np.ascontiguousarray(samples.t1_rgb()[y1:y2, x1:x2]), "JPEG", quality=95)


def _sine(rate: int, seconds: float, layout: str, delay_s: float) -> Iterator[av.AudioFrame]:
    """A tone from ``delay_s`` to ``seconds``."""
    channels = 1 if layout == "mono" else 2
    total = round(rate * seconds)
    for start in range(round(rate * delay_s), total, 1024):
        t = np.arange(start, min(start + 1024, total)) / rate
        wave = (0.3 * np.sin(2 * np.pi * TONE_HZ * t)).astype(np.float32)
        frame = av.AudioFrame.from_ndarray(
            np.tile(wave, (channels, 1)), format="fltp", layout=layout
        )
        frame.sample_rate = rate
        frame.pts = start
        frame.time_base = Fraction(1, rate)
        yield frame


def encode_video(
    path: Path,
    frames: Iterator[RGBImage] | list[RGBImage],
    pts: list[int],
    *,
    time_base: Fraction,
    codec: str = "libx264",
    container: str = "mp4",
    options: dict[str, str] | None = None,
    rotation_cw: int = 0,
    audio: str | None = None,
    audio_layout: str = "stereo",
    audio_delay_s: float = 0.0,
    end_pts: int | None = None,
    container_options: dict[str, str] | None = None,
) -> Path:
    """Write ``frames`` shown at ``pts`` (stored as given; ``rotation_cw`` only sets the
    display matrix), with a sine tone in codec ``audio`` from ``audio_delay_s`` to the end
    of the video."""
    frames = list(frames)
    height, width = frames[0].shape[:2]
    end = end_pts if end_pts is not None else pts[-1] + (pts[-1] - pts[-2])
    seconds = float((end - max(pts[0], 0)) * time_base)  # what is shown
    rate = Fraction(len(frames)) / Fraction(end - pts[0]) / time_base
    with av.open(str(path), "w", format=container, options=container_options or {}) as out:
        defaults = {"preset": "veryfast"} if codec == "libx264" else {}
        stream = out.add_stream(
            codec, rate=rate.limit_denominator(1001), options=defaults | (options or {})
        )
        assert isinstance(stream, VideoStream)
        stream.width, stream.height = width, height
        stream.pix_fmt = "yuv420p"
        stream.codec_context.time_base = time_base
        if rotation_cw:
            stream.set_display_rotation(-rotation_cw)  # PyAV takes counter-clockwise degrees
        sound: AudioStream | None = None
        if audio is not None:
            added = out.add_stream(audio, rate=AUDIO_RATE if audio != "libopus" else 48_000)
            assert isinstance(added, AudioStream)
            sound = added
            sound.codec_context.layout = audio_layout
        for image, p in zip(frames, pts, strict=True):
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(image), format="rgb24")
            frame.pts, frame.time_base = p, time_base
            out.mux(stream.encode(frame))
        out.mux(stream.encode(None))
        if sound is not None:
            rate_hz = sound.codec_context.sample_rate
            fmt = sound.codec_context.format.name  # the encoder's sample format
            resampler = av.AudioResampler(
                format=fmt, layout=audio_layout, rate=rate_hz, frame_size=sound.frame_size or 1024
            )
            for chunk in _sine(rate_hz, seconds, audio_layout, audio_delay_s):
                for piece in resampler.resample(chunk):
                    out.mux(sound.encode(piece))
            for piece in resampler.resample(None):
                out.mux(sound.encode(piece))
            out.mux(sound.encode(None))
    return path


def vfr_pts(count: int, seed: int = 7) -> list[int]:
    """Irregular pts at 1/90000: 15 fps with dropped frames, bursts at 30 fps and one
    half-second stall (a phone's variable frame rate)."""
    rng = random.Random(seed)
    pts = [0]
    for i in range(1, count):
        step = 90_000 // 15 if i % 10 else 45_000
        pts.append(pts[-1] + rng.choice([step, step, 3000, 3003, 9000]))
    return pts


def interleave(source: Path, out: Path) -> Path:
    """``source``'s packets remuxed into ``out`` in time order (``encode_video`` gives the
    muxer every video packet before the audio, which lands seconds away in the file)."""
    with av.open(str(source)) as src, av.open(str(out), "w", format="mp4") as dst:
        streams = {s.index: dst.add_stream_from_template(s) for s in src.streams}
        packets = [p for p in src.demux() if p.dts is not None]
        for packet in sorted(packets, key=lambda p: p.dts * p.time_base):  # type: ignore[operator]
            packet.stream = streams[packet.stream.index]
            dst.mux(packet)
    return out


class Videos:
    """The test videos, each written on first use under ``directory``."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def _path(self, name: str) -> Path:
        return self.directory / name

    @cached_property
    def story_images(self) -> list[RGBImage]:
        return list(story_frames())

    @cached_property
    def story(self) -> Path:
        """MP4, H.264 (with B-frames), 480x360, 15 fps, 6 s, AAC stereo 44.1 kHz."""
        return self._clip(
            "story.mp4",
            self.story_images,
            audio="aac",
            container_options={"movflags": "+faststart"},
        )

    @cached_property
    def long(self) -> Path:
        """MP4, H.264, the story three times (18 s, several chunks), a keyframe every second,
        AAC interleaved by time and the index (moov) last, as a camera writes them: what
        one chunk's part seeks in."""
        frames = self.story_images * 3
        clip = self._clip("long-muxed.mp4", frames, audio="aac", options={"g": str(FPS)})
        return interleave(clip, self._path("long.mp4"))

    @cached_property
    def vfr(self) -> Path:
        """MP4, H.264, the story's frames at irregular pts (1/90000), AAC."""
        frames = self.story_images
        return encode_video(
            self._path("vfr.mp4"),
            frames,
            vfr_pts(len(frames)),
            time_base=Fraction(1, 90_000),
            audio="aac",
            container_options={"video_track_timescale": "90000"},
        )

    @cached_property
    def rotated(self) -> Path:
        """MOV, H.265 (open GOPs), stored 480x360 on its side, displayed upright 360x480."""
        upright = itertools.islice(story_frames(HEIGHT, WIDTH), 3 * FPS)
        stored = [np.ascontiguousarray(np.rot90(image, 1)) for image in upright]
        return encode_video(
            self._path("rotated.mov"),
            stored,
            [1000 * i for i in range(len(stored))],
            time_base=Fraction(1, 1000 * FPS),
            codec="libx265",
            container="mov",
            # open GOPs of 12 with B-frames: leading frames a seek must not lose
            options={
                "preset": "ultrafast",
                "x265-params": "log-level=error:keyint=12:open-gop=1:bframes=3",
            },
            rotation_cw=90,
            audio="aac",
            audio_layout="mono",
        )

    @cached_property
    def webm(self) -> Path:
        """WebM, VP9, odd size 479x359, 3 s, Opus."""
        frames = [np.ascontiguousarray(image[:359, :479]) for image in self.story_images[: 3 * FPS]]
        return encode_video(
            self._path("clip.webm"),
            frames,
            [round(i * 1000 / FPS) for i in range(len(frames))],  # 66 or 67 ms: still constant
            time_base=Fraction(1, 1000),
            codec="libvpx-vp9",
            container="webm",
            options={"deadline": "realtime", "cpu-used": "8"},
            audio="libopus",
            end_pts=round(len(frames) * 1000 / FPS),
        )

    @cached_property
    def mkv(self) -> Path:
        """MKV, AV1, 2 s, FLAC from 0.4 s on (transcoded to AAC on join)."""
        return self._clip(
            "clip.mkv",
            self.story_images[FPS : 3 * FPS],
            codec="libsvtav1",
            container="matroska",
            options={"preset": "12"},
            audio="flac",
            audio_delay_s=0.4,
        )

    @cached_property
    def silent(self) -> Path:
        """MP4, H.264, 2 s, no audio."""
        return self._clip("silent.mp4", self.story_images[: 2 * FPS])

    @cached_property
    def pair(self) -> Path:
        """MP4, H.264, 3 s at 15 fps, no audio: two people who swap places
        (``pair_sprites``)."""
        return self._clip("pair.mp4", list(pair_frames()))

    @cached_property
    def short(self) -> Path:
        """MP4, H.264, 2 s of the story around its first cut (the pan's end, then the
        astronaut from frame 5), AAC stereo: the end-to-end suites' clip."""
        return self._clip(
            "short.mp4",
            self.story_images[FPS * SCENE_S - 5 : FPS * SCENE_S + 25],
            audio="aac",
            container_options={"movflags": "+faststart"},
        )

    @cached_property
    def trimmed(self) -> Path:
        """MP4, H.264, 30 frames of which the edit list shows the last 27 (a trimmed clip:
        the first three are decoded, never shown), AAC."""
        frames = self.story_images[: 2 * FPS]
        return encode_video(
            self._path("trimmed.mp4"),
            frames,
            [i - 3 for i in range(len(frames))],
            time_base=Fraction(1, FPS),
            audio="aac",
        )

    @cached_property
    def truncated(self) -> Path:
        """The story (index first) cut at 60 %: frames the index lists are missing."""
        data = self.story.read_bytes()
        return self._write("truncated.mp4", data[: len(data) * 6 // 10])

    @cached_property
    def truncated_no_index(self) -> Path:
        """The silent clip (index last) cut at 60 %: an upload that stopped early."""
        data = self.silent.read_bytes()
        return self._write("truncated_no_index.mp4", data[: len(data) * 6 // 10])

    @cached_property
    def corrupt(self) -> Path:
        """The story with its index (moov) overwritten by noise."""
        data = bytearray(self.story.read_bytes())
        moov = data.index(b"moov")
        noise = np.random.default_rng(3).integers(0, 256, 2000, dtype=np.uint8).tobytes()
        data[moov + 4 : moov + 4 + len(noise)] = noise
        return self._write("corrupt.mp4", bytes(data))

    @cached_property
    def not_video(self) -> Path:
        return self._write("not_video.mp4", samples.t1_jpeg_bytes())

    @cached_property
    def unsupported_codec(self) -> Path:
        """MP4 with MPEG-4 Part 2 video."""
        return self._clip("mpeg4.mp4", self.story_images[:10], codec="mpeg4")

    @cached_property
    def unsupported_container(self) -> Path:
        """AVI with H.264 video."""
        return self._clip("clip.avi", self.story_images[:10], container="avi")

    def _clip(self, name: str, frames: list[RGBImage], **kwargs: object) -> Path:
        """``frames`` at a constant ``FPS`` (pts 0, 1, 2 ... in 1/FPS) under ``name``."""
        return encode_video(
            self._path(name),
            frames,
            list(range(len(frames))),
            time_base=Fraction(1, FPS),
            **kwargs,  # type: ignore[arg-type]
        )

    def _write(self, name: str, data: bytes) -> Path:
        path = self._path(name)
        path.write_bytes(data)
        return path
