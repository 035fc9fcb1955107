"""One chunk part's read of an upload on S3: in place (ranged GETs) versus downloaded whole.

Run: ``.venv/bin/python bench/s3_range.py [--width 1280 --height 720 --seconds 40
--fps 25 --chunk-s 10 --block-mib 2]``.
Writes a clip of t1.jpg pans (libx264, a keyframe every 2 s, index last), stores it in a
moto S3 server on 127.0.0.1 (an S3Bucket block, as production's), then decodes the middle
chunk's frames twice: from ``fetch_to``'s downloaded file, and from ``read_in_place``'s
``RangedSource``. Prints the bytes fetched, requests and times as JSON; asserts that both
give the same frames. Loopback moto has no S3 latency: a request costs what moto costs.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from fractions import Fraction
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import av
import numpy as np
from PIL import Image

from blocks.ranged import RangedSource
from blocks.storage import fetch_to, put_from, read_in_place, s3_storage
from faceflow import samples
from faceflow.testing.s3 import moto_server
from tasks.video_io import probe_frames, read_frames


def _clip(path: Path, width: int, height: int, fps: int, seconds: int) -> Path:
    """A pan over t1.jpg, back and forth, ``seconds`` long (moov last, no audio)."""
    t1 = Image.fromarray(samples.t1_rgb())
    w = int(t1.width * 0.6)
    h = int(w * height / width)
    count = fps * seconds
    with av.open(str(path), "w", format="mp4") as out:
        stream = out.add_stream(
            "libx264", rate=fps, options={"preset": "ultrafast", "g": str(2 * fps)}
        )
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.codec_context.time_base = Fraction(1, fps)
        for i in range(count):
            s = abs((i % (8 * fps)) / (4 * fps) - 1)  # a pan out and back every 8 s
            x = int((t1.width - w) * s)
            box = (x, (t1.height - h) // 2, x + w, (t1.height - h) // 2 + h)
            image = np.asarray(t1.crop(box).resize((width, height), Image.Resampling.BILINEAR))
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(image), format="rgb24")
            frame.pts = i
            out.mux(stream.encode(frame))
        out.mux(stream.encode(None))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--width", type=int, default=1280)
    parser.add_argument("--height", type=int, default=720)
    parser.add_argument("--seconds", type=int, default=40)
    parser.add_argument("--fps", type=int, default=25)
    parser.add_argument("--chunk-s", type=float, default=10.0)
    parser.add_argument("--block-mib", type=float, default=2.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        began = time.perf_counter()
        video = _clip(work / "clip.mp4", args.width, args.height, args.fps, args.seconds)
        encoded_s = time.perf_counter() - began
        with moto_server(work, "bench") as endpoint:
            store = s3_storage("bench", endpoint_url=endpoint, region_name="us-east-1",
                               aws_access_key_id="k", aws_secret_access_key="s")  # fmt: skip
            put_from(store, "inputs/clip.mp4", video)  # type: ignore[arg-type]
            info, (pts, _) = probe_frames(video)
            per_chunk = round(args.chunk_s * args.fps)
            start = (len(pts) // per_chunk // 2) * per_chunk
            stop = min(start + per_chunk, len(pts))

            began = time.perf_counter()
            copy = fetch_to(store, "inputs/clip.mp4", work / "downloaded.mp4")  # type: ignore[arg-type]
            downloaded_s = time.perf_counter() - began
            want = list(read_frames(copy, start, stop, timestamps=pts))
            whole_s = time.perf_counter() - began

            began = time.perf_counter()
            source = read_in_place(store, "inputs/clip.mp4", work / "input",  # type: ignore[arg-type]
                                   block_size=int(args.block_mib * (1 << 20)))  # fmt: skip
            assert isinstance(source, RangedSource)
            got = list(read_frames(source, start, stop, timestamps=pts))
            in_place_s = time.perf_counter() - began
        same = [f.pts for f in got] == [f.pts for f in want] and all(
            np.array_equal(a.image, b.image) for a, b in zip(got, want, strict=True)
        )
        assert same, "the frames read in place differ from the downloaded file's"
        print(
            json.dumps(
                {
                    "video": f"{args.width}x{args.height} {args.fps} fps {args.seconds} s",
                    "object_bytes": info.size_bytes,
                    "chunk_frames": [start, stop],
                    "block_bytes": source.block_size,
                    "in_place_fetched_bytes": source.fetched_bytes,
                    "in_place_share": round(source.fetched_bytes / info.size_bytes, 4),
                    "in_place_requests": source.requests,
                    "in_place_s": round(in_place_s, 3),
                    "download_s": round(downloaded_s, 3),
                    "download_and_decode_s": round(whole_s, 3),
                    "encode_clip_s": round(encoded_s, 1),
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
