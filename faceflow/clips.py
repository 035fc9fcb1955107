"""Short clips made from the sample photos, for video benchmarks and tests: frames, an
encode as the render pass encodes, and a re-encode at a chosen bitrate."""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
from PIL import Image

from faceflow.samples import astronaut_rgb, grace_hopper_rgb
from tasks.types import RGBImage
from tasks.video_io import SegmentWriter, VideoInfo, read_frames

FPS = 15


def pan_frames(width: int, height: int, count: int) -> list[RGBImage]:
    """``count`` frames of a slow pan and zoom over the astronaut and Grace Hopper side by
    side, ``width`` x ``height``."""
    right = np.asarray(
        Image.fromarray(grace_hopper_rgb()).resize((512 * 512 // 600, 512)), dtype=np.uint8
    )
    strip = np.concatenate([astronaut_rgb(), right], axis=1)
    frames = []
    for i in range(count):
        s = i / max(count - 1, 1)
        w = strip.shape[1] * (0.8 - 0.2 * s)
        h = min(w * height / width, strip.shape[0])
        x0 = round((strip.shape[1] - w) * s)
        y0 = round((strip.shape[0] - h) / 2)
        window = Image.fromarray(strip[y0 : y0 + int(h), x0 : x0 + int(w)])
        frames.append(
            np.asarray(window.resize((width, height), Image.Resampling.BILINEAR), np.uint8)
        )
    return frames


def write_clip(frames: Sequence[RGBImage], path: Path, fps: int = FPS) -> int:
    """Encode ``frames`` as the render pass encodes a segment (``SegmentWriter``: H.264
    CRF 18); the file's size in bytes."""
    h, w = frames[0].shape[:2]
    info = VideoInfo(
        container="mp4",
        video_codec="h264",
        width=w,
        height=h,
        rotation=0,
        frame_count=len(frames),
        duration_s=len(frames) / fps,
        fps=float(fps),
        variable_frame_rate=False,
        time_base=Fraction(1, fps),
        first_pts=0,
        end_pts=len(frames),
        audio=None,
        size_bytes=0,
    )
    with SegmentWriter(path, info=info, end_pts=len(frames)) as writer:
        for i, frame in enumerate(frames):
            writer.write(frame, i)
    return path.stat().st_size


def reencode(source: Path, dest: Path, bit_rate: int, fps: int = FPS) -> None:
    """Re-encode ``source``'s frames with libx264 at ``bit_rate`` bits/s (ABR, preset
    medium), as a platform that re-compresses uploads does."""
    frames = [f.image for f in read_frames(source, 0, 1 << 30)]
    h, w = frames[0].shape[:2]
    with av.open(str(dest), "w", format="mp4") as out:
        stream = out.add_stream("libx264", rate=fps, options={"preset": "medium"})
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        stream.bit_rate = bit_rate
        for i, image in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(image, format="rgb24").reformat(format="yuv420p")
            frame.pts = i
            out.mux(stream.encode(frame))
        out.mux(stream.encode(None))
