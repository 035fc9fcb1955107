"""Video watermark bench: cost and robustness of ``watermark.VIDEO`` in H.264 frames.

Run: ``.venv/bin/python bench/video_mark.py [--frames 30] [--json]``.

For each size (480x360 and 1280x720) a clip of ``--frames`` frames (``faceflow.clips.
pan_frames``: a slow pan over two sample photos, 15 fps) is marked frame by frame with a
random payload and encoded as the render pass encodes it (``tasks.video_io.SegmentWriter``:
libx264 CRF 18, preset veryfast). Then it is re-encoded from its decoded frames with
libx264 (preset medium) at 50, 40 and 30 % of that encode's bitrate, as a platform that
re-compresses uploads would. Prints per size: ms to embed and to read one frame (median),
the bit accuracy of single frames (hard bits of each frame's soft votes) after our encode
and after each re-encode, whether ``read_video`` (3 runs x 8 frames, majority vote) reads
the payload back whole, the PSNR of the marked frames against the unmarked ones (before
encoding), and the bytes the mark adds to our encode. Asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cv2
import numpy as np

from faceflow.clips import pan_frames, reencode, write_clip
from tasks import watermark
from tasks.types import RGBImage
from tasks.video_io import probe_video, read_frames

SIZES = ((480, 360), (1280, 720))
FRACTIONS = (0.5, 0.4, 0.3)


def _decoded(path: Path) -> list[RGBImage]:
    return [f.image for f in read_frames(path, 0, 10**9)]


def _frame_accuracy(frames: Sequence[RGBImage], bits: list[int]) -> float:
    want = np.asarray(bits)
    accs = []
    for frame in frames:
        scores = watermark.VIDEO.scores(frame)
        assert scores is not None
        accs.append(float(np.mean((scores > 0).astype(int) == want)))
    return statistics.fmean(accs)


def _whole(frames: Sequence[RGBImage], payload: watermark.Payload) -> bool:
    n = len(frames)
    starts = [0, max(0, n // 2 - 4), max(0, n - 8)]
    return watermark.read_video([frames[s : s + 8] for s in starts]) == payload


def _ms(fn: Callable[[], object], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def bench_size(width: int, height: int, count: int, rng: random.Random) -> dict[str, object]:
    """The figures of one frame size."""
    payload = watermark.Payload(watermark.SERVICE_MARK, rng.getrandbits(watermark.TAG_BITS))
    bits = payload.bits()
    plain = pan_frames(width, height, count)
    marked = [watermark.VIDEO.embed(f, payload) for f in plain]
    row: dict[str, object] = {
        "size": f"{width}x{height}",
        "embed_ms": round(_ms(lambda: watermark.VIDEO.embed(plain[0], payload), 15), 2),
        "read_ms": round(_ms(lambda: watermark.VIDEO.scores(marked[0]), 15), 2),
        "psnr_db": round(min(cv2.PSNR(a, b) for a, b in zip(plain, marked, strict=True)), 1),
    }
    with tempfile.TemporaryDirectory() as tmp:
        ours, bare = Path(tmp) / "marked.mp4", Path(tmp) / "plain.mp4"
        size = write_clip(marked, ours)
        row["bytes_added"] = size - write_clip(plain, bare)
        row["bytes_added_pct"] = round(100 * (size / bare.stat().st_size - 1), 1)
        decoded = _decoded(ours)
        row["acc_crf18"] = round(_frame_accuracy(decoded, bits), 3)
        row["whole_crf18"] = _whole(decoded, payload)
        row["false_positive_unmarked"] = watermark.read_video([_decoded(bare)[:8]]) is not None
        bit_rate = int(size * 8 / probe_video(ours).duration_s)
        for fraction in FRACTIONS:
            again = Path(tmp) / f"again-{fraction}.mp4"
            reencode(ours, again, int(bit_rate * fraction))
            frames = _decoded(again)
            pct = round(fraction * 100)
            row[f"acc_{pct}pct"] = round(_frame_accuracy(frames, bits), 3)
            row[f"whole_{pct}pct"] = _whole(frames, payload)
    return row


def main(argv: list[str] | None = None) -> None:
    """Print the figures, one row per size."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--frames", type=int, default=30)
    parser.add_argument("--seed", type=int, default=25)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    rows = [bench_size(w, h, args.frames, rng) for w, h in SIZES]
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    for row in rows:
        print(" ".join(f"{k}={v}" for k, v in row.items()))


if __name__ == "__main__":
    main()
