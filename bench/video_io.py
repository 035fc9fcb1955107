"""Video I/O throughput on this CPU: segment encode, decode to RGB, probe, join.

Run: ``.venv/bin/python bench/video_io.py [--width 1280 --height 720 --frames 300]
[--preset veryfast]``.
Makes a clip of t1.jpg pans with ``SegmentWriter`` (libx264, the service's settings), then
times ``read_frames`` over it, ``probe_video`` and ``join_segments`` of three segments.
Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from fractions import Fraction
from pathlib import Path
from typing import get_args

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
from PIL import Image

from faceflow import samples
from tasks.video_io import (
    SegmentEncoding,
    SegmentWriter,
    VideoInfo,
    X264Preset,
    join_segments,
    probe_video,
    read_frames,
)


def _pan(width: int, height: int, count: int) -> list[np.ndarray]:
    """``count`` distinct views of t1.jpg panning left to right."""
    t1 = Image.fromarray(samples.t1_rgb())
    w = int(t1.width * 0.7)
    h = int(w * height / width)
    views = []
    for i in range(count):
        x = int((t1.width - w) * i / max(count - 1, 1))
        box = (x, (t1.height - h) // 2, x + w, (t1.height - h) // 2 + h)
        views.append(np.asarray(t1.crop(box).resize((width, height), Image.Resampling.BILINEAR)))
    return views


def _long_clip(path: Path, n: int) -> dict[str, float | str]:
    """Probe and decode a longer clip of noise (large packets): cost and memory growth."""
    rng = np.random.default_rng(0)
    noise = [rng.integers(0, 255, (240, 320, 3), dtype=np.uint8) for _ in range(8)]
    info = VideoInfo(
        container="mp4",
        video_codec="h264",
        width=320,
        height=240,
        rotation=0,
        frame_count=n,
        duration_s=n / 30,
        fps=30.0,
        variable_frame_rate=False,
        time_base=Fraction(1, 30),
        first_pts=0,
        end_pts=n,
        audio=None,
        size_bytes=0,
    )
    encoding = SegmentEncoding(preset="ultrafast")
    with SegmentWriter(path, info=info, end_pts=n, encoding=encoding) as writer:
        for i in range(n):
            writer.write(noise[i % len(noise)], i)
    start = time.perf_counter()
    probe_video(path)
    probe_s = time.perf_counter() - start
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    decoded = sum(1 for _ in read_frames(path, 0, n))
    growth = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    return {
        "long_clip": f"{decoded} frames, {path.stat().st_size / 1e6:.0f} MB",
        "long_probe_s": probe_s,
        "long_decode_peak_rss_growth_mb": growth,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--width", type=int, default=1280)
    parser.add_argument("--height", type=int, default=720)
    parser.add_argument("--frames", type=int, default=300)
    parser.add_argument("--fps", type=int, default=30)
    parser.add_argument("--preset", default=SegmentEncoding().preset, choices=get_args(X264Preset))
    parser.add_argument(
        "--long-frames",
        type=int,
        default=1800,
        help="Frames of a 320x240 30 fps clip (noise, ultrafast) to probe and decode whole: "
        "probe time and peak-RSS growth against length (0: skip).",
    )
    args = parser.parse_args()
    views = _pan(args.width, args.height, 60)
    encoding = SegmentEncoding(preset=args.preset)
    tb = Fraction(1, args.fps * 512)
    n = args.frames
    info = VideoInfo(
        container="mp4",
        video_codec="h264",
        width=args.width,
        height=args.height,
        rotation=0,
        frame_count=n,
        duration_s=n / args.fps,
        fps=float(args.fps),
        variable_frame_rate=False,
        time_base=tb,
        first_pts=0,
        end_pts=n * 512,
        audio=None,
        size_bytes=0,
    )
    figures: dict[str, float | str] = {"cpus": str(os.cpu_count()), "load": str(os.getloadavg())}
    with tempfile.TemporaryDirectory() as tmp:
        clip = Path(tmp) / "clip.mp4"
        start = time.perf_counter()
        with SegmentWriter(clip, info=info, end_pts=info.end_pts, encoding=encoding) as writer:
            for i in range(n):
                writer.write(views[i % len(views)], i * 512)
        figures["encode_fps"] = n / (time.perf_counter() - start)
        start = time.perf_counter()
        probed = probe_video(clip)
        figures["probe_s"] = time.perf_counter() - start
        start = time.perf_counter()
        decoded = sum(1 for _ in read_frames(clip, 0, n))
        figures["decode_rgb_fps"] = decoded / (time.perf_counter() - start)
        cuts = [0, n // 3, 2 * n // 3, n]
        segments = []
        for k in range(3):
            part = Path(tmp) / f"segment-{k}.mp4"
            end = cuts[k + 1] * 512
            with SegmentWriter(part, info=probed, end_pts=end, encoding=encoding) as writer:
                for frame in read_frames(clip, cuts[k], cuts[k + 1]):
                    writer.write(frame.image, frame.pts)
            segments.append(part)
        start = time.perf_counter()
        join_segments(segments, clip, Path(tmp) / "joined.mp4", source_info=probed)
        figures["join_s"] = time.perf_counter() - start
        if args.long_frames:
            figures |= _long_clip(Path(tmp) / "long.mp4", args.long_frames)
    figures["size"] = f"{args.width}x{args.height}, {n} frames, x264 {args.preset}"
    print(json.dumps(figures, indent=2, default=str))


if __name__ == "__main__":
    main()
